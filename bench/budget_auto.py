"""`--budget auto` against fixed budgets: tau, decode tokens/s and speedup, next to the cost-model ceiling.

    python -m bench.budget_auto --target data_gen/toy/assets/small --head data_gen/toy/assets/small_head \\
        --out bench/results/budget_auto_toy.json

Any target/head pair works (`--target models/SmolLM2-135M-Instruct --head DIR` for the real target), on
the torch, graph or ONNX Runtime backend. One run on one machine: the cost profile of this machine
(`jetflow_pl.decoding.budget.measure_costs`, cached per machine and model, or `--cost-profile FILE`), then AR,
HF `generate()`, every fixed budget and `auto` decode the same prompts, prompt-major (each prompt by
every configuration within a few seconds, so load changes on a shared machine hit all alike), greedy.
`--repeats N` runs the whole prompt pass N times (a fresh `auto` policy each time, so every repeat is the
same experiment): the pooled numbers cover all repeats, and `speedup_vs_ar_repeats` /
`speedup_vs_hf_repeats` give each repeat's own ratio with their median, minimum and maximum.

Per fixed budget k the ceiling is what the cost model allows at the measured tau: tau(k) / cost(k),
cost(k) = (t(k+1) + draft + tree build) / t(1); `fraction_of_ceiling` = measured speedup / ceiling.
`measured_round_cost` (a round's seconds over an AR round's) next to `profile_round_cost` shows whether
the profile models the rounds the loop really runs. For `auto` the prediction is its rounds' tokens over
their modelled cost, and `fraction_of_best_fixed` compares it with the best fixed budget measured here. The acceptance prior of `auto` is
`--acceptance-profile`, else the head's `acceptance_profile.json`, else one measured on
`--calibration-prompts` (at the largest fixed budget; keep those disjoint from `--prompts`), else none
(`auto` then probes); `auto_no_prior` is always measured too. Every configuration's tokens must equal
AR's (the loop is lossless in every mode): a mismatch stops the bench.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from bench import decode as dec  # the shared metric helpers
from jetflow_pl.chat import encode_prompt, row_messages
from jetflow_pl.decode_options import load_backends, load_head_or_untrained
from jetflow_pl.decoding import ARGenerator, GenerationResult, SpeculativeGenerator
from jetflow_pl.decoding.budget import (
    ACCEPTANCE_PROFILE_FILE,
    AcceptanceProfile,
    AutoBudget,
)
from jetflow_pl.decoding.budget.cost_profile import CostProfile
from jetflow_pl.decoding.budget.measure_costs import cost_profile_for
from jetflow_pl.generate_cli import hf_decode_tokens_per_s
from jetflow_pl.prompt_files import load_local_rows
from jetflow_pl.runtime.loader import BACKEND_KINDS

REPO = Path(__file__).resolve().parents[1]

DEFAULT_PROMPTS = REPO / "data_gen/toy/assets/heldout_prompts/math.jsonl"


def read_prompts(path: Path, tokenizer, n: int | None, chat: bool) -> list[list[int]]:
    """Token ids of the first `n` prompts of a jsonl/datasets file (rows with `prompt` or `messages`) or a
    `.txt` file (one prompt per line), chat-formatted unless `chat` is False."""
    if path.suffix == ".txt":
        texts: list = [ln for ln in path.read_text().splitlines() if ln.strip()][:n]
        return [encode_prompt(tokenizer, t, chat) for t in texts]
    out = []
    for i, row in enumerate(load_local_rows(path)[:n]):
        msgs = row_messages(row, f"{path} row {i}")
        out.append(encode_prompt(tokenizer, msgs if chat else msgs[-1]["content"], chat))
    return out


def pooled(runs: Sequence[GenerationResult]) -> dict:
    """Pooled tau (all tokens / all rounds) and decode tokens/s of a set of runs."""
    rounds = sum(r.num_rounds for r in runs)
    return {
        "tau": sum(sum(r.accept_lengths) for r in runs) / rounds if rounds else 0.0,
        "decode_tokens_per_s": dec.tokens_per_s(runs),
        "rounds": rounds,
        "tokens": sum(len(r.tokens) for r in runs),
        "seconds_per_round": sum(r.decode_seconds for r in runs) / rounds if rounds else 0.0,
    }


def hf_tokens_per_s(tokens: Sequence[Sequence[int]], seconds: Sequence[float]) -> float:
    """HF `generate()`'s decode tokens/s over runs (the first token of each comes from the prefill)."""
    total = sum(seconds)
    return sum(max(len(t) - 1, 0) for t in tokens) / total if total else 0.0


def spread(values: Sequence[float]) -> dict:
    """Each repeat's value, with their median, minimum and maximum."""
    return {
        "values": list(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def calibrate(backend, prompts, budget: int, width: int, eos, max_new: int) -> AcceptanceProfile:
    """Acceptance at every ladder budget <= `budget`, from fixed-budget runs on `prompts`."""
    gen = SpeculativeGenerator(backend, budget, width, eos_token_id=eos)
    stats = gen.record_acceptance()
    for ids in prompts:
        gen.generate(ids, max_new)
    return stats.to_profile(width, note=f"bench/budget_auto.py calibration, budget {budget}")


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=REPO / "data_gen/toy/assets/small")
    p.add_argument("--head", type=Path, default=REPO / "data_gen/toy/assets/small_head")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="jsonl/datasets/.txt prompts")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--calibration-prompts", type=Path, default=None, help="prompts to measure the prior on")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--backend", choices=[*BACKEND_KINDS, "graph"], default="torch")
    p.add_argument("--engine-dir", type=Path, default=None)
    p.add_argument("--cost-profile", type=Path, default=None, help="pin a cost profile (else the cache)")
    p.add_argument("--acceptance-profile", type=Path, default=None)
    p.add_argument("--write-acceptance-profile", type=Path, default=None, help="save the calibrated prior")
    p.add_argument("--skip-hf", action="store_true", help="no HF generate() baseline")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (fresh auto policies)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, and ONNX Runtime's intra-op threads on that backend (default: each one's own)",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench/results/budget_auto_toy.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer, target = dec.load_target(args.target)
    head = load_head_or_untrained(args.head, target, tokenizer)
    eos = tokenizer.eos_token_id
    chat = not args.no_chat_template
    prompts = read_prompts(args.prompts, tokenizer, args.n_prompts, chat)
    ns = argparse.Namespace(
        backend=args.backend,
        width=args.width,
        engine_dir=args.engine_dir,
        device="cpu",
        threads=args.threads,
    )
    backend, ar_backend = load_backends(ns, target, head)  # the generate CLI's: AR on the same backend kind

    t0 = time.perf_counter()
    # the bench's own profile is a full one; a --cost-profile FILE given to it is used as it is
    cost: CostProfile = cost_profile_for(backend, args.cost_profile, full=args.cost_profile is None)
    print(f"cost profile {cost.source} ({time.perf_counter() - t0:.1f} s): {cost.summary()}", flush=True)

    prior, prior_from = None, None
    beside = args.head / ACCEPTANCE_PROFILE_FILE if args.head is not None else None
    if args.acceptance_profile is not None:
        prior, prior_from = AcceptanceProfile.load(args.acceptance_profile), str(args.acceptance_profile)
    elif beside is not None and beside.is_file():
        prior, prior_from = AcceptanceProfile.load(beside), str(beside)
    elif args.calibration_prompts is not None:
        cal = read_prompts(args.calibration_prompts, tokenizer, args.n_prompts, chat)
        prior = calibrate(backend, cal, max(args.budgets), args.width, eos, args.max_new_tokens)
        prior_from = f"calibrated now on {args.calibration_prompts} ({len(cal)} prompts)"
        if args.write_acceptance_profile is not None:
            prior.save(args.write_acceptance_profile)
    print(f"acceptance prior: {prior_from or 'none'}", flush=True)

    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    ar = ARGenerator(ar_backend, eos)
    gens: dict[str, SpeculativeGenerator] = {
        str(k): SpeculativeGenerator(backend, k, args.width, eos_token_id=eos) for k in args.budgets
    }
    policies: dict[str, AutoBudget] = {}

    def fresh_policies() -> None:
        """New `auto` policies (same cost profile and prior): each repeat starts from what a new session
        knows, so the repeats are the same experiment."""
        policies.update(auto=AutoBudget(cost, prior), auto_no_prior=AutoBudget(cost, None))
        for name, pol in policies.items():
            gens[name] = SpeculativeGenerator(backend, pol, args.width, eos_token_id=eos)

    fresh_policies()
    ar.generate(prompts[0], 8)  # warm-up (first-call allocations), not measured
    for g in gens.values():
        g.generate(prompts[0], 8)
    # the largest fixed budget's acceptance, counted over the measured rounds only
    largest = gens[str(max(args.budgets))].record_acceptance()

    # per repeat: every configuration's runs, AR's, HF's (tokens, seconds)
    reps: list[dict[str, list[GenerationResult]]] = []
    ar_reps: list[list[GenerationResult]] = []
    hf_reps: list[tuple[list[list[int]], list[float]]] = []
    for rep in range(args.repeats):
        # every repeat, the first included, starts from new policies: the warm-up above ran through the
        # first ones, and `auto` keeps what it saw (learn=True)
        fresh_policies()
        runs_r: dict[str, list[GenerationResult]] = {name: [] for name in gens}
        ar_r: list[GenerationResult] = []
        hf_r: tuple[list[list[int]], list[float]] = ([], [])
        for i, ids in enumerate(prompts):
            print(
                f"repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompts)} ({len(ids)} tokens)",
                flush=True,
            )
            ar_r.append(ar.generate(ids, args.max_new_tokens))
            if not args.skip_hf:
                out, tps = hf_decode_tokens_per_s(target.model, ids, args.max_new_tokens, eos)
                hf_r[0].append(out)
                hf_r[1].append((len(out) - 1) / tps if tps > 0 else 0.0)
            for name, g in gens.items():
                runs_r[name].append(g.generate(ids, args.max_new_tokens))
        for name, rs in runs_r.items():
            bad = [i for i, (r, a) in enumerate(zip(rs, ar_r, strict=True)) if r.tokens != a.tokens]
            if bad:
                raise AssertionError(
                    f"{name}: tokens differ from AR on prompts {bad}: the loop is not lossless"
                )
        reps.append(runs_r)
        ar_reps.append(ar_r)
        hf_reps.append(hf_r)
    runs = {name: [r for rep in reps for r in rep[name]] for name in gens}
    ar_runs = [r for rep in ar_reps for r in rep]
    hf_tokens = [t for rep in hf_reps for t in rep[0]]
    hf_seconds = [x for rep in hf_reps for x in rep[1]]

    ar_stats = pooled(ar_runs)
    ar_tps = ar_stats["decode_tokens_per_s"]
    result: dict = {
        "command": shlex.join(
            ["python", "-m", "bench.budget_auto", *(argv if argv is not None else sys.argv[1:])]
        ),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**cost.fingerprint, "load_average_1m": os.getloadavg()[0]},
        "target": str(args.target),
        "head": str(args.head) if args.head else "untrained (random init)",
        "backend": args.backend,
        "prompts": str(args.prompts),
        "n_prompts": len(prompts),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "width": args.width,
        "cost_profile": {
            "source": cost.source,
            "kv_len": cost.kv_len,
            "t1_ms": cost.t1 * 1e3,
            "cost": {str(k): cost.cost(k) for k in cost.budgets},
        },
        "acceptance_prior": None if prior is None else {"from": prior_from, **prior.to_dict()},
        "ar": ar_stats,
        "lossless": True,
    }
    if hf_seconds:
        hf_rate = hf_tokens_per_s(hf_tokens, hf_seconds)
        result["hf_generate"] = {
            "decode_tokens_per_s": hf_rate,
            "matches_ar": sum(h == a.tokens for h, a in zip(hf_tokens, ar_runs, strict=True)),
        }
    else:
        hf_rate = 0.0

    def speed(name: str, stats: dict) -> dict:
        """Speedups over the pooled runs, and each repeat's own (AR and HF of that same repeat)."""
        out: dict = {"speedup_vs_ar": stats["decode_tokens_per_s"] / ar_tps if ar_tps else 0.0}
        if hf_rate:
            out["speedup_vs_hf"] = stats["decode_tokens_per_s"] / hf_rate
        if args.repeats > 1:
            own = [dec.tokens_per_s(rep[name]) for rep in reps]
            out["speedup_vs_ar_repeats"] = spread(
                [o / dec.tokens_per_s(a) for o, a in zip(own, ar_reps, strict=True)]
            )
            if hf_rate:
                out["speedup_vs_hf_repeats"] = spread(
                    [o / hf_tokens_per_s(*h) for o, h in zip(own, hf_reps, strict=True)]
                )
        return out

    fixed: dict = {}
    for k in args.budgets:
        stats = pooled(runs[str(k)])
        ceiling = stats["tau"] / cost.cost(k) if k in cost.budgets else None
        row = {**stats, **speed(str(k), stats), "ceiling_speedup_vs_ar": ceiling}
        row["fraction_of_ceiling"] = row["speedup_vs_ar"] / ceiling if ceiling else None
        # what a round really cost in AR rounds, next to what the profile says: where they differ, the
        # profile (or the load while it was measured) misses something the decode loop pays
        ar_round = ar_stats["seconds_per_round"]
        row["measured_round_cost"] = stats["seconds_per_round"] / ar_round if ar_round else None
        row["profile_round_cost"] = cost.cost(k) if k in cost.budgets else None
        fixed[str(k)] = row
    result["fixed"] = fixed
    best_k = max(fixed, key=lambda k: fixed[k]["speedup_vs_ar"])
    for name, pol in policies.items():
        rs = runs[name]
        stats = pooled(rs)
        budgets = [b for r in rs for b in r.budgets]
        lengths = [n for r in rs for n in r.accept_lengths]
        row = {**stats, **speed(name, stats)}
        row["budgets_played"] = {str(k): n for k, n in sorted(Counter(budgets).items())}
        row["predicted_speedup_vs_ar"] = pol.predicted_speedup(budgets, lengths)
        # what the clock check saw at the end (observed/profiled seconds per budget, the costs it used):
        # where auto played budgets the fixed rows show to lose, this says whether its costs were off
        row["clock_check"] = pol.timing_report()
        row["best_fixed_budget"] = int(best_k)
        row["best_fixed_speedup_vs_ar"] = fixed[best_k]["speedup_vs_ar"]
        row["fraction_of_best_fixed"] = (
            row["speedup_vs_ar"] / fixed[best_k]["speedup_vs_ar"] if fixed[best_k]["speedup_vs_ar"] else None
        )
        result[name] = row
    # accept length at every ladder budget <= the largest fixed one, from that budget's own rounds (the
    # prefix property: its first k+1 nodes are the budget-k tree)
    result["acceptance_by_budget"] = {str(k): largest.mean(k) for k in largest.budgets if largest.count(k)}

    print(f"AR {ar_tps:.1f} tok/s" + (f" | HF generate {hf_rate:.1f} tok/s" if hf_rate else ""))
    for k, row in fixed.items():
        ceil = f"{row['ceiling_speedup_vs_ar']:.2f}" if row["ceiling_speedup_vs_ar"] else "-"
        print(
            f"budget {k:>4s}: tau {row['tau']:.2f} {row['decode_tokens_per_s']:8.1f} tok/s "
            f"x{row['speedup_vs_ar']:.2f} vs AR (ceiling x{ceil}; round cost {row['measured_round_cost']:.2f} "
            f"measured, {row['profile_round_cost'] or float('nan'):.2f} profiled)"
        )
    for name in policies:
        row = result[name]
        print(
            f"{name:>13s}: tau {row['tau']:.2f} {row['decode_tokens_per_s']:8.1f} tok/s "
            f"x{row['speedup_vs_ar']:.2f} vs AR (predicted x{row['predicted_speedup_vs_ar']:.2f}) "
            f"budgets {row['budgets_played']}"
        )
    dec.write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
