"""Continuous batching: throughput at batch 1, 2, 4, 8 for AR vs fixed budgets vs the batch-aware `auto`.

    OMP_NUM_THREADS=1 python -m bench.batching --target data_gen/toy/assets/small \\
        --head data_gen/toy/assets/small_head --batch 1 2 4 8 --budgets 0 4 16 auto \\
        --requests 16 --max-tokens 48 --out bench/results/batching_toy.json

    # ONNX Runtime: an engine directory with batched graphs (jetflow-export --max-batch N)
    OMP_NUM_THREADS=1 python -m bench.batching --backend onnxruntime --engine-dir engines/toy-batched \
        --threads 1 --batch 1 2 4 --budgets 0 4 16 auto --out bench/results/batching_toy_ort.json

No server in between (`bench/serve_load.py` measures through HTTP): the `DecodeEngine` itself, as a
server steps it. For each batch size B and configuration (0 = AR: the same engine, batching and backend,
no draft), a closed loop keeps B requests in flight (a new one joins as soon as one finishes) until
`--requests` greedy requests are done; throughput = completion tokens over the loop's wall time. Every
configuration first decodes `--warmup` requests untimed at that B (for `auto` that loads or measures this
machine's cost profile up to B and lets the policy learn the head's acceptance; without a prior it probes).
Configurations are interleaved per batch size and the whole grid is run `--repeats` times, so a burst of
load on a shared machine hits all of them alike; the median over repeats is reported. Repeat r starts at
configuration r (mod their count) and goes round, so no configuration always runs first or last: a drift
within a repeat (a process warming up, load building) is spread over all of them instead of always
favouring one (the order each repeat ran is written with the results). Every request's tokens must equal
the AR run's for the same prompt (the engine is lossless at every batch size and budget), or the bench
stops with an error.

Writes JSON to `--out`: per B and configuration, tokens/s (median and every repeat), the speedup over AR
at the same B (of the medians, and of each repeat against the AR pass beside it), the same for the loop's
steady part (until the last request is submitted: every slot busy, more waiting; `closed_loop`), requests
per decode round, the share of the wall time spent prefilling, p50 request latency, tau and the budgets
played; for `auto` the cost profile's view (the expected speed of each budget at that B).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.budget_auto import read_prompts  # the shared prompt reader
from bench.load_plot import budget_label, plot_load
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decode_options import acceptance_prior, load_tokenizer
from jetflow_pl.decoding import SpeculativeGenerator
from jetflow_pl.decoding.budget import ACCEPTANCE_PROFILE_FILE, AutoBudget
from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

REPO = Path(__file__).resolve().parents[1]

DEFAULT_PROMPTS = REPO / "data_gen/toy/assets/heldout_prompts/math.jsonl"


def closed_loop(
    gen: SpeculativeGenerator, batch: int, prompts: list[list[int]], n: int, max_new: int
) -> dict:
    """`n` requests (request i: prompt i mod len) through one engine, `batch` in flight at a time.

    Besides the whole loop's throughput, its steady part: from the start until the last request is
    submitted, every slot is busy and more requests wait. After that the batch drains, and how fast
    depends on how the last requests' finishes are spread (AR with equal lengths finishes a whole batch
    in one round; a speculative policy finishes them over many rounds with fewer requests in each), which
    is a property of a finite run, not of serving under sustained load; both numbers are reported."""
    engine = gen.engine(max_batch=batch)
    engine.start()  # the policy's cost profile is loaded (or measured) before the clock starts
    handles: list = []
    order = iter(range(n))
    steady: tuple[float, int] | None = None  # (seconds, tokens) when the last request was submitted
    t0 = time.perf_counter()

    def top_up() -> None:
        nonlocal steady
        while engine.num_active + engine.num_waiting < batch:
            i = next(order, None)
            if i is None:
                return
            handles.append((i, engine.submit(prompts[i % len(prompts)], max_new)))
            if i == n - 1 and engine.rounds > 0:  # the last one joins a running batch: the steady part ends
                steady = (time.perf_counter() - t0, sum(len(h.result.tokens) for _, h in handles))

    top_up()
    while not engine.idle:
        engine.step()
        top_up()
    wall = time.perf_counter() - t0
    results = [(i, h.result) for i, h in handles]
    tokens = sum(len(r.tokens) for _, r in results)
    rounds = [k for _, r in results for k in r.budgets]
    accept = [a for _, r in results for a in r.accept_lengths]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        # None when every request fit in the first batch (the whole loop is ramp and drain)
        "steady_tokens_per_s": None if steady is None else steady[1] / steady[0],
        "steady_share": None if steady is None else steady[0] / wall,
        # requests per decode round: below `batch` while the loop fills, drains or waits on a prefill
        "occupancy": len(rounds) / engine.rounds if engine.rounds else 0.0,
        "prefill_share": sum(r.prefill_seconds for _, r in results) / wall,
        "latency_p50_s": statistics.median(r.latency_s for _, r in results),
        "tau": sum(accept) / len(accept) if accept else 0.0,
        "budgets_played": dict(Counter(rounds).most_common()),
        "_outputs": {i: r.tokens for i, r in results},
    }


def require_lossless(outputs: dict[int, list[int]], reference: dict[int, list[int]], what: str) -> None:
    """Stop the bench unless every request's tokens equal AR's (`reference`): speculation is lossless, so a
    difference is a bug, whatever the timings say. `what` names the run in the message."""
    if outputs != reference:
        bad = [i for i in outputs if outputs[i] != reference[i]]
        raise SystemExit(f"{what}: requests {bad} differ from AR")


def run_order(configs: Sequence[str], rep: int) -> list[str]:
    """The order repeat `rep` runs `configs` in: starting at configuration `rep` (mod their count) and going
    round, so over as many repeats as configurations each one runs once in every position."""
    start = rep % len(configs)
    return [*configs[start:], *configs[:start]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=REPO / "data_gen/toy/assets/small")
    p.add_argument("--head", type=Path, default=REPO / "data_gen/toy/assets/small_head")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--budgets", nargs="+", default=["0", "4", "16", "auto"])
    p.add_argument("--requests", type=int, default=16, help="timed requests per batch size and config")
    p.add_argument("--warmup", type=int, default=8, help="untimed requests first (auto learns there)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--cache-dir", type=Path, default=None, help="cost-profile cache (default: a fresh one)")
    p.add_argument(
        "--acceptance-profile",
        type=Path,
        default=None,
        help=f"auto's acceptance prior (default: {ACCEPTANCE_PROFILE_FILE} beside the head, else none)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch")
    p.add_argument(
        "--engine-dir",
        type=Path,
        default=None,
        help="--backend onnxruntime: an engine directory with batched graphs (jetflow-export --max-batch N); "
        "--threads sets its intra-op threads",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.backend == "onnxruntime" and args.engine_dir is None:
        p.error("--backend onnxruntime needs --engine-dir")
    if args.requests < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--requests and --repeats must be >= 1, --warmup >= 0")
    if "0" not in args.budgets:
        args.budgets = ["0", *args.budgets]  # the baseline and the lossless reference

    import json

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prior = acceptance_prior(args)  # as jetflow-generate resolves it (explicit, else beside the head)
    if args.backend == "torch":
        head = load_draft_head(args.head).eval()
        target = TargetModel.from_pretrained(args.target, head.config.target_layer_ids)
        tokenizer = load_tokenizer(args.target)
        model_name = args.target.name

        def make_backend(batch: int):
            return TorchBackend(target, head, max_batch=batch)
    else:
        tokenizer = load_tokenizer(args.engine_dir / "tokenizer")
        model_name = f"{args.engine_dir.name} (onnxruntime)"

        def make_backend(batch: int):
            return OnnxRuntimeBackend(args.engine_dir, intra_op_threads=args.threads, max_batch=batch)

    eos = tokenizer.eos_token_id
    prompts = read_prompts(args.prompts, tokenizer, args.n_prompts, True)
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="jetflow_costs_"))
    measured: dict[str, dict[int, list[dict]]] = {b: {B: [] for B in args.batch} for b in args.budgets}
    views: dict[int, dict] = {}
    orders: list[list[str]] = []
    for rep in range(args.repeats):
        order = run_order(args.budgets, rep)
        orders.append(order)
        for B in args.batch:
            outputs_of: dict[str, dict[int, list[int]]] = {}
            for budget in order:
                backend = make_backend(B)
                policy = (
                    AutoBudget(prior=prior, cache_dir=cache_dir, full_profile=True)
                    if budget == "auto"
                    else int(budget)
                )
                gen = SpeculativeGenerator(backend, policy, args.width, eos_token_id=eos)
                if args.warmup > 0:
                    closed_loop(gen, B, prompts[::-1], args.warmup, args.max_tokens)  # untimed
                level = closed_loop(gen, B, prompts, args.requests, args.max_tokens)
                outputs_of[budget] = level.pop("_outputs")
                measured[budget][B].append(level)
                if budget == "auto" and rep == 0:
                    cost = policy.cost
                    views[B] = {
                        "cost_at_B": {k: round(cost.cost(k, B), 3) for k in cost.budgets_at(B)},
                        "t_B1_over_t1": cost.batch_ar_ratio(B),
                        "session_tau": {k: round(v, 3) for k, v in policy.estimates().items()},
                        # the clock check (AutoBudget.timing_report): observed vs profiled round times
                        "clock": policy.timing_report(),
                    }
                print(
                    f"rep {rep} batch {B} budget {budget}: {level['tokens_per_s']:.0f} tok/s"
                    + (
                        ""
                        if level["steady_tokens_per_s"] is None
                        else f" ({level['steady_tokens_per_s']:.0f} steady)"
                    )
                    + f", {level['occupancy']:.1f} per round, "
                    f"tau {level['tau']:.2f}, budgets {level['budgets_played']}",
                    flush=True,
                )
            for budget, outputs in outputs_of.items():
                require_lossless(outputs, outputs_of["0"], f"budget {budget}, batch {B}")
    table: dict[str, dict[str, dict]] = {}
    for budget in args.budgets:
        table[budget] = {}
        for B in args.batch:
            runs, ar_runs = measured[budget][B], measured["0"][B]
            ar = statistics.median(r["tokens_per_s"] for r in ar_runs)
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            steady = [r["steady_tokens_per_s"] for r in runs]
            ar_steady = [r["steady_tokens_per_s"] for r in ar_runs]
            table[budget][str(B)] = {
                "tokens_per_s": tps,
                "tokens_per_s_repeats": [r["tokens_per_s"] for r in runs],
                "speedup_vs_ar": tps / ar,
                # each repeat against the AR pass run beside it (same minutes of a shared machine)
                "speedup_vs_ar_repeats": [
                    r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(runs, ar_runs, strict=True)
                ],
                "steady_tokens_per_s_repeats": steady,
                "steady_speedup_vs_ar_repeats": None
                if None in steady or None in ar_steady
                else [x / a for x, a in zip(steady, ar_steady, strict=True)],
                "occupancy": statistics.median(r["occupancy"] for r in runs),
                "prefill_share": statistics.median(r["prefill_share"] for r in runs),
                "latency_p50_s": statistics.median(r["latency_p50_s"] for r in runs),
                "tau": statistics.median(r["tau"] for r in runs),
                "budgets_played": runs[-1]["budgets_played"],
            }
    out = {
        "command": shlex.join(["python", "-m", "bench.batching", *(argv or sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out",)
        },
        "acceptance_prior": None if prior is None else prior.source,
        "order_per_repeat": orders,
        "results": table,
        "auto_cost_view": {str(B): v for B, v in views.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    series = {
        budget_label(budget): [
            {"x": B, **{k: table[budget][str(B)][k] for k in ("tokens_per_s", "latency_p50_s")}}
            for B in args.batch
        ]
        for budget in args.budgets
    }
    title = (
        f"continuous batching (engine in-process): {model_name}, {args.requests} greedy requests per "
        f"batch size, {args.max_tokens} max tokens, {torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    png = plot_load(series, "requests in flight (batch size)", title, args.out.with_suffix(".png"))
    if png is not None:
        print(f"wrote {png}")
    for budget in args.budgets:
        row = " ".join(
            f"B={B}: {table[budget][str(B)]['tokens_per_s']:.0f} ({table[budget][str(B)]['speedup_vs_ar']:.2f}x)"
            for B in args.batch
        )
        print(f"budget {budget:>4}: {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
