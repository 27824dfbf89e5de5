"""The benchmark suite: every number of docs/BENCHMARKS.md from one command, into one JSON file.

    python -m bench.run_all --out bench/results/suite.json --plots docs/figures

On the shipped toy target (`data_gen/toy/assets/small`) it measures, in one process on one machine:

- decode: tau and decode tokens/s (docs/DESIGN.md section 4: prefill excluded) of speculative decoding with
  the causal head (the shipped `small_head`), the bidirectional head (`--bidir-head`, a DFlash-style head
  trained by `configs/quickstart.yaml` with `causal: false`) and the chain (causal head, width 1), for
  every budget and toy domain; the baselines are the project's own AR loop (`ARGenerator`, same backend
  and cache code) and HF `generate()` greedy on the same target weights;
- heldout: the same on code prompts from standard-library packages that the toy code corpus never
  includes (`code_corpus.EXCLUDED_DIRS`: idlelib, turtledemo, lib2to3), so neither the target nor any
  head saw a line of them in training (the toy "held-out" split is only unseen by module name);
- verify_cost: t(N)/t(1) of the target's tree-verify forward alone at N = 1, 17, 65, 257 nodes, and the
  draft cost (head forward + tree build), from this same run, so a speedup can be read against the CPU
  ceiling  speedup <= tau / (t(N)/t(1) + t_draft/t(1));
- ort: the ONNX Runtime backend on the portable engine graphs of the causal head (exported once into
  `--cache-dir`), its own AR and a couple of budgets;
- distill / regenerate: throughput from `bench/distill.py step` and `bench/regenerate.py`.

Every timing is repeated `--repeats` times (all configurations once per repeat, so slow drift from a
shared machine spreads over all of them alike) and reported as median with min/max; tau and the tokens
are deterministic (greedy) and are checked equal across repeats. `bench/plot.py` redraws the figures and
prints the markdown tables from the JSON alone.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench import decode as dec  # the shared measuring functions
from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR, code_corpus
from data_gen.toy.tokenizer import prompt_ids
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.generate_cli import hf_decode_tokens_per_s
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.tree import DraftTree, build_tree

REPO = Path(__file__).resolve().parents[1]

SCHEMA_VERSION = 1
#: standard-library packages the toy code corpus skips entirely (never in any toy training set)
OOD_CODE_PACKAGES = ("idlelib", "turtledemo", "lib2to3")
#: tree sizes of the verify-cost timing: N = budget + 1 for every default budget, and N = 1 (AR)
VERIFY_NODES = (1, 17, 33, 65, 129, 257)
DEFAULT_BIDIR = REPO / "runs/quickstart_bidir/head/best"


# ----------------------------------------------------------------------------------------- helpers
def spread(values: Sequence[float]) -> dict:
    """Median, min, max and the raw values of repeated timings (the spread a reader needs to judge noise)."""
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict:
    """CPU, core counts, library versions and load: what a timing depends on besides the code."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "onnxruntime": _version("onnxruntime"),
        "threads": threads,
        "load_average_at_start": list(os.getloadavg()),
    }


def git_info() -> dict:
    """Commit and whether the tree had local changes (a dirty tree's numbers are not that commit's)."""

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *a], cwd=REPO, capture_output=True, text=True, timeout=20, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _rel(path: Path | str) -> str:
    """A repo-relative path when inside the repo (results stay comparable across checkouts)."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ood_code_prompts(tokenizer, n: int) -> tuple[list[list[int]], list[str]]:
    """`n` signature+docstring prompts from OOD_CODE_PACKAGES, built exactly like the toy code corpus.

    The corpus walks the standard library but skips these folders, so these definitions are unseen by
    the target and every head. Test modules are left out (they are mostly assertions, not library
    code); the choice is deterministic (sorted modules, every k-th record) so reruns time the same set.
    """
    root = Path(code_corpus.stdlib_dir())
    records: list[dict] = []
    for package in OOD_CODE_PACKAGES:
        base = root / package
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if any(part in {"test", "tests", "idle_test"} or part.startswith("test_") for part in rel.parts):
                continue
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            records.extend(code_corpus.extract_module(".".join(parts), str(path)))
    if not records:
        return [], []
    step = max(len(records) // max(n, 1), 1)
    chosen = records[::step][:n]
    return [prompt_ids(tokenizer, r["prompt"]) for r in chosen], [r["id"] for r in chosen]


def hf_one(model, ids: list[int], max_new: int, eos) -> tuple[list[int], int, float]:
    """HF greedy `generate()` on one prompt: (tokens, decode tokens, decode seconds).

    The decode time is the full call minus a 1-token call (its prefill), the same rule as
    `jetflow generate --compare`, so both sides exclude the prefill."""
    out, tps = hf_decode_tokens_per_s(model, ids, max_new, eos)
    if tps <= 0:
        return out, 0, 0.0
    return out, len(out) - 1, (len(out) - 1) / tps


def hf_runs(model, prompts: Sequence[list[int]], max_new: int, eos) -> tuple[list[list[int]], float]:
    """`hf_one` on every prompt: (tokens per prompt, pooled decode tokens/s)."""
    rows = [hf_one(model, ids, max_new, eos) for ids in prompts]
    seconds = sum(s for _, _, s in rows)
    return [t for t, _, _ in rows], (sum(n for _, n, _ in rows) / seconds if seconds else 0.0)


# ----------------------------------------------------------------------------------------- the suite
class Suite:
    """Loads the target and heads once; each `measure_*` adds one section of the results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer, self.target = dec.load_target(args.target)
        self.eos = self.tokenizer.eos_token_id
        self.heads: dict[str, dict] = {}
        self.skipped: dict[str, str] = {}
        causal = load_draft_head(args.causal_head)
        self.heads["causal"] = {"path": _rel(args.causal_head), "width": args.width, "head": causal}
        bidir_path = args.bidir_head
        if bidir_path is not None and (bidir_path / "config.json").is_file():
            self.heads["bidirectional"] = {
                "path": _rel(bidir_path),
                "width": args.width,
                "head": load_draft_head(bidir_path),
            }
        else:
            self.skipped["bidirectional"] = (
                f"no head at {bidir_path}: train one with configs/quickstart.yaml and "
                "model.init_args.causal=false (default_root_dir runs/quickstart_bidir), or pass --bidir-head"
            )
        self.heads["chain"] = {"path": _rel(args.causal_head), "width": 1, "head": causal}
        self.ar = ARGenerator(TorchBackend(self.target), self.eos)
        self.backends = {name: TorchBackend(self.target, h["head"]) for name, h in self.heads.items()}

    def spec(self, name: str, budget: int) -> SpeculativeGenerator:
        width = self.heads[name]["width"]
        return SpeculativeGenerator(self.backends[name], budget, width, eos_token_id=self.eos)

    # ------------------------------------------------------------------ decode (all heads x budgets)
    def measure_decode(self, prompt_sets: dict[str, list[list[int]]]) -> dict[str, dict]:
        """tau / tokens/s per head x budget x prompt set, with both AR baselines, repeated."""
        a = self.args
        raw: dict = {}  # raw[set][config] = list over repeats of (tokens/s, runs-or-tokens)
        self.ar_tokens = {}
        configs = [(name, budget) for name in self.heads for budget in a.budgets]
        for rep in range(a.repeats):
            for set_name, prompts in prompt_sets.items():
                slot = raw.setdefault(set_name, {})
                _log(f"repeat {rep + 1}/{a.repeats}: {set_name} ({len(prompts)} prompts)")
                # prompt-major order: every configuration decodes prompt i within the same few seconds,
                # so load changes on a shared machine hit the baselines and the heads alike
                ar_runs, hf_rows, spec_runs = [], [], {c: [] for c in configs}
                for ids in prompts:
                    ar_runs.append(self.ar.generate(ids, a.max_new_tokens))
                    if not a.skip_hf:
                        hf_rows.append(hf_one(self.target.model, ids, a.max_new_tokens, self.eos))
                    for name, budget in configs:
                        spec_runs[(name, budget)].append(
                            self.spec(name, budget).generate(ids, a.max_new_tokens)
                        )
                slot.setdefault("ar", []).append((dec.tokens_per_s(ar_runs), ar_runs))
                self.ar_tokens[set_name] = [r.tokens for r in ar_runs]
                if hf_rows:
                    hf_s = sum(x for _, _, x in hf_rows)
                    hf_tps = sum(n for _, n, _ in hf_rows) / hf_s if hf_s else 0.0
                    slot.setdefault("hf", []).append((hf_tps, [t for t, _, _ in hf_rows]))
                for c, runs in spec_runs.items():
                    slot.setdefault(c, []).append((dec.tokens_per_s(runs), runs))
        return {name: self._aggregate(raw[name]) for name in prompt_sets}

    def _aggregate(self, slot: dict) -> dict:
        ar = slot["ar"]
        ar_tps = [t for t, _ in ar]
        ar_tokens = [r.tokens for r in ar[0][1]]
        _check_deterministic("ar", [[r.tokens for r in runs] for _, runs in ar])
        out: dict = {
            "n_prompts": len(ar_tokens),
            "ar": {"decode_tokens_per_s": spread(ar_tps), "tokens_generated": sum(map(len, ar_tokens))},
        }
        hf = slot.get("hf")
        if hf:
            hf_tps = [t for t, _ in hf]
            out["hf_generate"] = {
                "decode_tokens_per_s": spread(hf_tps),
                "speedup_of_own_ar_vs_hf": spread([a / h for a, h in zip(ar_tps, hf_tps, strict=True)]),
                "matches_own_ar": sum(h == t for h, t in zip(hf[0][1], ar_tokens, strict=True)),
            }
        heads: dict = {}
        for key, reps in slot.items():
            if not isinstance(key, tuple):
                continue
            name, budget = key
            runs0 = reps[0][1]
            taus = [dec.mean_tau(runs) for _, runs in reps]
            if any(t != taus[0] for t in taus):
                raise AssertionError(f"{name} budget {budget}: tau differs across repeats {taus}")
            _check_deterministic(f"{name}/{budget}", [[r.tokens for r in runs] for _, runs in reps])
            tps = [t for t, _ in reps]
            row = {
                "tau": taus[0],
                "rounds": sum(r.num_rounds for r in runs0),
                "accept_histogram": dec.accept_histogram(runs0),
                "decode_tokens_per_s": spread(tps),
                "speedup_vs_ar": spread([t / a for t, a in zip(tps, ar_tps, strict=True)]),
                "mismatches_vs_ar": sum(r.tokens != t for r, t in zip(runs0, ar_tokens, strict=True)),
            }
            if hf:
                row["speedup_vs_hf"] = spread([t / h for t, (h, _) in zip(tps, hf, strict=True)])
            heads.setdefault(name, {})[str(budget)] = row
        out["heads"] = heads
        return out

    # ------------------------------------------------------------------ verify cost t(N)/t(1)
    def measure_verify_cost(self, prompt: list[int], iters: int) -> dict:
        """Median time of the target verify forward alone at N tree nodes, and of the draft step.

        The tree for N > 1 is the causal head's real best-first tree (budget N-1, width `--width`) at
        the prompt's first anchor, so its depth profile is the one decoding verifies. After each timed
        verify only the root is committed (the cache grows by one row per call, negligible here)."""
        a = self.args
        backend = self.backends["causal"]
        per_rep: dict[int, list[float]] = {n: [] for n in VERIFY_NODES}
        draft_rep: dict[int, list[float]] = {n: [] for n in VERIFY_NODES}
        for _ in range(a.repeats):
            for n in VERIFY_NODES:
                logits = backend.prefill(torch.tensor(prompt))
                anchor = int(logits.argmax())
                tree = self._draft_tree(
                    anchor, n
                )  # also projects the prompt's context: not a steady-state draft
                assert tree.num_nodes == n, (tree.num_nodes, n)
                backend.verify(tree)  # warm-up: allocator, shapes
                backend.commit([0])
                v_times, d_times = [], []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    backend.verify(tree)
                    v_times.append(time.perf_counter() - t0)
                    backend.commit([0])
                    # steady-state draft: head forward over one new context row + best-first tree build
                    t0 = time.perf_counter()
                    self._draft_tree(anchor, n)
                    d_times.append(time.perf_counter() - t0)
                per_rep[n].append(statistics.median(v_times))
                draft_rep[n].append(statistics.median(d_times))
        t1 = per_rep[1]
        out = {
            "iters_per_repeat": iters,
            "tree_width": a.width,
            "verify_ms": {str(n): spread([s * 1e3 for s in v]) for n, v in per_rep.items()},
            "ratio": {
                str(n): spread([s / b for s, b in zip(v, t1, strict=True)]) for n, v in per_rep.items()
            },
            # the head forward + the best-first tree build for budget N-1 (N = 1: the head forward only)
            "draft_ms": {str(n): spread([s * 1e3 for s in v]) for n, v in draft_rep.items()},
            "draft_ratio": {
                str(n): spread([d / b for d, b in zip(v, t1, strict=True)]) for n, v in draft_rep.items()
            },
        }
        return out

    def _draft_tree(self, anchor: int, n: int) -> DraftTree:
        """One draft step of the causal head as decoding runs it: head forward, then an n-node tree."""
        lp = self.backends["causal"].draft(anchor)
        return DraftTree.chain([anchor]) if n == 1 else build_tree(lp, anchor, n - 1, self.args.width)

    # ------------------------------------------------------------------ ONNX Runtime backend
    def measure_ort(self, prompts: list[list[int]], torch_math: dict) -> dict:
        """AR and speculative decoding on the exported portable graphs (causal head), vs torch."""
        a = self.args
        try:
            from export.onnx_export import ExportSettings, export_engine
            from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
        except ImportError as err:
            return {"skipped": f"ONNX export/runtime not importable: {err}"}
        engine = a.cache_dir / f"engine_portable_{_digest(a.causal_head, a.target)}"
        export_s = None
        if not (engine / "config.json").is_file():
            _log(f"exporting the portable engine into {engine} (once; cached)")
            t0 = time.perf_counter()
            export_engine(
                ExportSettings(
                    head=a.causal_head, target=a.target, out=engine, variant="portable", overwrite=True
                )
            )
            export_s = time.perf_counter() - t0
        backend = OnnxRuntimeBackend(engine, intra_op_threads=a.threads)
        backend.check_width(a.width)
        ar = ARGenerator(backend, self.eos)
        dec.run_prompts(ar, prompts[:1], 8)  # warm-up (session first-run allocations)
        ar_reps, spec_reps = [], {b: [] for b in a.ort_budgets}
        for rep in range(a.repeats):
            _log(f"repeat {rep + 1}/{a.repeats}: ONNX Runtime")
            ar_runs = dec.run_prompts(ar, prompts, a.max_new_tokens)
            ar_reps.append((dec.tokens_per_s(ar_runs), ar_runs))
            for b in a.ort_budgets:
                gen = SpeculativeGenerator(backend, b, a.width, eos_token_id=self.eos)
                runs = dec.run_prompts(gen, prompts, a.max_new_tokens)
                spec_reps[b].append((dec.tokens_per_s(runs), runs))
        ar_tps = [t for t, _ in ar_reps]
        torch_ar = torch_math["ar"]["decode_tokens_per_s"]["median"]
        torch_ar_tokens = self.ar_tokens["math"]
        out: dict = {
            "engine_dir": _rel(engine),
            "variant": "portable",
            "export_seconds": export_s,
            "export_cached": export_s is None,
            "intra_op_threads": a.threads,
            "domain": "math",
            "n_prompts": len(prompts),
            "ar": {
                "decode_tokens_per_s": spread(ar_tps),
                "vs_torch_ar": statistics.median(ar_tps) / torch_ar if torch_ar else None,
                "mismatches_vs_torch_ar": sum(
                    r.tokens != t for r, t in zip(ar_reps[0][1], torch_ar_tokens, strict=True)
                ),
            },
            "speculative": {},
        }
        for b, reps in spec_reps.items():
            tps = [t for t, _ in reps]
            _check_deterministic(f"ort/{b}", [[r.tokens for r in runs] for _, runs in reps])
            torch_row = torch_math["heads"]["causal"].get(str(b))
            out["speculative"][str(b)] = {
                "tau": dec.mean_tau(reps[0][1]),
                "torch_tau": torch_row["tau"] if torch_row else None,
                "decode_tokens_per_s": spread(tps),
                "speedup_vs_ort_ar": spread([t / x for t, x in zip(tps, ar_tps, strict=True)]),
                "torch_decode_tokens_per_s": (
                    torch_row["decode_tokens_per_s"]["median"] if torch_row else None
                ),
                "mismatches_vs_torch_ar": sum(
                    r.tokens != t for r, t in zip(reps[0][1], torch_ar_tokens, strict=True)
                ),
            }
        return out

    # ------------------------------------------------------------------ training-side throughput
    def measure_regenerate(self) -> dict:
        """`bench/regenerate.py` (batched greedy regeneration), once per repeat, collected."""
        from bench import regenerate

        a = self.args
        argv = ["--target", _rel(a.target), "--threads", str(a.threads)]
        argv += ["--n-per-domain", str(a.regen_per_domain), "--max-new-tokens", str(a.max_new_tokens)]
        if a.quick:
            argv += ["--batch-sizes", "1", "4"]
        per_bs: dict[int, list[float]] = {}
        identical = True
        res = {}
        for rep in range(a.repeats):
            _log(f"repeat {rep + 1}/{a.repeats}: regeneration")
            res = regenerate.main([*argv, "--out", str(a.cache_dir / "regenerate.json")])
            identical &= bool(res["outputs_identical_across_batch_sizes"])
            for r in res["runs"]:
                per_bs.setdefault(r["batch_size"], []).append(r["tokens_per_s"])
        return {
            "command": shlex.join(["python", "-m", "bench.regenerate", *argv]),
            "prompts": res.get("prompts"),
            "max_new_tokens": res.get("max_new_tokens"),
            "outputs_identical_across_batch_sizes": identical,
            "tokens_per_s": {str(bs): spread(v) for bs, v in per_bs.items()},
        }

    def measure_distill(self) -> dict:
        """`bench/distill.py step` (another engineer's script) in a subprocess, or its last result file.

        It owns its own repeats (`--reps`, median); a missing or failing script is recorded, not fatal."""
        a = self.args
        script = REPO / "bench/distill.py"
        shipped = REPO / "bench/results/distill.json"
        if not script.is_file():
            return {"skipped": "bench/distill.py is not in this checkout"}
        if a.quick or a.skip_distill:
            why = "--quick" if a.quick else "--skip-distill"
            return _read_json_or_skip(shipped, f"not run ({why})")
        out_file = a.cache_dir / "distill.json"
        cmd = [sys.executable, "-m", "bench.distill", "step", "--threads", str(a.threads)]
        cmd += ["--out", str(out_file), "--reps", str(max(a.repeats, 3))]
        _log("distillation step benchmark: " + shlex.join(cmd))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.distill_timeout)
        except subprocess.TimeoutExpired:
            return _read_json_or_skip(shipped, f"bench/distill.py step exceeded {a.distill_timeout}s")
        if proc.returncode != 0 or not out_file.is_file():
            tail = (proc.stderr or proc.stdout)[-600:]
            return _read_json_or_skip(shipped, f"bench/distill.py step failed (rc {proc.returncode}): {tail}")
        import json

        return {
            "source": "run in this suite",
            "command": shlex.join(["python", "-m", "bench.distill", *cmd[3:]]),
            "seconds": round(time.perf_counter() - t0, 1),
            "result": json.loads(out_file.read_text()),
        }


def _read_json_or_skip(path: Path, why: str) -> dict:
    import json

    if path.is_file():
        return {"source": f"read from {path.relative_to(REPO)} (not measured in this run: {why})",
                "result": json.loads(path.read_text())}  # fmt: skip
    return {"skipped": why}


def _check_deterministic(what: str, token_sets: list) -> None:
    """Greedy decoding is deterministic: differing tokens across repeats mean a bug, not noise."""
    if any(t != token_sets[0] for t in token_sets[1:]):
        raise AssertionError(f"{what}: generated tokens differ across repeats")


def _digest(*paths: Path) -> str:
    """A short hash of the model folders and of the exporter's source, so a changed head or a changed
    graph definition gets a fresh engine export instead of a stale cached one."""
    h = hashlib.sha256()
    files = [f for p in paths for f in sorted(Path(p).glob("*")) if f.suffix in {".json", ".safetensors"}]
    files += sorted((REPO / "export").glob("*.py")) + sorted((REPO / "jetflow_pl/decoding").glob("graph*.py"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _training_metrics(head_path: str) -> dict | None:
    """Per-depth validation top-1 agreement and tau from the head's training run logs, when present.

    A head folder `RUN/head/best` has its CSV logs in `RUN/logs/*/metrics.csv`; the shipped copy in
    data_gen/toy/assets has none. The last row that has `val/agree_d1` is the head's final validation."""
    import csv

    run = Path(head_path).resolve().parents[1]
    files = sorted(run.glob("logs/*/metrics.csv"))
    if not files:
        return None
    rows = list(csv.DictReader(files[-1].open()))
    val = [r for r in rows if r.get("val/agree_d1")]
    taus = [r for r in rows if r.get("val/tau")]
    if not val:
        return None
    last = val[-1]
    depths = sorted(int(k.rsplit("d", 1)[1]) for k in last if k.startswith("val/agree_d"))
    return {
        "source": str(files[-1].relative_to(REPO)) if files[-1].is_relative_to(REPO) else str(files[-1]),
        "step": int(last["step"]),
        "val_agree_by_depth": [float(last[f"val/agree_d{d}"]) for d in depths],
        "val_loss": float(last["val/loss"]) if last.get("val/loss") else None,
        "val_sim_tau": float(last["val/sim_tau"]) if last.get("val/sim_tau") else None,
        "val_tau": float(taus[-1]["val/tau"]) if taus else None,
    }


# ----------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "bench/results/suite.json")
    p.add_argument("--plots", type=Path, default=None, help="also draw the PNG figures into this folder")
    p.add_argument("--target", type=Path, default=SMALL_TARGET_DIR)
    p.add_argument("--causal-head", type=Path, default=SMALL_HEAD_DIR)
    p.add_argument("--bidir-head", type=Path, default=DEFAULT_BIDIR, help="skipped (with reason) if absent")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--n-math", type=int, default=10)
    p.add_argument("--n-code", type=int, default=5)
    p.add_argument("--n-prose", type=int, default=5)
    p.add_argument("--n-heldout", type=int, default=5, help="out-of-corpus code prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verify-iters", type=int, default=10, help="timed verify calls per N per repeat")
    p.add_argument("--ort-budgets", type=int, nargs="+", default=[16, 64])
    p.add_argument("--regen-per-domain", type=int, default=11)
    p.add_argument("--threads", type=int, default=1, help="torch / ORT intra-op threads")
    p.add_argument("--cache-dir", type=Path, default=REPO / "bench/.cache", help="exported engines etc.")
    p.add_argument("--skip-hf", action="store_true", help="no HF generate() baseline")
    p.add_argument("--skip-ort", action="store_true")
    p.add_argument("--skip-distill", action="store_true", help="read bench/results/distill.json instead")
    p.add_argument("--skip-regenerate", action="store_true")
    p.add_argument("--distill-timeout", type=int, default=1200)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: 2 prompts per set, budgets 4 16, 16 new tokens, 1 repeat, no ORT/distill run",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "-m", "bench.run_all", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.n_math = args.n_code = args.n_prose = args.n_heldout = 2
        args.budgets, args.max_new_tokens, args.repeats = [4, 16], 16, 1
        args.verify_iters, args.ort_budgets, args.regen_per_domain = 2, [4], 1
        args.skip_ort = True
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict = {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_info(),
        "machine": machine_info(args.threads),
        "settings": {
            "target": _rel(args.target),
            "budgets": args.budgets,
            "width": args.width,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "quick": args.quick,
            "metrics": "tau = tokens committed per target verify forward (accepted + 1), mean over prompts; "
            "decode tokens/s = decode-round tokens / decode seconds, prefill and its token excluded, pooled "
            "over the prompt set; speedup = tokens/s ratio within the same repeat; timings: median, min, "
            "max over repeats",
        },
    }
    suite = Suite(args)
    results["heads"] = {
        name: {
            "path": h["path"],
            "width": h["width"],
            "causal": bool(h["head"].config.dflash_config.get("causal_head", True)),
            "block_size": int(h["head"].config.block_size),
            "training": _training_metrics(h["path"]) if name != "chain" else None,
        }
        for name, h in suite.heads.items()
    }
    # the shipped causal head is a copy of the quickstart run's best head: read its logs when present
    if results["heads"]["causal"]["training"] is None and (REPO / "runs/quickstart/head/best").is_dir():
        results["heads"]["causal"]["training"] = _training_metrics(str(REPO / "runs/quickstart/head/best"))
    results["skipped"] = dict(suite.skipped)
    section_s: dict[str, float] = {}

    def section(name: str, fn: Callable[[], dict], optional: bool = False) -> dict:
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as err:  # an optional section's failure must not discard the decode results
            if not optional:
                raise
            out = {"skipped": f"failed: {type(err).__name__}: {err}"[:2000]}
        section_s[name] = round(time.perf_counter() - t0, 1)
        _log(f"{name} done in {section_s[name]:.0f}s")
        # a partial file after every section: a crash late in a long run keeps what was measured
        dec.write_json(args.out.with_suffix(".partial.json"), {**results, name: out, "partial": True})
        return out

    tok = suite.tokenizer
    sets = {
        "math": dec.domain_prompts(tok, "math", args.n_math),
        "code": dec.domain_prompts(tok, "code", args.n_code),
        "prose": dec.domain_prompts(tok, "prose", args.n_prose),
    }
    ood, ood_ids = ood_code_prompts(tok, args.n_heldout)
    if ood:
        sets["code_ood"] = ood
    # warm-up outside every timing: allocator, first-call paths of every generator
    warm = sets["math"][0]
    suite.ar.generate(warm, 8)
    for name in suite.heads:
        suite.spec(name, args.budgets[-1]).generate(warm, 8)
    if not args.skip_hf:
        hf_runs(suite.target.model, [warm], 8, suite.eos)

    decode = section("decode", lambda: suite.measure_decode(sets))
    results["decode"] = {d: decode[d] for d in ("math", "code", "prose")}
    if "code_ood" in decode:
        results["heldout"] = {
            "code_ood": {
                "source": f"standard-library packages the toy code corpus excludes: {', '.join(OOD_CODE_PACKAGES)}",
                "prompt_ids": ood_ids,
                **decode["code_ood"],
            }
        }
    else:
        results["skipped"]["heldout"] = f"none of {OOD_CODE_PACKAGES} found in {code_corpus.stdlib_dir()}"
    results["verify_cost"] = section(
        "verify_cost", lambda: suite.measure_verify_cost(sets["math"][0], args.verify_iters)
    )
    results["ceiling"] = ceiling_table(results)
    if args.skip_ort:
        results["ort"] = {"skipped": "--quick" if args.quick else "--skip-ort"}
    else:
        results["ort"] = section(
            "ort", lambda: suite.measure_ort(sets["math"], results["decode"]["math"]), optional=True
        )
    if args.skip_regenerate:
        results["regenerate"] = {"skipped": "--skip-regenerate"}
    else:
        results["regenerate"] = section("regenerate", suite.measure_regenerate, optional=True)
    results["distill"] = section("distill", suite.measure_distill, optional=True)
    results["section_seconds"] = section_s
    results["runtime_seconds"] = round(time.perf_counter() - t_start, 1)
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    dec.write_json(args.out, results)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    _log(f"wrote {args.out} ({results['runtime_seconds']:.0f}s)")
    if args.plots is not None:
        from bench import plot

        for f in plot.make_all(results, args.plots):
            _log(f"figure {f}")
    return results


def ceiling_table(results: dict) -> dict:
    """Per budget with a measured N = budget+1: the CPU ceiling tau / (t(N)/t(1) + t_draft/t(1)).

    AR spends t(1) per token; a speculative round spends t(N) + t_draft for tau tokens, so no tree
    policy can beat this ratio on this machine (tree building and commits only lower it further)."""
    vc = results["verify_cost"]
    out: dict = {}
    for n in VERIFY_NODES[1:]:
        b = str(n - 1)
        draft = vc["draft_ratio"][str(n)]["median"]
        for head, rows in results["decode"]["math"]["heads"].items():
            if b in rows and head != "chain":
                r = vc["ratio"][str(n)]["median"]
                out.setdefault(b, {})[head] = {
                    "tau": rows[b]["tau"],
                    "verify_ratio": r,
                    "draft_ratio": draft,
                    "ceiling_vs_ar": rows[b]["tau"] / (r + draft),
                    "measured_vs_ar": rows[b]["speedup_vs_ar"]["median"],
                }
    return out


if __name__ == "__main__":
    main()
