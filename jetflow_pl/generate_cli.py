"""`python -m jetflow_pl generate` / `jetflow-generate`: speculative decoding from the command line.

Prints the generated text and the metrics of docs/DESIGN.md: tau (tokens per target verify forward), decode
tokens/s (prefill excluded) and, with `--compare`, the speedup over the AR loop on the same backend and
over HF `generate()`, measured in the same run on the same machine.

`--budget auto` (the default) picks the draft budget per round from this machine's cost profile for
this target and backend (measured once, cached; `--cost-profile FILE` to pin one) and the head's
acceptance (prior: `--acceptance-profile FILE`, else `acceptance_profile.json` beside the head or in the
engine directory), and falls back to plain AR where drafting cannot pay. It prints the budgets played and
the speedup the cost model predicts next to the measured one.

An engine directory (`--engine-dir`, onnxruntime / tensorrt) is enough alone: it holds the graphs (the
head's among them), config and tokenizer; `--target` is then needed only for HF generate() in `--compare`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from jetflow_pl.chat import encode_prompt
from jetflow_pl.decode_options import (
    add_cost_profile_arguments,
    add_threads_argument,
    budget_policy,
    check_device,
    float_in,
    int_at_least,
    load_backends,
    load_models,
    parse_budget,
)
from jetflow_pl.decoding import ARGenerator, SamplingConfig, SpeculativeGenerator
from jetflow_pl.decoding.budget import ACCEPTANCE_PROFILE_FILE, AutoBudget
from jetflow_pl.errors import MissingPathError, NumericalError, UserInputError
from jetflow_pl.runtime.loader import BACKEND_KINDS, resolve_kind
from jetflow_pl.tree import Top2GapCap


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetflow-generate", description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        type=Path,
        default=None,
        help="target model directory (HF format); optional with --engine-dir, which holds the graphs, "
        "config and tokenizer (HF generate() in --compare needs it)",
    )
    p.add_argument(
        "--head",
        type=Path,
        default=None,
        help="draft head directory; omitted = untrained head (an --engine-dir's graphs hold their own head)",
    )
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=Path, default=None, help="a text file with one prompt per line")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts raw, without the template")
    p.add_argument(
        "--budget",
        type=parse_budget,
        default="auto",
        help="draft tokens per tree (root excluded); 0 = AR; auto (default) = per round, from this "
        "machine's cost profile and the head's acceptance, AR where drafting cannot pay",
    )
    add_cost_profile_arguments(p)
    p.add_argument(
        "--acceptance-profile",
        type=Path,
        default=None,
        help=f"--budget auto: the head's acceptance prior (default: {ACCEPTANCE_PROFILE_FILE} beside the "
        "head, else in the engine directory)",
    )
    p.add_argument(
        "--save-acceptance-profile",
        type=Path,
        default=None,
        help="write the acceptance measured in this run (every ladder budget <= the ones played) as a "
        f"profile, e.g. HEAD/{ACCEPTANCE_PROFILE_FILE} after a run with a large fixed --budget",
    )
    p.add_argument("--width", type=int_at_least(1), default=4, help="children per expanded node")
    p.add_argument(
        "--gap-cap",
        type=float_in(0.0, float("inf")),
        default=None,
        help="one child where top1-top2 logprob gap > this",
    )
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=128)
    p.add_argument("--temperature", type=float_in(0.0, float("inf")), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=0)
    p.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    add_threads_argument(p)
    p.add_argument(
        "--backend",
        choices=[*BACKEND_KINDS, "graph"],
        default=None,
        help="torch (default without --engine-dir): HF target + head; torch-graph (or graph): the decode "
        "graphs eagerly in torch (tree-attention op, Triton on CUDA); onnxruntime (default with "
        "--engine-dir) / tensorrt: an exported engine directory (tensorrt needs --device cuda)",
    )
    p.add_argument(
        "--engine-dir", type=Path, default=None, help="engine directory for --backend onnxruntime / tensorrt"
    )
    p.add_argument("--compare", action="store_true", help="also time AR decoding and HF generate()")
    p.add_argument("--json", type=Path, default=None, help="write per-prompt metrics to this JSON file")
    return p


def hf_decode_tokens_per_s(model, ids: list[int], max_new: int, eos) -> tuple[list[int], float]:
    """HF greedy generate(); decode time = full call minus a 1-token call (its prefill)."""
    x = torch.tensor([ids], device=model.device)
    kw = {"do_sample": False, "eos_token_id": eos, "pad_token_id": eos if eos is not None else 0}
    t0 = time.perf_counter()
    model.generate(x, max_new_tokens=1, **kw)
    t1 = time.perf_counter()
    out = model.generate(x, max_new_tokens=max_new, **kw)[0, len(ids) :].tolist()
    t2 = time.perf_counter()
    decode = (t2 - t1) - (t1 - t0)
    return out, (len(out) - 1) / decode if decode > 0 and len(out) > 1 else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags (bad flags exit 2 naming the flag) and run; user and numerical errors are one line."""
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NumericalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _budget_counts(budgets: Sequence[int]) -> str:
    """`16x30 0x2`: budget x rounds, most played first."""
    return " ".join(f"{k}x{n}" for k, n in Counter(budgets).most_common())


def _run(args: argparse.Namespace) -> int:
    check_device(args.device)
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise MissingPathError(f"--prompts-file {args.prompts_file} does not exist")
        prompts += [ln for ln in args.prompts_file.read_text().splitlines() if ln.strip()]
    if not prompts:
        print("jetflow-generate: give at least one --prompt or --prompts-file", file=sys.stderr)
        return 2
    if args.backend is None:
        args.backend = "onnxruntime" if args.engine_dir is not None else "torch"
    target, head, tokenizer = load_models(args, resolve_kind(args.backend), need_target=args.compare)
    if args.compare and target is None:
        print(
            "note: --compare without --target: timed against the engine's own AR only "
            "(HF generate() needs --target DIR)",
            file=sys.stderr,
        )
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    eos = tokenizer.eos_token_id
    policy = Top2GapCap(args.gap_cap) if args.gap_cap is not None else None
    encoded = [encode_prompt(tokenizer, text, chat=not args.no_chat_template) for text in prompts]
    budget = budget_policy(args)
    backend, ar_backend = load_backends(args, target, head)
    spec = SpeculativeGenerator(backend, budget, args.width, policy, eos)
    recorded = spec.record_acceptance() if args.save_acceptance_profile is not None else None
    ar = ARGenerator(ar_backend, eos) if args.compare else None

    rows = []
    for i, (text, ids) in enumerate(zip(prompts, encoded, strict=True)):
        res = spec.generate(ids, args.max_new_tokens, sampling)
        if i == 0 and isinstance(budget, AutoBudget):
            print(f"note: budget auto: cost profile {budget.cost.source or '(given)'}", file=sys.stderr)
            print(f"note: budget auto: {budget.cost.summary()}", file=sys.stderr)
            prior = budget.prior.source if budget.prior is not None else "none (the first rounds probe)"
            print(f"note: budget auto: acceptance prior {prior}", file=sys.stderr)
        row = {
            "prompt": text,
            "output": tokenizer.decode(res.tokens, skip_special_tokens=True),
            "new_tokens": len(res.tokens),
            "tau": res.tau,
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "budget": args.budget,
            "budgets_played": dict(Counter(res.budgets)),
        }
        print(f"\n>>> {text}\n{row['output']}")
        line = f"[tau {res.tau:.2f} | {res.decode_tokens_per_s:.1f} tok/s decode"
        if isinstance(budget, AutoBudget):
            row["predicted_speedup_vs_ar"] = budget.predicted_speedup(res.budgets, res.accept_lengths)
            line += f" | budget auto: {_budget_counts(res.budgets) or 'no rounds'}"
            line += f" | predicted x{row['predicted_speedup_vs_ar']:.2f} vs AR"
        if ar is not None:
            ar_res = ar.generate(ids, args.max_new_tokens, sampling)
            row["ar_decode_tokens_per_s"] = ar_res.decode_tokens_per_s
            row["speedup_vs_ar"] = res.decode_tokens_per_s / max(ar_res.decode_tokens_per_s, 1e-9)
            line += f" | x{row['speedup_vs_ar']:.2f} vs AR"
            if sampling.greedy:
                row["matches_ar"] = ar_res.tokens == res.tokens
            if target is not None:  # HF generate() runs the HF model itself
                hf_tokens, hf_tps = hf_decode_tokens_per_s(target.model, ids, args.max_new_tokens, eos)
                row["hf_decode_tokens_per_s"] = hf_tps
                row["speedup_vs_hf"] = res.decode_tokens_per_s / max(hf_tps, 1e-9)
                line += f" | x{row['speedup_vs_hf']:.2f} vs HF generate"
                if sampling.greedy:
                    row["matches_hf_greedy"] = hf_tokens == res.tokens
            if "matches_hf_greedy" in row:
                line += f" | identical to HF greedy: {row['matches_hf_greedy']}"
            elif "matches_ar" in row:
                line += f" | identical to AR: {row['matches_ar']}"
        print(line + "]")
        rows.append(row)
    if recorded is not None:
        try:
            prof = recorded.to_profile(args.width, note=f"jetflow-generate on {len(prompts)} prompts")
        except ValueError as err:
            raise UserInputError(f"--save-acceptance-profile: {err}") from err
        prof.save(args.save_acceptance_profile)
        print(f"note: acceptance profile written to {args.save_acceptance_profile}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
