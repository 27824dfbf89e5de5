"""What a round costs inside a batch that plays a fixed pattern of budgets (AR, budget 1, mixes of both).

    OMP_NUM_THREADS=1 python -m bench.round_patterns --target models/SmolLM2-135M-Instruct \\
        --head heads/smollm2-135m-instruct --prompts bench/prompts/heldout_eval_math.jsonl --batch 16 \\
        --out bench/results/round_patterns_smollm2_torch_b16.json

`bench/batching.py` measures whole loops; this one times every decode round of one wave of `--batch`
requests (submitted together, decoded to `--max-tokens`) while the budget follows a pattern, round by
round: `ar` (0), `steady1` (1), `alt` (0, 1), `every10` (nine AR rounds, then 1). Where `auto` mixes AR
and tree rounds, a tree round after a stretch of AR rounds drafts after the head skipped those rounds:
the head first reads every context row it missed, which the cost profile (one AR round between drafts)
does not price. Comparing the budget-1 rounds of `every10` with those of `steady1` measures that
catch-up, and the AR rounds of the mixes against `ar` whether mixing costs the AR rounds anything.
Patterns are interleaved and the set repeated (`--repeats`), each repeat starting one pattern further
(`batching.run_order`), so machine drift hits all alike. Every request's tokens must equal the `ar`
pattern's in the first repeat (lossless), or the bench stops.

Writes JSON: per pattern and repeat, the wave's wall seconds and tokens/s, and per budget the rounds
played and their median / 90th percentile milliseconds; the medians over repeats in `summary`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.batching import require_lossless, run_order
from bench.budget_auto import read_prompts  # the shared prompt reader
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decode_options import load_tokenizer
from jetflow_pl.decoding import SpeculativeGenerator
from jetflow_pl.decoding.budget import RoundInfo, RoundResult
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

REPO = Path(__file__).resolve().parents[1]

PATTERNS: dict[str, list[int]] = {
    "ar": [0],
    "steady1": [1],
    "alt": [0, 1],
    "every10": [0] * 9 + [1],
}


class PatternBudget:
    """A budget policy (`jetflow_pl.decoding.budget.BudgetPolicy`) that plays `pattern` round after round,
    cycling, whatever the evidence says (one budget per round for the whole batch)."""

    def __init__(self, pattern: Sequence[int]) -> None:
        self.pattern = [int(k) for k in pattern]
        self.played = 0

    @property
    def max_budget(self) -> int:
        return max(self.pattern)

    def start(self, backend, max_batch: int = 1) -> None:
        pass

    def next_budget(self) -> int:
        return self.pattern[self.played % len(self.pattern)]

    def choose(self, info: RoundInfo) -> int:
        k = self.next_budget()
        self.played += 1
        return k

    def observe(self, result: RoundResult) -> None:
        pass


def run_wave(
    gen: SpeculativeGenerator, policy: PatternBudget, prompts: list[list[int]], batch: int, max_new: int
) -> tuple[dict, dict[int, list[int]]]:
    """One wave of `batch` requests submitted together; every round timed by the budget it played (the
    round's own clock: draft, build, verify, acceptance and commit)."""
    engine = gen.engine(max_batch=batch)
    engine.start()
    times: dict[int, list[float]] = defaultdict(list)

    def timed(result: RoundResult) -> None:
        times[max(result.budgets)].append(result.seconds)

    gen.observers.append(timed)
    try:
        handles = [engine.submit(prompts[i % len(prompts)], max_new) for i in range(batch)]
        t0 = time.perf_counter()
        engine.run()
        wall = time.perf_counter() - t0
    finally:
        gen.observers.remove(timed)
    tokens = sum(len(h.tokens) for h in handles)

    def ms(xs: list[float], q: float) -> float:
        return 1000 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    rounds = {
        str(k): {"rounds": len(v), "median_ms": 1000 * statistics.median(v), "p90_ms": ms(v, 0.9)}
        for k, v in sorted(times.items())
    }
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "rounds": rounds}, {
        i: h.tokens for i, h in enumerate(handles)
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--head", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or args.max_tokens < 2:
        p.error("--batch and --repeats must be >= 1, --max-tokens >= 2")
    if "ar" not in args.patterns:
        args.patterns = ["ar", *args.patterns]  # the lossless reference
    torch.set_num_threads(args.threads)
    head = load_draft_head(args.head).eval()
    target = TargetModel.from_pretrained(args.target, head.config.target_layer_ids)
    tokenizer = load_tokenizer(args.target)
    prompts = read_prompts(args.prompts, tokenizer, args.n_prompts, True)
    runs: dict[str, list[dict]] = {name: [] for name in args.patterns}
    reference: dict[int, list[int]] | None = None  # the first repeat's `ar` tokens: every run must match
    for rep in range(args.repeats):
        outputs_of: dict[str, dict[int, list[int]]] = {}
        for name in run_order(args.patterns, rep):
            policy = PatternBudget(PATTERNS[name])
            backend = TorchBackend(target, head, max_batch=args.batch)
            gen = SpeculativeGenerator(backend, policy, args.width, eos_token_id=tokenizer.eos_token_id)
            wave, outputs_of[name] = run_wave(gen, policy, prompts, args.batch, args.max_tokens)
            runs[name].append(wave)
            per = " ".join(f"{k}: {r['rounds']} x {r['median_ms']:.0f} ms" for k, r in wave["rounds"].items())
            print(f"rep {rep} {name}: {wave['tokens_per_s']:.1f} tok/s; rounds {per}", flush=True)
        if reference is None:  # checked once the repeat is done: `ar` need not run first
            reference = outputs_of["ar"]
        for name, outputs in outputs_of.items():
            require_lossless(outputs, reference, f"pattern {name}")
    summary = {
        name: {
            "tokens_per_s": statistics.median(w["tokens_per_s"] for w in waves),
            "round_median_ms": {
                k: statistics.median(w["rounds"][k]["median_ms"] for w in waves) for k in waves[0]["rounds"]
            },
        }
        for name, waves in runs.items()
    }
    out = {
        "command": shlex.join(["python", "-m", "bench.round_patterns", *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "patterns": {name: PATTERNS[name] for name in args.patterns},
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, s in summary.items():
        per = " ".join(f"{k}: {v:.0f} ms" for k, v in s["round_median_ms"].items())
        print(f"{name:>8}: {s['tokens_per_s']:.1f} tok/s, round medians {per}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
