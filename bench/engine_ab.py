"""Two (or more) engine directories side by side on ONNX Runtime: the same prompts, batch sizes and fixed
budgets, interleaved, so a change to the exported graphs (or to the runtime under them) is measured
against what it replaces in one run rather than against a number from another day.

    OMP_NUM_THREADS=1 python -m bench.engine_ab --engine-dirs /tmp/engines_before engines/smollm2_b16 \\
        --batch 1 8 16 --budgets 0 --repeats 3 --threads 1 --out bench/results/ort_graph_ab.json

For each repeat, batch size B and budget, every engine decodes the same closed loop (`batching.closed_loop`:
B requests in flight until `--requests` greedy requests are done, after `--warmup` untimed ones), repeat r
starting at engine r and going round (`batching.run_order`: no engine always runs first); the median
tokens/s over repeats and its ratio to the first engine's are reported. Every engine's tokens are
compared with the first engine's at budget 0: graphs that compute the same function in another order can
flip a greedy near-tie, so differing requests are counted and reported (not an error); within one engine
every budget must give budget 0's tokens (lossless), or the bench stops. Counted at the first repeat, over
every batch size.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.batching import closed_loop, require_lossless, run_order
from bench.budget_auto import read_prompts  # the shared prompt reader
from jetflow_pl.decode_options import load_tokenizer
from jetflow_pl.decoding import SpeculativeGenerator
from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend

REPO = Path(__file__).resolve().parents[1]

DEFAULT_PROMPTS = REPO / "bench/prompts/heldout_eval_math.jsonl"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dirs", type=Path, nargs="+", required=True, help="the first is the baseline")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--budgets", type=int, nargs="+", default=[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if len(args.engine_dirs) < 2 or args.requests < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("two or more --engine-dirs; --requests, --repeats >= 1; --warmup >= 0")
    if len({str(d) for d in args.engine_dirs}) != len(args.engine_dirs):
        p.error("--engine-dirs must be distinct (copy a directory to compare it with itself)")
    if 0 not in args.budgets:
        args.budgets = [0, *args.budgets]  # the lossless reference of every engine
    tokenizer = load_tokenizer(args.engine_dirs[0] / "tokenizer")
    prompts = read_prompts(args.prompts, tokenizer, args.n_prompts, True)
    names = [str(d) for d in args.engine_dirs]
    dirs = dict(zip(names, args.engine_dirs, strict=True))
    runs: dict[str, dict[int, dict[int, list[float]]]] = {
        n: {B: {k: [] for k in args.budgets} for B in args.batch} for n in names
    }
    differing: dict[str, int] = {n: 0 for n in names}
    for rep in range(args.repeats):
        for B in args.batch:
            reference: dict[str, dict] = {}  # per engine: its budget-0 tokens
            for budget in args.budgets:
                for name in run_order(names, rep):  # no engine always runs first
                    backend = OnnxRuntimeBackend(dirs[name], intra_op_threads=args.threads, max_batch=B)
                    gen = SpeculativeGenerator(
                        backend, budget, args.width, eos_token_id=tokenizer.eos_token_id
                    )
                    if args.warmup:
                        closed_loop(gen, B, prompts[::-1], args.warmup, args.max_tokens)
                    level = closed_loop(gen, B, prompts, args.requests, args.max_tokens)
                    outputs = level.pop("_outputs")
                    if budget == 0:
                        reference[name] = outputs
                    else:
                        require_lossless(outputs, reference[name], f"{name}, budget {budget}, batch {B}")
                    runs[name][B][budget].append(level["tokens_per_s"])
                    print(
                        f"rep {rep} B={B} budget {budget} {name}: {level['tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
            if rep == 0:  # greedy near-ties another graph may flip: counted, not an error
                first = reference[names[0]]
                for name in names:
                    differing[name] += sum(reference[name][i] != first[i] for i in first)
    table = {
        name: {
            str(B): {
                str(k): {
                    "tokens_per_s": statistics.median(runs[name][B][k]),
                    "tokens_per_s_repeats": runs[name][B][k],
                    "vs_first_engine": statistics.median(runs[name][B][k])
                    / statistics.median(runs[names[0]][B][k]),
                }
                for k in args.budgets
            }
            for B in args.batch
        }
        for name in names
    }
    out = {
        "command": shlex.join(["python", "-m", "bench.engine_ab", *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "results": table,
        "requests_differing_from_first_engine_at_budget_0": differing,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for name in names:
        cells = " ".join(
            f"B={B}/k={k}: {table[name][str(B)][str(k)]['tokens_per_s']:.1f} "
            f"({table[name][str(B)][str(k)]['vs_first_engine']:.2f}x)"
            for B in args.batch
            for k in args.budgets
        )
        print(f"{name}: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
