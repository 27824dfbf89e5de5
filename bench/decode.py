"""Decode benchmark: tau and decode tokens/s for AR and speculative decoding, per budget and domain.

    python -m bench.decode --target data_gen/toy/assets/small [--head DIR] --out bench/results/decode.json

Every number comes from one run on one machine with one backend (torch). Without `--head` the head is
untrained (random init): tau then shows the loop's floor, not the method's ceiling.

The measuring pieces are plain functions (`load_target`, `domain_prompts`, `run_prompts`,
`tokens_per_s`, `spec_summary`, `accept_histogram`) so that `bench/run_all.py` computes its numbers with
the same code and the same metric definitions (docs/DESIGN.md section 4) as this script. Per-round
metrics (`RoundRecorder`: accept length and rank-1 branch faithfulness of every verified tree) and the
prompt-level bootstrap (`bootstrap_interval`) serve `bench/ablation.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_gen.toy.splits import DOMAINS, heldout_prompts
from data_gen.toy.tokenizer import prompt_ids
from jetflow_pl.decode_options import load_head_or_untrained
from jetflow_pl.decoding import ARGenerator, GenerationResult, SpeculativeGenerator
from jetflow_pl.decoding.budget import RoundResult
from jetflow_pl.files import atomic_write_text
from jetflow_pl.runtime.loader import BACKEND_KINDS, load_backend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree

REPO = Path(__file__).resolve().parents[1]


def load_target(target_dir: Path):
    """(tokenizer, TargetModel) of a local HF target folder; nothing is downloaded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    return tokenizer, TargetModel.from_pretrained(target_dir)


def domain_prompts(tokenizer, domain: str, n: int, first: int = 0) -> list[list[int]]:
    """Chat-formatted token ids of held-out prompts `first .. first + n - 1` of a toy domain (deterministic;
    `first` keeps an evaluation apart from prompts a training run selected its checkpoint on)."""
    return [prompt_ids(tokenizer, r["prompt"]) for r in heldout_prompts(domain, first + n)[first:]]


def run_prompts(gen: SpeculativeGenerator, prompts: Sequence[list[int]], max_new_tokens: int):
    """Greedy-decode every prompt with `gen` (one `GenerationResult` per prompt, in order)."""
    return [gen.generate(ids, max_new_tokens) for ids in prompts]


def tokens_per_s(runs: Sequence[GenerationResult]) -> float:
    """Decode tokens/s over a set of runs: all decode-round tokens / all decode seconds.

    The prefill and the token it yields are excluded (docs/DESIGN.md section 4), and the set is pooled rather
    than averaged per prompt so that short (early-EOS) prompts do not dominate."""
    tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    seconds = sum(r.decode_seconds for r in runs)
    return tokens / seconds if seconds else 0.0


def mean_tau(runs: Sequence[GenerationResult]) -> float:
    """Mean over prompts of each prompt's tau (prompts that ran no round are left out)."""
    taus = [r.tau for r in runs if r.num_rounds]
    return statistics.fmean(taus) if taus else 0.0


def accept_histogram(runs: Sequence[GenerationResult]) -> dict[str, int]:
    """How many rounds committed k tokens, pooled over prompts: per-depth acceptance comes from it."""
    counts: dict[int, int] = {}
    for r in runs:
        for k in r.accept_lengths:
            counts[k] = counts.get(k, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def best_leaf_branch(tree: DraftTree) -> list[int]:
    """Node ids (root first) of the tree's rank-1 branch: the root-to-leaf path ending at the leaf with
    the highest cumulative draft log-probability (`tree.scores`; ties go to the node inserted first, as in
    `build_tree`). The root alone when the tree has no draft node.

    Why a leaf and not any node: a path to an inner node is a prefix of a longer drafted branch, so the
    question "does the target accept the head's single best guess in full" is asked of whole branches."""
    if tree.num_nodes == 1:
        return [0]
    has_child = [False] * tree.num_nodes
    for p in tree.parents.tolist()[1:]:
        has_child[p] = True
    scores = tree.scores.tolist()
    best = None
    for i in range(1, tree.num_nodes):
        if not has_child[i] and (best is None or scores[i] > scores[best]):
            best = i
    return tree.path(best)


def greedy_branch(tree: DraftTree) -> list[int]:
    """Node ids (root first) of the greedy descent: from the root, always the highest-scoring child (ties:
    the first inserted) down to a leaf; with the same per-depth top-k under every parent this is the chain
    of the head's per-depth argmax tokens, as far as the tree expanded it."""
    children: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for i, p in enumerate(tree.parents.tolist()):
        if i:
            children[p].append(i)
    scores = tree.scores.tolist()
    out = [0]
    while children[out[-1]]:
        kids = children[out[-1]]
        best = kids[0]
        for c in kids[1:]:
            if scores[c] > scores[best]:
                best = c
        out.append(best)
    return out


def branch_accepted(branch: Sequence[int], accepted: Sequence[int]) -> bool:
    """Whether the target accepted every node of `branch` (node ids, root first): the accepted path
    (root first) starts with it. A branch that ends at a leaf is then exactly the accepted path."""
    return list(accepted[: len(branch)]) == list(branch)


def accepted_prefix(branch: Sequence[int], accepted: Sequence[int]) -> int:
    """How many draft nodes of `branch` (root first) the target accepted before the first rejection."""
    n = 0
    for b, a in zip(branch[1:], accepted[1:], strict=False):
        if b != a:
            break
        n += 1
    return n


@dataclass
class RoundRecorder:
    """A round observer (`SpeculativeGenerator(backend, k, observers=[RoundRecorder()])`) that records,
    for every verified tree: the accept length (tokens committed: accepted drafts + 1), whether the
    rank-1 branch (`best_leaf_branch`) and the greedy branch (`greedy_branch`) were accepted in full,
    their lengths and how many of the rank-1 branch's drafts were accepted. Clear `rounds` between
    prompts to keep them apart."""

    rounds: list[dict] = field(default_factory=list)

    def __call__(self, result: RoundResult) -> None:
        for tree, accepted in zip(result.trees, result.accepted, strict=True):
            self.record(tree, accepted)

    def record(self, tree: DraftTree, accepted: Sequence[int]) -> None:
        best, greedy = best_leaf_branch(tree), greedy_branch(tree)
        self.rounds.append(
            {
                "accept_length": len(accepted),
                "rank1_faithful": branch_accepted(best, accepted),
                "rank1_depth": len(best) - 1,
                "rank1_accepted": accepted_prefix(best, accepted),
                "greedy_faithful": branch_accepted(greedy, accepted),
                "greedy_depth": len(greedy) - 1,
            }
        )


def bootstrap_interval(
    statistic: Callable[[Sequence[int]], float], n_items: int, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile 95% interval of `statistic(indices)` over `n_resamples` resamples (with replacement) of
    `n_items` items, seeded. Resample PROMPTS, not rounds: rounds of one prompt are correlated (the same
    text), so a round-level bootstrap understates the spread. A paired comparison of two heads passes one
    statistic that reads both heads at the same indices (the same prompts)."""
    import random

    if n_items < 1:
        raise ValueError("bootstrap_interval needs at least one item")
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n_items) for _ in range(n_items)]) for _ in range(n_resamples))
    return values[int(0.025 * n_resamples)], values[int(0.975 * n_resamples) - 1]


def spec_summary(runs: Sequence[GenerationResult], ar_runs: Sequence[GenerationResult]) -> dict:
    """tau, tokens/s, speedup over the AR runs and the lossless check (token mismatches vs AR)."""
    tps, ar_tps = tokens_per_s(runs), tokens_per_s(ar_runs)
    return {
        "tau": mean_tau(runs),
        "decode_tokens_per_s": tps,
        "speedup_vs_ar": tps / ar_tps if ar_tps else 0.0,
        "mismatches_vs_ar": sum(r.tokens != a.tokens for r, a in zip(runs, ar_runs, strict=True)),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("data_gen/toy/assets/small"))
    p.add_argument("--head", type=Path, default=None)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--refine-factor", type=int, default=0, help="branch-conditioned refinement (0 = off)")
    p.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument(
        "--first-prompt", type=int, default=0, help="skip held-out prompts before this index (e.g. 20)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", choices=BACKEND_KINDS, default="torch", help="AR runs on the same kind")
    p.add_argument("--engine-dir", type=Path, default=None, help="for --backend onnxruntime / tensorrt")
    p.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    tokenizer, target = load_target(args.target)
    head = load_head_or_untrained(args.head, target, tokenizer)
    eos = tokenizer.eos_token_id
    spec_backend = load_backend(
        args.backend, target=target, head=head, engine_dir=args.engine_dir, topk=max(8, args.width)
    )
    ar = ARGenerator(load_backend("torch", target=target) if args.backend == "torch" else spec_backend, eos)

    results: dict = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": args.threads,
        },
        "command": " ".join(["python", "-m", "bench.decode", *(argv if argv is not None else sys.argv[1:])]),
        "backend": args.backend,
        "head": str(args.head) if args.head else "untrained (random init)",
        "width": args.width,
        "refine_factor": args.refine_factor,
        "prompts": {"first": args.first_prompt, "n": args.n_prompts, "max_new_tokens": args.max_new_tokens},
        "domains": {},
    }
    for domain in args.domains:
        prompts = domain_prompts(tokenizer, domain, args.n_prompts, args.first_prompt)
        ar_runs = run_prompts(ar, prompts, args.max_new_tokens)
        ar_tps = tokens_per_s(ar_runs)
        row = {"ar": {"decode_tokens_per_s": ar_tps}, "speculative": {}}
        for budget in args.budgets:
            gen = SpeculativeGenerator(
                spec_backend, budget, args.width, eos_token_id=eos, refine_factor=args.refine_factor
            )
            stats = spec_summary(run_prompts(gen, prompts, args.max_new_tokens), ar_runs)
            row["speculative"][str(budget)] = stats
            print(
                f"{domain:6s} budget {budget:4d}: tau {stats['tau']:.2f} "
                f"{stats['decode_tokens_per_s']:8.1f} tok/s (AR {ar_tps:.1f}) "
                f"mismatches {stats['mismatches_vs_ar']}",
                flush=True,
            )
        results["domains"][domain] = row
    results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return results


def write_json(path: Path, data: dict, indent: int | None = 2) -> None:
    """Write `data` atomically (a crash mid-write never leaves a truncated results file); `indent=None`
    writes it compactly (results that keep per-prompt records)."""
    atomic_write_text(path, json.dumps(data, indent=indent))


if __name__ == "__main__":
    main()
