"""Regeneration benchmark: generated tokens/s of batched greedy regeneration at batch 1, 4 and 16.

    python -m bench.regenerate --target data_gen/toy/assets/small --out bench/results/regenerate.json

The same held-out toy prompts (all domains, chat-formatted) are regenerated at every batch size with the
stage's own code path (`PromptDataModule` length buckets + `batched_generate` with a KV cache, fp32). Greedy
regeneration is exact, so every batch size produces the same tokens; the JSON records that check too.
tokens/s counts generated tokens (stop tokens included) over the wall time of the whole set.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from data_gen.regenerate.module import RegenerationModule, batched_generate
from data_gen.regenerate.prompts import PromptDataModule, bucket_batches, collate_left


def run_once(module: RegenerationModule, items, batch_size: int, max_new_tokens: int, pad_id: int) -> dict:
    batches = bucket_batches(items, batch_size, None, max_new_tokens)
    tokens: dict[str, list[int]] = {}
    padded = real = 0
    t0 = time.perf_counter()
    for batch in batches:
        b = collate_left(batch, pad_id)
        padded += int(b["attention_mask"].numel())
        real += int(b["attention_mask"].sum())
        out, _ = batched_generate(
            module.target, b["input_ids"], b["attention_mask"], max_new_tokens, module.stop_ids
        )
        for it, toks in zip(batch, out, strict=True):
            tokens[it.id] = toks
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(t) for t in tokens.values())
    return {
        "batch_size": batch_size,
        "batches": len(batches),
        "new_tokens": n_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(n_tokens / seconds, 2),
        "samples_per_s": round(len(items) / seconds, 3),
        "prompt_padding_fraction": round(1 - real / max(padded, 1), 4),
        "_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("data_gen/toy/assets/small"))
    p.add_argument("--tokenizer", type=Path, default=None, help="defaults to --target")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--n-per-domain", type=int, default=11, help="held-out prompts per domain (3 domains)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: tiny models)")
    p.add_argument("--out", type=Path, default=Path("bench/results/regenerate.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (args.target / "config.json").is_file():
        p.error(f"--target {args.target} is not a model folder (no config.json); build the toy target first")

    module = RegenerationModule(
        str(args.target),
        tokenizer_path=str(args.tokenizer) if args.tokenizer else None,
        max_new_tokens=args.max_new_tokens,
    )
    dm = PromptDataModule(f"toy:all:heldout:{args.n_per_domain}", overlong="skip")
    dm.prepare_items(module.tokenizer, module.context_length, args.max_new_tokens)
    items = dm.items
    # warm-up (allocator, kernels) outside the timed runs
    run_once(module, items[:2], 2, 4, dm.pad_id)
    runs = [run_once(module, items, bs, args.max_new_tokens, dm.pad_id) for bs in args.batch_sizes]
    reference = runs[0]["_tokens"]
    identical = all(r["_tokens"] == reference for r in runs)
    for r in runs:
        del r["_tokens"]
    result = {
        "benchmark": "regenerate",
        "target": str(args.target),
        "dtype": "float32",
        "decoding": "greedy, batched, KV cache, left padding, length-bucketed",
        "prompts": len(items),
        "prompt_tokens_mean": round(sum(len(i.prompt_ids) for i in items) / len(items), 1),
        "max_new_tokens": args.max_new_tokens,
        "outputs_identical_across_batch_sizes": identical,
        "runs": runs,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": args.threads,
            "device": "cpu",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(
            f"batch {r['batch_size']:>3}: {r['tokens_per_s']:>9.1f} tok/s  ({r['new_tokens']} tokens, {r['seconds']:.2f}s)"
        )
    print(f"outputs identical across batch sizes: {identical}; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
