"""Distillation benchmarks: step time vs the target forward, loss-step peak memory, and the head comparison.

    python bench/distill.py step    [--threads 1] [--out bench/results/distill.json]
    python bench/distill.py compare --heads NAME=RUN_DIR ... [--out bench/results/distill_compare.json]

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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
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
    from jetflow_pl.training.data import pack_documents, toy_documents
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
            sys.executable, str(Path(__file__).resolve()), "_memory_child", "--impl", impl,
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
    sys.path.insert(0, str(REPO / "bench"))
    import decode  # bench/decode.py

    out: dict = {
        "machine": machine(args.threads),
        "command": " ".join(["python", "bench/distill.py", *sys.argv[1:]]),
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
    m = sub.add_parser("_memory_child")
    m.add_argument("--impl", choices=["naive", "chunked"], required=True)
    for name in ("rows", "hidden", "vocab", "chunk", "threads"):
        m.add_argument(f"--{name}", type=int, required=True)
    args = p.parse_args(argv)

    if args.cmd == "_memory_child":
        print(
            json.dumps(memory_child(args.impl, args.rows, args.hidden, args.vocab, args.chunk, args.threads))
        )
        return None
    torch.set_num_threads(args.threads)
    if args.cmd == "compare":
        result = bench_compare(args)
    else:
        result = {
            "machine": machine(args.threads),
            "command": " ".join(
                ["python", "bench/distill.py", *(argv if argv is not None else sys.argv[1:])]
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
