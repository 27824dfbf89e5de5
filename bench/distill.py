"""Distillation benchmarks: step time vs the target forward, loss-step peak memory, and the head comparison.

    python -m bench.distill step    [--threads 1] [--out bench/results/distill.json]
    python -m bench.distill compare --heads NAME=RUN_DIR ... [--out bench/results/distill_compare.json]
    python -m bench.distill cached  --name NAME --target DIR [--dataset DIR] [--out bench/results/distill_cached.json]
    python -m bench.distill vocab   [--target DIR --head HEAD] [--out bench/results/distill_vocab.json]

`step` measures, on one machine and one batch:

1. time: one distillation step (target forward + packed head forward + chunked loss + backward + AdamW)
   against the target forward alone on the same packed batch (the quickstart's shapes: the shipped small
   toy target, 8 rows x 256 tokens of toy documents, 32 anchors x block 16). Median of `--reps` after
   `--warmup` untimed runs.
2. peak memory of the loss step at vocab 32k: synthetic `[N, H]` student/teacher hidden states and a random
   `32000 x H` lm_head; forward + backward of `chunked_kl_loss` (logits `chunk_size` rows at a time,
   recomputed in backward) against a naive implementation that builds the full `[N, V]` student and
   teacher logits. Each variant runs in a FRESH subprocess that resets its kernel peak-RSS mark
   (`/proc/self/clear_refs`), runs the loss step and reads the new peak (`VmHWM`); peak minus the RSS
   before the step is the memory the loss step added on top of its inputs. RSS is what the OS actually
   had to back with RAM (allocator caching included): a measurement, not an estimate from shapes.

`cached` measures the teacher cache (jetflow_pl/training/teacher_cache.py) against the online path on one
target, each part in a FRESH subprocess: (1) the cache build (tokens/s, size on disk, peak RSS over the
loaded target); (2) step time: one process, the same `DistillDataModule` batches through both paths
alternately (online step, cached step, then the online path's target forward alone), so a load change on
a shared machine hits both alike; wall and process CPU seconds (CPU seconds at 1 thread are the stable
number when other jobs share the cores); step = `distill_step` + backward + AdamW, the cached one also
with its batch's read from the cache; (3) peak RSS per path, one process each (the whole process, and what
the timed steps add over the set-up process); (4) what float16 / bfloat16 storage does to the taps, the
teacher distribution and the loss/grads against float32 storage of the same features. Without `--dataset`
it tokenizes `--n-docs` toy training records (prompt + reference response, the target's chat template)
into a dataset folder of the regeneration schema: it measures speed, not quality.

`vocab` times a cached-path training step over the head's draft vocabulary (`draft_vocab` of
`DistillationModule`) against one over the full vocabulary, alternating on the same batches (`bench_vocab`).

`compare` runs `bench/decode.py` (real speculative decoding, greedy, tau = tokens per target verify
forward) for each trained head on held-out toy prompts at several budgets and collects tau per budget
with each run's training wall time (from the run folder's file times: CSV-logger hparams written at fit
start -> `checkpoints/last.ckpt` at the end; the data preparation before fit is not included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from jetflow_pl.files import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = 1 << 20  # bytes; glibc's MALLOC_MMAP_THRESHOLD_ for the memory subprocesses


def machine(threads: int) -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": threads,
        "device": "cpu",
        "load_average_at_start": list(os.getloadavg()),
    }


# ---------------------------------------------------------------------------------------------- time
def bench_step_time(args: argparse.Namespace) -> dict:
    from data_gen.toy.documents import toy_documents
    from jetflow_pl.training.data import pack_documents
    from jetflow_pl.training.module import DistillationModule
    from jetflow_pl.training.step import distill_step, prepare_blocks, target_packing_mask

    module = DistillationModule(
        target_path=str(args.target),
        num_head_layers=1,
        block_size=args.block_size,
        num_anchors=args.num_anchors,
        chunk_size=4096,
        seed=0,
    )
    target, head = module.target, module.head
    docs = toy_documents(args.target, {"math": 400}, seed=0)
    rows = pack_documents(docs, args.seq_len, pad_token_id=0, split_documents=False)
    ids = rows["input_ids"][: args.batch_size]
    lm = rows["loss_mask"][: args.batch_size]
    doc = rows["doc_ids"][: args.batch_size]
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def target_forward() -> None:
        with torch.no_grad():
            bb = prepare_blocks(
                ids, lm, doc, block_size=head.block_size, num_anchors=args.num_anchors,
                mask_token_id=head.mask_token_id, generator=gen,
            )  # fmt: skip
            target(
                ids,
                position_ids=bb.context_positions,
                attention_mask=target_packing_mask(doc, target.dtype),
                logits_positions=None,
                return_hidden=True,
                use_cache=False,
            )

    def step(backward: bool) -> dict:
        out = distill_step(
            target, head, ids, lm, doc, num_anchors=args.num_anchors, chunk_size=4096, generator=gen
        )
        if backward:
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            opt.step()
        return out

    def timed(fn, *a) -> list[float]:
        for _ in range(args.warmup):
            fn(*a)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn(*a)
            times.append(time.perf_counter() - t0)
        return times

    t_target = timed(target_forward)
    t_fwd = timed(lambda: torch.no_grad()(step)(False))
    t_step = timed(step, True)
    out = step(False)
    med = statistics.median
    return {
        "target": str(args.target),
        "batch": {
            "rows": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]),
            "num_anchors": args.num_anchors,
            "block_size": head.block_size,
            "valid_blocks": int(out["num_blocks"]),
            "loss_rows": int(out["num_rows"]),
            "vocab": int(target.vocab_size),
            "hidden": int(target.hidden_size),
            "head_params": sum(p.numel() for p in head.parameters()),
        },
        "reps": args.reps,
        "warmup": args.warmup,
        "target_forward_s": {"median": med(t_target), "all": t_target},
        "distill_forward_no_grad_s": {"median": med(t_fwd), "all": t_fwd},
        "distill_step_s": {"median": med(t_step), "all": t_step},
        "distill_step_over_target_forward": med(t_step) / med(t_target),
        "what": "distill_step = target forward (no grad) + anchors/masks + packed head forward + chunked "
        "forward-KL loss + backward + AdamW step, on the same batch as target_forward",
    }


# -------------------------------------------------------------------------------------------- memory
def _naive_loss(student: torch.Tensor, teacher: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
    """Forward KL with the full `[N, V]` student and teacher logits (what chunking avoids)."""
    s = lm_head(student).float()
    with torch.no_grad():
        t = lm_head(teacher).float()
    log_q = torch.log_softmax(s, -1)
    log_p = torch.log_softmax(t, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def memory_child(impl: str, rows: int, hidden: int, vocab: int, chunk: int, threads: int) -> dict:
    """Runs in a fresh process: build the inputs, then one loss forward + backward; report peak RSS."""
    torch.set_num_threads(threads)
    from jetflow_pl.training.losses import chunked_kl_loss

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    student = torch.randn(rows, hidden, requires_grad=True)
    teacher = torch.randn(rows, hidden)
    # touch everything once so that the inputs are resident before the baseline is read
    _ = (lm_head.weight.sum(), student.sum(), teacher.sum())
    hwm_reset = _reset_peak_rss()
    before_rss = _status_kib("VmRSS")
    before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    if impl == "chunked":
        loss, _ = chunked_kl_loss(student, teacher, lm_head, chunk_size=chunk)
    else:
        loss = _naive_loss(student, teacher, lm_head)
    loss.backward()
    seconds = time.perf_counter() - t0
    if hwm_reset:  # the kernel's high-water mark since the reset: the loss step's own peak
        delta = _status_kib("VmHWM") - before_rss
    else:  # peak of the whole process; understates a step that stays below an earlier peak
        delta = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_peak
    return {
        "impl": impl,
        "chunk_size": chunk if impl == "chunked" else None,
        "loss": float(loss.detach()),
        "grad_norm": float(student.grad.norm()),
        "rss_before_mib": before_rss / 1024,
        "peak_source": "VmHWM after clear_refs=5" if hwm_reset else "ru_maxrss",
        "loss_step_peak_delta_mib": delta / 1024,
        "seconds": seconds,
    }


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset this process's peak-RSS high-water mark (Linux: `echo 5 > /proc/self/clear_refs`)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def bench_memory(args: argparse.Namespace) -> dict:
    runs = []
    variants = [("naive", 0)] + [("chunked", c) for c in args.chunks]
    for impl, chunk in variants:
        cmd = [
            sys.executable, "-m", "bench.distill", "_memory_child", "--impl", impl,
            "--rows", str(args.rows), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
            "--chunk", str(chunk), "--threads", str(args.threads),
        ]  # fmt: skip
        # large allocations straight from mmap, so freed tensors leave the RSS (glibc otherwise keeps
        # freed heap chunks resident and the peak would mix allocator history into the measurement)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=REPO)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(
            f"memory {impl:8s} chunk {chunk:5d}: +{runs[-1]['loss_step_peak_delta_mib']:8.1f} MiB "
            f"peak RSS, {runs[-1]['seconds']:.2f}s",
            flush=True,
        )
    naive = runs[0]
    for r in runs[1:]:
        assert abs(r["loss"] - naive["loss"]) < 1e-3 * max(1.0, abs(naive["loss"])), (r, naive)
    one_logits_mib = args.rows * args.vocab * 4 / 2**20
    return {
        "method": "kernel-reported peak resident set size: each variant in a fresh subprocess builds its "
        "inputs, resets the peak (/proc/self/clear_refs = 5), runs one loss forward+backward and reads "
        "VmHWM; delta = VmHWM - VmRSS before the step (falls back to ru_maxrss deltas where the reset "
        "is not allowed; see peak_source per run). Children run with MALLOC_MMAP_THRESHOLD_="
        f"{MMAP_THRESHOLD} so freed tensors are returned to the OS instead of staying resident in glibc's heap",
        "rows": args.rows,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "one_fp32_logits_tensor_mib": one_logits_mib,
        "runs": runs,
        "naive_over_chunked": {
            str(r["chunk_size"]): naive["loss_step_peak_delta_mib"] / max(r["loss_step_peak_delta_mib"], 1e-9)
            for r in runs[1:]
        },
        "losses_equal": True,
    }


# ------------------------------------------------------------------------------------------- compare
def _run_wall_s(run_dir: Path) -> float | None:
    start = sorted(run_dir.glob("logs/version_*/hparams.yaml"))
    end = run_dir / "checkpoints" / "last.ckpt"
    if not start or not end.is_file():
        return None
    return end.stat().st_mtime - start[-1].stat().st_mtime


def bench_compare(args: argparse.Namespace) -> dict:
    from bench import decode

    out: dict = {
        "machine": machine(args.threads),
        "command": " ".join(["python", "-m", "bench.distill", *sys.argv[1:]]),
        "what": "real speculative decoding (bench/decode.py, greedy, width "
        f"{args.width}) with each head on {args.n_prompts} held-out toy {args.domain} prompts, "
        f"{args.max_new_tokens} new tokens; tau = tokens committed per target verify forward",
        "train_wall_s_note": "from file times (fit start -> last.ckpt); runs shared 2 CPU cores with "
        "other jobs, so wall times compare machines' load as much as methods",
        "heads": {},
    }
    if args.update and args.out.is_file():  # add/replace heads in an earlier result (heads run in turns)
        out["heads"] = json.loads(args.out.read_text()).get("heads", {})
    for spec in args.heads:
        name, run = spec.split("=", 1)
        run_dir = Path(run)
        head = run_dir / "head" / "best"
        tmp = run_dir / "decode_compare.json"
        res = decode.main(
            [
                "--head", str(head), "--domains", args.domain, "--n-prompts", str(args.n_prompts),
                "--budgets", *map(str, args.budgets), "--max-new-tokens", str(args.max_new_tokens),
                "--width", str(args.width), "--threads", str(args.threads), "--out", str(tmp),
            ]
        )  # fmt: skip
        spec_rows = res["domains"][args.domain]["speculative"]
        info = json.loads((head / "export_info.json").read_text())
        hp = {}
        hp_files = sorted(run_dir.glob("logs/version_*/hparams.yaml"))
        if hp_files:
            import yaml

            hp = yaml.safe_load(hp_files[-1].read_text()) or {}
        out["heads"][name] = {
            "run_dir": str(run_dir),
            "head": str(head),
            "loss": hp.get("loss"),
            "causal": hp.get("causal"),
            "best_step": info.get("global_step"),
            "train_val_tau_at_best": info.get("value"),
            "train_wall_s": _run_wall_s(run_dir),
            "tau": {b: spec_rows[b]["tau"] for b in spec_rows},
            "mismatches_vs_ar": {b: spec_rows[b]["mismatches_vs_ar"] for b in spec_rows},
        }
        print(name, {b: round(v, 3) for b, v in out["heads"][name]["tau"].items()}, flush=True)
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return out


# -------------------------------------------------------------------------------------------- cached
def _status_all() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1])
    return out


def bench_dataset(target: Path, out: Path, n_docs: int, seed: int = 0) -> Path:
    """A regeneration-schema dataset of toy training records in the target's chat format (bench data)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from data_gen.toy.splits import train_records
    from data_gen.toy.tokenizer import format_example

    if (out / "dataset").is_dir():
        return out
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    rows = []
    per = {"math": n_docs // 2, "code": n_docs // 4, "prose": n_docs - n_docs // 2 - n_docs // 4}
    for domain, n in per.items():
        for r in train_records(domain, n, seed):
            ids, mask = format_example(tok, r["prompt"], r["response"])
            p = mask.index(True) if True in mask else len(mask)
            rows.append(
                {
                    "id": f"{domain}-{len(rows):06d}",
                    "domain": domain,
                    "input_ids": ids,
                    "loss_mask": [int(m) for m in mask],
                    "prompt_len": p,
                    "response": r["response"],
                    "finish_reason": "eos",
                }
            )
    tmp = out.with_name(out.name + ".tmp")
    Dataset.from_list(rows).save_to_disk(str(tmp / "dataset"))
    os.rename(tmp, out)
    return out


def _cached_setup(args: argparse.Namespace, cache: bool):
    from jetflow_pl.training.data import DistillDataModule
    from jetflow_pl.training.module import DistillationModule

    module = DistillationModule(
        target_path=str(args.target),
        num_head_layers=1,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        num_anchors=args.num_anchors,
        chunk_size=args.chunk_size,
        seed=0,
    )
    dm = DistillDataModule(
        dataset_path=str(args.dataset),
        seq_len=args.seq_len,
        split_documents=False,
        batch_size=args.batch_size,
        val_fraction=0.0,
        teacher_cache=str(args.cache) if cache else None,
        teacher_cache_dtype=args.dtype,
        teacher_cache_shard_mb=args.shard_mb,
    )
    dm.attach_teacher(*module.teacher_source())
    return module, dm


def cached_child_build(args: argparse.Namespace) -> dict:
    """Fresh process: build the cache (timed) and report its size and the build's peak RSS."""
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    module, dm = _cached_setup(args, cache=True)
    setup_s = time.perf_counter() - t0
    before = _status_all()
    _reset_peak_rss()
    stats = dm.build_teacher_cache(progress=True)
    after = _status_all()
    size = sum(p.stat().st_size for p in Path(args.cache).rglob("*") if p.is_file())
    return {
        "storage_dtype": args.dtype,
        "shard_mb": args.shard_mb,
        "module_setup_s": setup_s,
        "shards": stats.shards_total,
        "tokens": stats.tokens_built,
        "seconds": stats.seconds,
        "tokens_per_s": stats.tokens_per_s,
        "bytes_on_disk": size,
        "bytes_per_token": size / max(1, stats.tokens_built),
        "rss_before_build_mib": before["VmRSS"] / 1024,
        "build_peak_over_before_mib": (after["VmHWM"] - before["VmRSS"]) / 1024,
        "largest_shard_buffer_mib": stats.max_shard_bytes / 2**20,
    }


def cached_child_step(args: argparse.Namespace) -> dict:
    """Fresh process: set up one path (online or cached), then time `reps` training steps."""
    torch.set_num_threads(args.threads)
    from jetflow_pl.training.step import distill_step

    cached = args.path == "cached"
    t0 = time.perf_counter()
    module, dm = _cached_setup(args, cache=cached)
    dm.setup("fit")
    target, head = module.target, module.head
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    loader = iter(dm.train_dataloader())
    setup_s = time.perf_counter() - t0

    def step() -> dict:
        batch = next(loader)
        out = distill_step(
            target,
            head,
            batch["input_ids"],
            batch["loss_mask"],
            batch["doc_ids"],
            num_anchors=args.num_anchors,
            chunk_size=args.chunk_size,
            generator=gen,
            taps=batch.get("taps"),
            teacher_hidden=batch.get("teacher_hidden"),
        )
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        return out

    for _ in range(args.warmup):
        step()
    before = _status_all()
    _reset_peak_rss()
    times, cpu, rows = [], [], []
    for _ in range(args.reps):
        t, c = time.perf_counter(), time.process_time()
        out = step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        rows.append(int(out["num_rows"]))
    after = _status_all()
    return {
        "path": args.path,
        "setup_s": setup_s,
        "step_s": {"median": statistics.median(times), "all": times},
        "step_cpu_s": {"median": statistics.median(cpu), "all": cpu},
        "loss_rows_per_step": rows,
        "rss_after_setup_mib": before["VmRSS"] / 1024,
        "steps_peak_over_setup_mib": (after["VmHWM"] - before["VmRSS"]) / 1024,
        "process_peak_rss_mib": max(after["VmHWM"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        / 1024,
    }


def cached_child_time(args: argparse.Namespace) -> dict:
    """Fresh process, both paths on the SAME rows, steps alternating online / cached (so a load change on a
    shared machine hits both alike), plus the online path's target forward alone on the same batch.

    Wall time and this process's CPU time (user + system, all threads) per step: on a machine shared with
    other jobs the wall time also measures the others' load, the CPU time mostly the work itself."""
    torch.set_num_threads(args.threads)
    from jetflow_pl.training.masks import document_positions
    from jetflow_pl.training.step import distill_step, target_features

    module, dm_cached = _cached_setup(args, cache=True)
    dm_cached.setup("fit")
    target, head = module.target, module.head
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    loader = iter(dm_cached.train_dataloader())

    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def since(t: tuple[float, float]) -> tuple[float, float]:
        return time.perf_counter() - t[0], time.process_time() - t[1]

    def step(batch: dict, cached: bool, seed: int) -> tuple[tuple[float, float], int]:
        t = clock()
        out = distill_step(
            target, head, batch["input_ids"], batch["loss_mask"], batch["doc_ids"],
            num_anchors=args.num_anchors, chunk_size=args.chunk_size,
            generator=torch.Generator().manual_seed(seed),
            taps=batch["taps"] if cached else None, teacher_hidden=batch["teacher_hidden"] if cached else None,
        )  # fmt: skip
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        return since(t), int(out["num_rows"])

    keys = ("online", "cached", "cached_with_fetch", "target_forward")
    wall: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    rows = []
    for i in range(args.warmup + args.reps):
        t = clock()
        batch = next(loader)
        fetch = since(t)
        on, n_rows = step(batch, cached=False, seed=i)
        ca, _ = step(batch, cached=True, seed=i)
        ids, doc = batch["input_ids"], batch["doc_ids"]
        t = clock()
        target_features(target, ids, doc, document_positions(doc, *ids.shape))
        tf = since(t)
        if i >= args.warmup:
            for k, v in (("online", on), ("cached", ca), ("target_forward", tf)):
                wall[k].append(v[0])
                cpu[k].append(v[1])
            wall["cached_with_fetch"].append(ca[0] + fetch[0])
            cpu["cached_with_fetch"].append(ca[1] + fetch[1])
            rows.append(n_rows)
    med_w = {k: statistics.median(v) for k, v in wall.items()}
    med_c = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "what": "one process, the same batch through both paths per iteration (online, then cached), "
        "anchors seeded alike; cached_with_fetch adds the batch's read from the cache; target_forward = "
        "the online path's target forward alone on that batch; wall and process CPU seconds",
        "median_wall_s": med_w,
        "median_cpu_s": med_c,
        "all_wall_s": wall,
        "all_cpu_s": cpu,
        "loss_rows_per_step": rows,
        "online_over_cached_wall": med_w["online"] / med_w["cached_with_fetch"],
        "online_over_cached_cpu": med_c["online"] / med_c["cached_with_fetch"],
    }


def cached_child_dtypes(args: argparse.Namespace) -> dict:
    """What float16 / bfloat16 storage of the same features does, against float32 storage."""
    torch.set_num_threads(args.threads)
    from jetflow_pl.training.anchors import sample_anchors
    from jetflow_pl.training.masks import document_positions
    from jetflow_pl.training.step import distill_step, target_features

    module, dm = _cached_setup(args, cache=False)
    dm.setup("fit")
    target, head = module.target, module.head
    H = target.hidden_size
    loader = iter(dm.train_dataloader())
    report: dict = {"tap_layer_ids": list(head.target_layer_ids), "batches": args.dtype_batches}
    acc: dict = {name: {} for name in ("float16", "bfloat16")}
    absmax = {"taps_per_layer": [0.0] * len(head.target_layer_ids), "hidden": 0.0}
    for _ in range(args.dtype_batches):
        batch = next(loader)
        ids, lm, doc = batch["input_ids"], batch["loss_mask"], batch["doc_ids"]
        B, S = ids.shape
        taps, hidden = target_features(target, ids, doc, document_positions(doc, B, S))
        real = doc < doc.max(dim=1, keepdim=True).values  # the padding tail is the last doc id of a row
        for j in range(len(head.target_layer_ids)):
            absmax["taps_per_layer"][j] = max(
                absmax["taps_per_layer"][j], float(taps[..., j * H : (j + 1) * H][real].abs().max())
            )
        absmax["hidden"] = max(absmax["hidden"], float(hidden[real].abs().max()))
        g = torch.Generator().manual_seed(1)
        anchors = sample_anchors(lm, doc, head.block_size, args.num_anchors, g)
        ref = {}
        for name, dt in (
            ("float32", torch.float32),
            ("float16", torch.float16),
            ("bfloat16", torch.bfloat16),
        ):
            tq, hq = taps.to(dt).float(), hidden.to(dt).float()
            head.zero_grad(set_to_none=True)
            out = distill_step(
                target, head, ids, lm, doc, num_anchors=args.num_anchors, chunk_size=args.chunk_size,
                anchors=anchors, taps=tq, teacher_hidden=hq, return_hidden=True,
            )  # fmt: skip
            out["loss"].backward()
            grad = torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
            t_logp = torch.log_softmax(target.lm_logits(out["teacher_hidden"].detach()).float(), -1)
            res = {
                "loss": float(out["loss"].detach()),
                "grad": grad,
                "t_logp": t_logp,
                "taps": tq,
                "hidden": hq,
            }
            if name == "float32":
                ref = res
                continue
            a = acc[name]
            tap_err = (tq - taps)[real]
            a.setdefault("taps_max_abs_err", []).append(float(tap_err.abs().max()))
            a.setdefault("taps_rel_fro_err", []).append(float(tap_err.norm() / taps[real].norm()))
            small = taps[real].abs() < 100  # the ordinary channels, away from the massive ones
            a.setdefault("taps_max_rel_err_where_abs_lt_100", []).append(
                float((tap_err[small].abs() / taps[real][small].abs().clamp_min(1e-3)).max())
            )
            a.setdefault("hidden_rel_fro_err", []).append(
                float((hq - hidden)[real].norm() / hidden[real].norm())
            )
            kl = (ref["t_logp"].exp() * (ref["t_logp"] - t_logp)).sum(-1)
            a.setdefault("teacher_kl_mean", []).append(float(kl.mean()))
            a.setdefault("teacher_kl_max", []).append(float(kl.max()))
            a.setdefault("teacher_top1_agree", []).append(
                float((ref["t_logp"].argmax(-1) == t_logp.argmax(-1)).float().mean())
            )
            a.setdefault("loss_rel_err", []).append(abs(res["loss"] - ref["loss"]) / abs(ref["loss"]))
            g, g0 = res["grad"], ref["grad"]
            a.setdefault("grad_rel_err", []).append(float((g - g0).norm() / g0.norm()))
            a.setdefault("grad_cosine", []).append(
                float(torch.nn.functional.cosine_similarity(g.double(), g0.double(), dim=0))
            )
    for name, a in acc.items():
        report[name] = {k: {"max": max(v), "mean": sum(v) / len(v)} for k, v in a.items()}
        lim = float(torch.finfo(torch.float16 if name == "float16" else torch.bfloat16).max)
        report[name]["range_max"] = lim
    report["absmax_observed"] = absmax
    report["float16_headroom"] = float(torch.finfo(torch.float16).max) / max(
        max(absmax["taps_per_layer"]), absmax["hidden"]
    )
    return report


def _child(args: argparse.Namespace, kind: str, extra: list[str] = ()) -> dict:
    cmd = [
        sys.executable, "-m", "bench.distill", "_cached_child", kind,
        "--target", str(args.target), "--dataset", str(args.dataset), "--cache", str(args.cache),
        "--dtype", args.dtype, "--shard-mb", str(args.shard_mb), "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len), "--num-anchors", str(args.num_anchors),
        "--block-size", str(args.block_size), "--chunk-size", str(args.chunk_size),
        "--mask-token-id", str(args.mask_token_id), "--reps", str(args.reps), "--warmup", str(args.warmup),
        "--threads", str(args.threads), "--dtype-batches", str(args.dtype_batches), *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, env=env, cwd=REPO)
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_cached(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.mask_token_id is None:
        from jetflow_pl.training.module import default_mask_token_id

        args.mask_token_id = default_mask_token_id(args.target)
    if args.dataset is None:
        args.dataset = bench_dataset(args.target, work / f"{args.name}_data", args.n_docs)
    if args.cache is None:
        args.cache = work / f"{args.name}_cache_{args.dtype}"
    if args.rebuild and args.cache.exists():
        import shutil

        shutil.rmtree(args.cache)
    from datasets import load_from_disk

    ds = load_from_disk(
        str(Path(args.dataset) / "dataset" if (Path(args.dataset) / "dataset").is_dir() else args.dataset)
    )
    lengths = [len(x) for x in ds["input_ids"]]
    result = {
        "name": args.name,
        "target": str(args.target),
        "dataset": {"path": str(args.dataset), "docs": len(lengths), "tokens": sum(lengths),
                    "mean_len": sum(lengths) / len(lengths), "max_len": max(lengths)},
        "batch": {"rows": args.batch_size, "seq_len": args.seq_len, "num_anchors": args.num_anchors,
                  "block_size": args.block_size, "chunk_size": args.chunk_size, "head_layers": 1,
                  "mask_token_id": args.mask_token_id},
        "reps": args.reps,
        "warmup": args.warmup,
    }  # fmt: skip
    print(f"[{args.name}] building the cache ({args.dtype}) ...", flush=True)
    from jetflow_pl.training.teacher_cache import cache_ready

    if cache_ready(args.cache):  # an earlier entry's cache (same target, taps, data): its build is there
        result["build"] = {"reused_cache": str(args.cache)}
    else:
        result["build"] = _child(args, "build")
        print(f"[{args.name}] build: {result['build']['tokens_per_s']:.0f} tokens/s", flush=True)
    result["time"] = _child(args, "time")
    for unit in ("wall", "cpu"):
        tm = result["time"][f"median_{unit}_s"]
        print(
            f"[{args.name}] step {unit} time (alternating, same batches): online {tm['online']:.2f} s, cached "
            f"{tm['cached_with_fetch']:.2f} s (fetch included), target forward alone {tm['target_forward']:.2f} s",
            flush=True,
        )
    for path in ("online", "cached"):
        result[path] = _child(args, "step", ["--path", path, "--reps", str(args.rss_reps)])
        r = result[path]
        print(
            f"[{args.name}] {path:6s} (own process): step {r['step_s']['median'] * 1e3:8.1f} ms, process peak "
            f"RSS {r['process_peak_rss_mib']:7.1f} MiB, steps add {r['steps_peak_over_setup_mib']:7.1f} MiB",
            flush=True,
        )
    if args.dtype_batches > 0:
        result["storage_dtypes"] = _child(args, "dtypes")
    return result


# ----------------------------------------------------------------------------------------- vocab
def bench_vocab(args: argparse.Namespace) -> dict:
    """A training step over the draft vocabulary against one over the full vocabulary, same process.

    The shipped config's shapes: the head of `--head` (its layers, taps and draft vocabulary), batches of
    whole toy documents in the target's chat format, bf16 autocast as `precision: bf16-mixed`, the
    target's features computed once per batch and fed to both steps as a teacher cache feeds them.
    Steps alternate full / draft on the same batch and anchors, so a load change hits both alike. Also
    reports the teacher's probability mass outside the set on those loss rows: what the restricted loss
    leaves out of the teacher's distribution.
    """
    torch.set_num_threads(args.threads)
    from data_gen.toy.documents import toy_documents
    from jetflow_pl.head.draft_vocab import draft_vocab_of
    from jetflow_pl.training.data import pack_documents
    from jetflow_pl.training.masks import document_positions
    from jetflow_pl.training.module import DistillationModule
    from jetflow_pl.training.step import distill_step, target_features

    module = DistillationModule(
        target_path=str(args.target), init_head_path=str(args.head), draft_vocab=str(args.head),
        num_anchors=args.num_anchors, chunk_size=args.chunk_size, seed=0,
    )  # fmt: skip
    target, head = module.target, module.head.train()
    vocab = draft_vocab_of(head)
    docs = toy_documents(args.target, {"math": 3 * args.batch_size, "code": args.batch_size}, seed=0)
    rows = pack_documents(docs, args.seq_len, pad_token_id=0, split_documents=False)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-5)
    n = rows["input_ids"].shape[0] // args.batch_size
    batches = []
    for i in range(n):
        sl = slice(i * args.batch_size, (i + 1) * args.batch_size)
        ids, lm, doc = rows["input_ids"][sl], rows["loss_mask"][sl], rows["doc_ids"][sl]
        taps, hidden = target_features(target, ids, doc, document_positions(doc, *ids.shape))
        batches.append((ids, lm, doc, taps, hidden))

    def step(batch, seed: int, restricted: bool) -> tuple[float, float, dict]:
        ids, lm, doc, taps, hidden = batch
        t, c = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = distill_step(
                target, head, ids, lm, doc, num_anchors=args.num_anchors, chunk_size=args.chunk_size,
                generator=torch.Generator().manual_seed(seed), taps=taps, teacher_hidden=hidden,
                draft_vocab=vocab if restricted else None, return_hidden=True,
            )  # fmt: skip
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        return time.perf_counter() - t, time.process_time() - c, out

    wall: dict[str, list[float]] = {"full": [], "draft": []}
    cpu: dict[str, list[float]] = {"full": [], "draft": []}
    outside, loss_rows = [], []
    for i in range(args.warmup + args.reps):
        batch = batches[i % len(batches)]
        w_f, c_f, out = step(batch, i, restricted=False)
        w_d, c_d, _ = step(batch, i, restricted=True)
        if i < args.warmup:
            continue
        wall["full"].append(w_f)
        wall["draft"].append(w_d)
        cpu["full"].append(c_f)
        cpu["draft"].append(c_d)
        loss_rows.append(int(out["num_rows"]))
        with torch.no_grad():
            p = torch.softmax(target.lm_head(out["teacher_hidden"].float()).float(), dim=-1)
            outside.append(float(1.0 - p[:, vocab].sum(-1).mean()))
    med = statistics.median
    return {
        "target": str(args.target),
        "head": str(args.head),
        "machine": machine(args.threads),
        "batch": {"rows": args.batch_size, "seq_len": args.seq_len, "num_anchors": args.num_anchors,
                  "block_size": head.block_size, "head_layers": head.config.num_hidden_layers,
                  "chunk_size": args.chunk_size, "loss_rows_per_step": loss_rows,
                  "vocab": int(target.vocab_size), "draft_vocab": int(vocab.numel())},
        "reps": args.reps,
        "warmup": args.warmup,
        "what": "cached-path training step (head forward, chunked forward-KL, backward, AdamW) under bf16 "
        "autocast, over the full vocabulary vs the head's draft vocabulary, alternating on the same "
        "batches and anchors; wall and process CPU seconds",
        "median_wall_s": {k: med(v) for k, v in wall.items()},
        "median_cpu_s": {k: med(v) for k, v in cpu.items()},
        "all_wall_s": wall,
        "all_cpu_s": cpu,
        "full_over_draft_wall": med(wall["full"]) / med(wall["draft"]),
        "full_over_draft_cpu": med(cpu["full"]) / med(cpu["draft"]),
        "teacher_mass_outside_draft_vocab": {"mean": statistics.mean(outside), "per_step": outside},
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step", help="step time vs target forward; loss-step peak memory at vocab 32k")
    s.add_argument("--target", type=Path, default=REPO / "data_gen/toy/assets/small")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--seq-len", type=int, default=256)
    s.add_argument("--num-anchors", type=int, default=32)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--rows", type=int, default=2048, help="loss rows N of the memory benchmark")
    s.add_argument("--hidden", type=int, default=1024)
    s.add_argument("--vocab", type=int, default=32000)
    s.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--out", type=Path, default=REPO / "bench/results/distill.json")
    c = sub.add_parser("compare", help="decoder tau per budget for several trained heads")
    c.add_argument("--heads", nargs="+", required=True, help="NAME=RUN_DIR (its head/best is measured)")
    c.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    c.add_argument("--domain", default="math")
    c.add_argument("--n-prompts", type=int, default=20)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--width", type=int, default=4)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--out", type=Path, default=REPO / "bench/results/distill_compare.json")
    c.add_argument("--update", action="store_true", help="keep the other heads already in --out")
    k = sub.add_parser("cached", help="teacher cache vs online path: step time, peak RSS, storage dtypes")
    k.add_argument("--name", required=True, help="key of this target in --out (e.g. toy_small)")
    k.add_argument("--target", type=Path, required=True)
    k.add_argument("--dataset", type=Path, default=None, help="a regenerated dataset (default: toy records)")
    k.add_argument("--n-docs", type=int, default=400, help="toy records to tokenize without --dataset")
    k.add_argument("--work-dir", type=Path, default=Path("/tmp/jetflow_bench_cached"))
    k.add_argument("--rebuild", action="store_true", help="delete an existing bench cache first")
    k.add_argument("--cache", type=Path, default=None, help="cache folder (default: in --work-dir)")
    k.add_argument("--rss-reps", type=int, default=2, help="timed steps of each peak-RSS process")
    k.add_argument("--out", type=Path, default=REPO / "bench/results/distill_cached.json")
    v = sub.add_parser("vocab", help="a training step over the draft vocabulary vs the full vocabulary")
    v.add_argument("--target", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    v.add_argument("--head", type=Path, default=REPO / "heads/smollm2-135m-instruct")
    v.add_argument("--batch-size", type=int, default=4)
    v.add_argument("--seq-len", type=int, default=384)
    v.add_argument("--num-anchors", type=int, default=16)
    v.add_argument("--chunk-size", type=int, default=1024)
    v.add_argument("--reps", type=int, default=5)
    v.add_argument("--warmup", type=int, default=1)
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--out", type=Path, default=REPO / "bench/results/distill_vocab.json")
    m = sub.add_parser("_memory_child")
    m.add_argument("--impl", choices=["naive", "chunked"], required=True)
    for name in ("rows", "hidden", "vocab", "chunk", "threads"):
        m.add_argument(f"--{name}", type=int, required=True)
    kc = sub.add_parser("_cached_child")
    kc.add_argument("kind", choices=["build", "step", "time", "dtypes"])
    kc.add_argument("--path", choices=["online", "cached"], default="online")
    kc.add_argument("--target", type=Path, required=True)
    kc.add_argument("--dataset", type=Path, required=True)
    kc.add_argument("--cache", type=Path, required=True)
    for kp in (k, kc):
        kp.add_argument("--dtype", default="bfloat16", help="storage dtype of the cache")
        kp.add_argument("--shard-mb", type=float, default=128.0)
        kp.add_argument("--batch-size", type=int, default=8)
        kp.add_argument("--seq-len", type=int, default=256)
        kp.add_argument("--num-anchors", type=int, default=32)
        kp.add_argument("--block-size", type=int, default=16)
        kp.add_argument("--chunk-size", type=int, default=4096)
        kp.add_argument("--mask-token-id", type=int, default=None)
        kp.add_argument("--reps", type=int, default=5)
        kp.add_argument("--warmup", type=int, default=2)
        kp.add_argument("--threads", type=int, default=2)
        kp.add_argument("--dtype-batches", type=int, default=4, help="batches of the storage-dtype study")
    args = p.parse_args(argv)

    if args.cmd == "_cached_child":
        fn = {
            "build": cached_child_build,
            "step": cached_child_step,
            "time": cached_child_time,
            "dtypes": cached_child_dtypes,
        }[args.kind]
        print(json.dumps(fn(args)))
        return None
    if args.cmd == "_memory_child":
        print(
            json.dumps(memory_child(args.impl, args.rows, args.hidden, args.vocab, args.chunk, args.threads))
        )
        return None
    torch.set_num_threads(args.threads)
    if args.cmd == "compare":
        result = bench_compare(args)
    elif args.cmd == "vocab":
        result = {
            "command": " ".join(
                ["python", "-m", "bench.distill", *(argv if argv is not None else sys.argv[1:])]
            ),
            **bench_vocab(args),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        print(
            f"step over the full vocabulary {result['median_wall_s']['full']:.2f} s wall / "
            f"{result['median_cpu_s']['full']:.2f} s CPU, over the draft vocabulary "
            f"{result['median_wall_s']['draft']:.2f} s / {result['median_cpu_s']['draft']:.2f} s "
            f"({result['full_over_draft_cpu']:.2f}x CPU); teacher mass outside the set "
            f"{result['teacher_mass_outside_draft_vocab']['mean']:.2e}"
        )
    elif args.cmd == "cached":
        at_start = machine(args.threads)
        one = bench_cached(args)
        result = json.loads(args.out.read_text()) if args.out.is_file() else {}
        result.setdefault("targets", {})[args.name] = {
            "machine": at_start,
            "command": " ".join(
                ["python", "-m", "bench.distill", *(argv if argv is not None else sys.argv[1:])]
            ),
            **one,
            "load_average_at_end": list(os.getloadavg()),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        result["what"] = (
            "teacher cache vs online distillation step, one target per key (bench/distill.py cached); each "
            "path in a fresh subprocess; step = batch fetch + distill_step + backward + AdamW"
        )
    else:
        result = {
            "machine": machine(args.threads),
            "command": " ".join(
                ["python", "-m", "bench.distill", *(argv if argv is not None else sys.argv[1:])]
            ),
            "step_time": bench_step_time(args),
            "loss_memory": bench_memory(args),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        st = result["step_time"]
        print(
            f"target forward {st['target_forward_s']['median'] * 1e3:.1f} ms, distill step "
            f"{st['distill_step_s']['median'] * 1e3:.1f} ms ({st['distill_step_over_target_forward']:.2f}x)"
        )
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
