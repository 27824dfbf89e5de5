"""Decode benchmark: tau and decode tokens/s for AR and speculative decoding, per budget and domain.

    python bench/decode.py --target data_gen/toy/assets/small [--head DIR] --out bench/results/decode.json

Every number comes from one run on one machine with one backend (torch). Without `--head` the head is
untrained (random init): tau then shows the loop's floor, not the method's ceiling.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from data_gen.toy.splits import DOMAINS, heldout_prompts
from data_gen.toy.tokenizer import prompt_ids
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.decoding.torch_backend import TorchBackend
from jetflow_pl.generate_cli import load_head_or_untrained
from jetflow_pl.target import TargetModel


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("data_gen/toy/assets/small"))
    p.add_argument("--head", type=Path, default=None)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--refine-factor", type=int, default=0, help="branch-conditioned refinement (0 = off)")
    p.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    target = TargetModel.from_pretrained(args.target)
    head = load_head_or_untrained(args.head, target, tokenizer)
    eos = tokenizer.eos_token_id
    ar = ARGenerator(TorchBackend(target), eos)
    spec_backend = TorchBackend(target, head)

    results: dict = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": args.threads,
        },
        "command": " ".join(["python", "bench/decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "head": str(args.head) if args.head else "untrained (random init)",
        "width": args.width,
        "refine_factor": args.refine_factor,
        "domains": {},
    }
    for domain in args.domains:
        prompts = [prompt_ids(tokenizer, r["prompt"]) for r in heldout_prompts(domain, args.n_prompts)]
        ar_runs = [ar.generate(ids, args.max_new_tokens) for ids in prompts]
        ar_tps = _tokens_per_s(ar_runs)
        row = {"ar": {"decode_tokens_per_s": ar_tps}, "speculative": {}}
        for budget in args.budgets:
            gen = SpeculativeGenerator(
                spec_backend, budget, args.width, eos_token_id=eos, refine_factor=args.refine_factor
            )
            runs = [gen.generate(ids, args.max_new_tokens) for ids in prompts]
            mismatches = sum(r.tokens != a.tokens for r, a in zip(runs, ar_runs, strict=True))
            tps = _tokens_per_s(runs)
            row["speculative"][str(budget)] = {
                "tau": statistics.fmean(r.tau for r in runs if r.num_rounds),
                "decode_tokens_per_s": tps,
                "speedup_vs_ar": tps / ar_tps if ar_tps else 0.0,
                "mismatches_vs_ar": mismatches,
            }
            print(
                f"{domain:6s} budget {budget:4d}: tau {row['speculative'][str(budget)]['tau']:.2f} "
                f"{tps:8.1f} tok/s (AR {ar_tps:.1f}) mismatches {mismatches}",
                flush=True,
            )
        results["domains"][domain] = row
    results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return results


def _tokens_per_s(runs) -> float:
    tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    seconds = sum(r.decode_seconds for r in runs)
    return tokens / seconds if seconds else 0.0


if __name__ == "__main__":
    main()
