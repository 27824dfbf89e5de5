"""Gemma 3 270M with its head: verify cost curve, tau, and speed against own AR and HF `generate()`.

    python -m bench.gemma3 --target models/gemma-3-270m --head heads/gemma-3-270m \
        [--engine-dir engines/gemma3-270m] --out bench/results/gemma3_270m.json

1. **Verify cost curve** per backend: `t(N)` = one verify of a tree of `N` nodes after a 256-token prefix,
   median of `--cost-repeats`, as `t(N)/t(1)`; on torch also the lm_head's time on the same rows (the
   262,144-row product every verify pays) and its share of `t(N)`.
2. **Decoding** on held-out toy math and code prompts continued as plain text (the base model has no chat
   template; the regeneration prompted it the same way): per prompt, in an order rotated from prompt to
   prompt, HF `generate()` (torch only), own AR, budgets 16 and 64 and `auto` (its prior resolved as
   `generate` resolves it: `--acceptance-profile`, else the head's, else the engine directory's). Each
   speculative output is compared token for token with own AR and HF `generate()`. Speeds are decode
   tokens/s (prefill and its token excluded); ratios are medians over prompts and repeats of per-prompt
   ratios measured side by side.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from bench.draft_gemm import median_ms
from jetflow_pl.chat import encode_prompt
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decode_options import acceptance_prior
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.decoding.budget import AutoBudget
from jetflow_pl.generate_cli import hf_decode_tokens_per_s
from jetflow_pl.prompt_files import load_local_rows
from jetflow_pl.runtime.loader import load_backend
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree

REPO = Path(__file__).resolve().parents[1]

HELDOUT = REPO / "data_gen" / "toy" / "assets" / "heldout_prompts"
SIZES = (1, 2, 4, 8, 16, 32, 64)
WIDTH = 4  # children per expanded node, every speculative decode here


def verify_cost(backend, target: TargetModel | None, repeats: int) -> dict:
    """`t(N)` of one verify after a 256-token prefix (and, with `target`, the lm_head's part)."""
    gen = torch.Generator().manual_seed(0)
    top = min(20000, backend.vocab_size)
    backend.prefill(torch.randint(10, top, (256,), generator=gen))
    rows = {}
    for n in SIZES:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = DraftTree.from_parents(torch.randint(10, top, (n,), generator=gen), parents)

        def one(tree=tree):
            backend.verify(tree)
            backend.commit([0])  # keeps one row: the KV grows by one per call (256 -> ~300)

        row = {"verify_ms": median_ms(one, repeats)}
        if target is not None:
            hidden = torch.randn(1, n, target.hidden_size)
            with torch.no_grad():
                row["lm_head_ms"] = median_ms(lambda h=hidden: target.lm_head(h), repeats)
        rows[n] = row
    base = rows[1]["verify_ms"]
    for row in rows.values():
        row["ratio"] = row["verify_ms"] / base
        if "lm_head_ms" in row:
            row["lm_head_share"] = row["lm_head_ms"] / row["verify_ms"]
    return rows


def heldout(tokenizer, domain: str, first: int, n: int) -> list[list[int]]:
    rows = load_local_rows(HELDOUT / f"{domain}.jsonl")[first : first + n]
    return [encode_prompt(tokenizer, r["prompt"], chat=False) for r in rows]


def decode(backend, hf, prompts: dict, budgets: list, max_new: int, repeats: int, eos, prior=None) -> dict:
    """Per domain: tau, tokens/s and per-prompt ratios vs own AR (and HF), every output checked;
    `auto` starts from the acceptance `prior` (None: it probes first)."""
    labels = ["ar", *[f"b{b}" for b in budgets]]
    gens = {"ar": ARGenerator(backend, eos_token_id=eos)}
    for b in budgets:
        policy = AutoBudget(prior=prior) if b == "auto" else b
        gens[f"b{b}"] = SpeculativeGenerator(backend, budget=policy, width=WIDTH, eos_token_id=eos)
    for g in gens.values():  # first-call allocations and `auto`'s cost profile, off the clock
        g.generate(prompts[next(iter(prompts))][0], 8)
    out = {}
    turn = 0
    for domain, plist in prompts.items():
        per = {label: {"tps": [], "tau": [], "x_ar": [], "x_hf": []} for label in labels}
        per["hf"] = {"tps": []}
        lossless = {label: 0 for label in labels}
        total = 0
        for _ in range(repeats):
            for ids in plist:
                order = labels[turn % len(labels) :] + labels[: turn % len(labels)]
                turn += 1
                hf_tokens, hf_tps = (
                    hf_decode_tokens_per_s(hf, ids, max_new, eos) if hf is not None else (None, None)
                )
                res = {label: gens[label].generate(ids, max_new) for label in order}
                total += 1
                ref = res["ar"].tokens
                for label in labels:
                    tps = res[label].decode_tokens_per_s
                    per[label]["tps"].append(tps)
                    per[label]["tau"].append(res[label].tau)
                    per[label]["x_ar"].append(tps / res["ar"].decode_tokens_per_s)
                    same = res[label].tokens == ref and (hf_tokens is None or res[label].tokens == hf_tokens)
                    lossless[label] += int(same)
                    if hf_tps:
                        per[label]["x_hf"].append(tps / hf_tps)
                if hf_tps:
                    per["hf"]["tps"].append(hf_tps)
        summary = {}
        for label in labels:
            p = per[label]
            summary[label] = {
                "tau": statistics.mean(p["tau"]),
                "tokens_per_s": statistics.median(p["tps"]),
                "x_own_ar": statistics.median(p["x_ar"]),
                "x_own_ar_range": [min(p["x_ar"]), max(p["x_ar"])],
                "lossless": f"{lossless[label]}/{total}",
            }
            if p["x_hf"]:
                summary[label]["x_hf_generate"] = statistics.median(p["x_hf"])
        if per["hf"]["tps"]:
            summary["hf_generate"] = {"tokens_per_s": statistics.median(per["hf"]["tps"])}
        out[domain] = summary
        print(domain, json.dumps(summary), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--head", type=Path, required=True)
    p.add_argument("--engine-dir", type=Path, default=None, help="also measure ONNX Runtime on this engine")
    p.add_argument("--n-prompts", type=int, default=6, help="held-out prompts per domain")
    p.add_argument("--first", type=int, default=8, help="skip the prompts the fit's val/tau read (0-5)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cost-repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--acceptance-profile", type=Path, default=None, help="auto's prior (default: the head's)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = TargetModel.from_pretrained(args.target)
    head = load_draft_head(args.head)
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    prompts = {d: heldout(tokenizer, d, args.first, args.n_prompts) for d in ("math", "code")}
    budgets = [16, 64, "auto"]
    prior = acceptance_prior(argparse.Namespace(**vars(args), width=WIDTH))
    result = {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "auto_prior": None if prior is None else prior.source,
    }
    torch_backend = TorchBackend(target, head.eval())
    # the cost curve first, on the same backends the decodes use (each prefill starts a slot afresh)
    result["verify_cost"] = {"torch": verify_cost(torch_backend, target, args.cost_repeats)}
    result["decode"] = {
        "torch": decode(torch_backend, hf, prompts, budgets, args.max_new_tokens, args.repeats, eos, prior)
    }
    if args.engine_dir is not None:
        ort = load_backend("onnxruntime", engine_dir=args.engine_dir)
        result["verify_cost"]["onnxruntime"] = verify_cost(ort, None, args.cost_repeats)
        result["decode"]["onnxruntime"] = decode(
            ort, None, prompts, budgets, args.max_new_tokens, args.repeats, eos, prior
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
