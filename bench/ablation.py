"""Causal vs bidirectional draft heads, trained identically, at uniform offset weights and at gamma 7.

    OMP_NUM_THREADS=1 python -m bench.ablation all --steps 800 --out bench/results/ablation_toy.json

The paper's ablation (JetFlow/JetSpec) on the toy world: four heads from ONE base config
(`configs/distill/toy_ablation.yaml`: 2 head layers, the raw toy corpora, seed 0), differing only in the
in-block attention (`causal`) and the offset loss weights (`decay_gamma`: null = uniform, the paper's
gamma = 0; 7 = the paper's best), each trained for the same number of steps. Each head is then decoded
greedily on held-out prompts of every toy domain at budgets 16-256 (width 4) and measured per prompt:
tau, the accept-length histogram (per-depth acceptance) and the share of rounds whose rank-1 branch the
target accepted in full (`bench.decode.RoundRecorder`). Intervals are percentile bootstraps over PROMPTS
(`bench.decode.bootstrap_interval`); the causal/bidirectional tau ratio is paired by prompt.

Stages (each resumable: a trained head, an evaluated head and the evidence are kept and skipped):

- `train`: `python -m jetflow_pl fit` per head (config under `<root>/<head>/config.yaml`, log `fit.log`),
  under `--fit-timeout` (a hang guard; a fit that ran past it is reported, never skipped as trained on a
  rerun: only a completed fit writes `<root>/<head>/train.json`); the training curves (val loss / simulated tau every
  `val_check_interval`, real `val/tau@16/64/256` on 10 held-out math prompts every `--tau-every` steps)
  come from the CSV log.
- `eval`: the decodes above; per-prompt records go into the results JSON (so every statistic can be
  recomputed from it), plus the lossless check against AR.
- `evidence`: why a toy can or cannot show the gap: how peaked the target's next-token distributions are
  along its own greedy continuations, and how far the depth-2 MARGINAL (what a head that does not see its
  own drafted token can at best predict) is from the depth-2 CONDITIONAL given the right depth-1 token;
  for the toy target and, when present, the real target (models/SmolLM2-135M-Instruct) on the same prompts.
- `refine`: math again with branch-conditioned refinement (`--refine-factor`), the one decode mode in
  which a head reads its own drafted tokens (so causal attention can condition a depth on the branch).
- `merge`: fold the heads of runs made on other cores (`--merge-from A.json B.json`, each its own `--out`)
  into `--out`; runs with other evaluation settings or another base config are refused.
- `report`: statistics, ratios and the goal check into the JSON, figures (`--plots DIR`), markdown tables.
- `all`: every stage, in this order.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from bench.decode import (
    RoundRecorder,
    bootstrap_interval,
    domain_prompts,
    load_target,
    write_json,
)
from bench.head_study import set_dotted

REPO = Path(__file__).resolve().parents[1]

#: name -> (what, {dotted key: value}) on top of the base config
HEADS: dict[str, tuple[str, dict]] = {
    "causal_g0": (
        "causal in-block attention, uniform offset weights (gamma 0)",
        {"model.init_args.causal": True, "model.init_args.decay_gamma": None},
    ),
    "bidir_g0": (
        "bidirectional in-block attention, uniform offset weights (gamma 0)",
        {"model.init_args.causal": False, "model.init_args.decay_gamma": None},
    ),
    "causal_g7": (
        "causal in-block attention, offset weights exp(-(k-1)/7)",
        {"model.init_args.causal": True, "model.init_args.decay_gamma": 7.0},
    ),
    "bidir_g7": (
        "bidirectional in-block attention, offset weights exp(-(k-1)/7)",
        {"model.init_args.causal": False, "model.init_args.decay_gamma": 7.0},
    ),
    "causal_g0_path": (
        "causal_g0 plus half the blocks path-conditioned (training for the tree-causal refine pass)",
        {
            "model.init_args.causal": True,
            "model.init_args.decay_gamma": None,
            "model.init_args.path_fraction": 0.5,
        },
    ),
    "causal_g7_path": (
        "causal_g7 plus half the blocks path-conditioned (both changes that raised tau, together)",
        {
            "model.init_args.causal": True,
            "model.init_args.decay_gamma": 7.0,
            "model.init_args.path_fraction": 0.5,
        },
    ),
}
#: training for the refine pass, per offset weighting: (head trained for it, the same head without it)
PATH_PAIRS: dict[str, tuple[str, str]] = {
    "gamma0": ("causal_g0_path", "causal_g0"),
    "gamma7": ("causal_g7_path", "causal_g7"),
}
#: comparison -> (causal head, bidirectional head, goal for tau(causal)/tau(bidirectional) at budget 256)
PAIRS: dict[str, tuple[str, str, float]] = {
    "gamma0": ("causal_g0", "bidir_g0", 1.3),
    "gamma7": ("causal_g7", "bidir_g7", 1.05),
}
#: the heads of the causal-vs-bidirectional pairs, what every stage runs by default
PAIR_HEADS = [h for causal, bidirectional, _ in PAIRS.values() for h in (causal, bidirectional)]
#: gamma 7 against gamma 0 at the same attention: (gamma-7 head, gamma-0 head); how much the position decay
#: itself moves tau, paired by prompt (the causal-vs-bidirectional pairs above compare attentions instead)
GAMMA_PAIRS: dict[str, tuple[str, str]] = {
    "causal": ("causal_g7", "causal_g0"),
    "bidirectional": ("bidir_g7", "bidir_g0"),
}
DOMAINS = ("math", "code", "prose")
BLOCK_DEPTHS = 15  # block_size 16: at most 15 drafts per round


# ------------------------------------------------------------------------------------------- training
def run_config(base: dict, name: str, root: Path, steps: int, tau_every: int) -> dict:
    """The base config with head `name`'s changes, `steps` steps and its outputs under `root/name`."""
    cfg = copy.deepcopy(base)
    for key, value in HEADS[name][1].items():
        set_dotted(cfg, key, value)
    run = root / name
    t = cfg["trainer"]
    t["max_steps"] = steps
    t["default_root_dir"] = str(run)
    t["logger"]["init_args"]["save_dir"] = str(run)
    for cb in t["callbacks"]:
        args = cb["init_args"]
        if cb["class_path"].endswith("AcceptanceLengthCallback"):
            args["every_n_steps"] = tau_every
        elif cb["class_path"].endswith("HFHeadExport"):
            args["dirpath"] = str(run / "head")
    return cfg


def train(name: str, cfg: dict, root: Path, timeout_s: float) -> dict:
    """Fit one head (skipped when a fit of the same config completed: its `train.json` is written only
    then, so a killed fit's `head/last` is never taken for the finished head); wall seconds and status."""
    run = root / name
    head = run / "head" / "last" / "config.json"
    cfg_path = run / "config.yaml"
    done = run / "train.json"
    text = yaml.safe_dump(cfg, sort_keys=False)
    if done.is_file() and head.is_file() and cfg_path.is_file() and cfg_path.read_text() == text:
        print(f"{name}: trained, skipped", flush=True)
        return json.loads(done.read_text())
    run.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)  # an earlier fit's record must not outlive this one's start
    cfg_path.write_text(text)
    print(f"{name}: training {cfg['trainer']['max_steps']} steps ({HEADS[name][0]})", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with (run / "fit.log").open("w") as log:
        proc = subprocess.run(
            [
                "timeout",
                str(int(timeout_s)),
                sys.executable,
                "-m",
                "jetflow_pl",
                "fit",
                "--config",
                str(cfg_path),
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    info = {"fit_seconds": time.perf_counter() - t0, "returncode": proc.returncode}
    if proc.returncode == 124:  # timeout(1)'s status: the fit was killed, its `last` export is stale
        raise SystemExit(
            f"error: training {name} ran past --fit-timeout {timeout_s:.0f} s and was killed "
            f"(its head/last, if any, is not the {cfg['trainer']['max_steps']}-step head); see {run / 'fit.log'}"
        )
    if proc.returncode != 0 or not head.is_file():
        raise SystemExit(f"error: training {name} failed (rc {proc.returncode}); see {run / 'fit.log'}")
    done.write_text(json.dumps(info))
    return info


def training_curves(run: Path) -> dict:
    """From the run's CSV log: validation rows by step (every `val/*` value) and the logged train loss."""
    val: dict[int, dict] = {}
    train_loss: list[list[float]] = []
    for path in sorted(run.glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for r in csv.DictReader(f):
                step = int(r["step"])
                for k, v in r.items():
                    if k.startswith("val/") and v:
                        val.setdefault(step, {"step": step})[k] = float(v)
                if r.get("train/loss"):
                    train_loss.append([step, float(r["train/loss"])])
    return {"val": [val[s] for s in sorted(val)], "train_loss": train_loss}


# ----------------------------------------------------------------------------------------- evaluation
def eval_prompts(tokenizer, n: int, math_first: int) -> dict[str, list[list[int]]]:
    """Held-out prompts per domain; math starts at `math_first`, past the prompts val/tau watched."""
    return {d: domain_prompts(tokenizer, d, n, math_first if d == "math" else 0) for d in DOMAINS}


def training_prompt_texts(base: dict) -> set[str]:
    """The prompts the base config trains on: the raw toy corpora's (`documents` counts, seed 0) or, for a
    regenerated dataset (the real target), the prompts its regeneration config read."""
    data = base["data"]["init_args"]
    if data.get("documents"):
        from data_gen.toy.splits import train_records

        counts = data["documents"]["init_args"]["counts"]
        return {r["prompt"] for d, n in counts.items() for r in train_records(d, n, 0)}
    from data_gen.regenerate.prompts import load_rows

    regen = yaml.safe_load((REPO / data["regenerate_config"]).read_text())
    return {r["prompt"] for r in load_rows(regen["data"]["init_args"]["source"])}


def check_disjoint(prompts_text: dict[str, list[str]], training: set[str]) -> dict[str, int]:
    """How many evaluation prompts also occur among the training prompts (by text): 0 expected."""
    return {d: len(set(texts) & training) for d, texts in prompts_text.items()}


def decode_head(
    backend, prompts: dict, plan: dict, width: int, eos: int, ar_tokens, refine_factor: int = 0
) -> dict:
    """Per domain and budget, one record per prompt: tau, rounds, accept-length histogram, rank-1 and
    greedy branch faithful rounds, and whether the tokens equal AR's (lossless check)."""
    from jetflow_pl.decoding import SpeculativeGenerator

    out: dict = {}
    for domain, ids in prompts.items():
        out[domain] = {}
        budgets, max_new = plan[domain]["budgets"], plan[domain]["max_new_tokens"]
        for b in budgets:
            rec = RoundRecorder()
            gen = SpeculativeGenerator(
                backend, b, width, eos_token_id=eos, refine_factor=refine_factor, observers=[rec]
            )
            rows = []
            for i, p in enumerate(ids):
                rec.rounds.clear()
                res = gen.generate(p, max_new)
                rows.append(
                    {
                        "tau": res.tau,
                        "rounds": res.num_rounds,
                        "hist": dict(Counter(str(r["accept_length"]) for r in rec.rounds)),
                        "rank1": sum(r["rank1_faithful"] for r in rec.rounds),
                        "greedy": sum(r["greedy_faithful"] for r in rec.rounds),
                        "rank1_depth_sum": sum(r["rank1_depth"] for r in rec.rounds),
                        "rank1_accepted_sum": sum(r["rank1_accepted"] for r in rec.rounds),
                        "same_as_ar": res.tokens == ar_tokens[domain][i],
                    }
                )
            out[domain][str(b)] = rows
            print(
                f"    {domain} @{b}: tau {statistics.fmean(r['tau'] for r in rows):.2f}, rank-1 faithful "
                f"{sum(r['rank1'] for r in rows) / max(sum(r['rounds'] for r in rows), 1):.2f}",
                flush=True,
            )
    return out


def ar_reference(backend, prompts: dict, plan: dict, eos: int) -> dict[str, list[list[int]]]:
    from jetflow_pl.decoding import ARGenerator

    ar = ARGenerator(backend, eos)
    return {d: [ar.generate(p, plan[d]["max_new_tokens"]).tokens for p in ids] for d, ids in prompts.items()}


# ------------------------------------------------------------------------------------------- evidence
def conditional_evidence(target, prompts: list[list[int]], max_new: int, k: int, eos: int) -> dict:
    """Peakedness of the target's next-token distributions along its own greedy continuations, and the
    depth-2 marginal vs conditional.

    For each prompt: the greedy continuation S (AR, `max_new` tokens). One target forward over S plus, for
    every response position t, its top-`k` depth-1 alternatives x1 as extra rows (a `DraftTree`: the chain
    S with branch children, under the tree mask, so each x1 row sees S[:t+1] and itself) gives
    p1 = p(. | S[:t+1]) and p(. | S[:t+1], x1). The depth-2 marginal is m2 = sum_x1 p1(x1) p(. | .., x1)
    over the top-k x1 (their mass is `coverage`). A head whose depth-2 row does not see the depth-1 token
    (both heads here: the block holds MASK tokens) can at best learn m2; the target accepts S[t+2], the
    argmax of the conditional given the right depth-1 token. So `m2_argmax_is_greedy` near 1 means
    marginals are consistent with the joint (no room for a causal-vs-marginal gap), and
    `greedy_in_m2_top4` bounds the depth-2 acceptance of a width-4 tree of marginals.
    """
    import torch

    from jetflow_pl.decoding import ARGenerator
    from jetflow_pl.runtime.loader import load_backend
    from jetflow_pl.tree import DraftTree

    ar = ARGenerator(load_backend("torch", target=target), eos)
    ent, top1, m2_hit, m2_top4, cov, p_cond, p_marg = [], [], [], [], [], [], []
    for prompt in prompts:
        resp = ar.generate(prompt, max_new).tokens
        seq = list(prompt) + resp
        L, P = len(seq), len(prompt)
        with torch.no_grad():
            first = target(torch.tensor([seq]), logits_positions="all").logits[0].float()
        logp = torch.log_softmax(first, dim=-1)  # row t: p(. | seq[:t+1])
        # depth-2 pairs need S[t+1] and S[t+2] to exist: t from P-1 (predicting the first response token)
        ts = list(range(P - 1, L - 2))
        tokens, parents = list(seq), [-1, *range(L - 1)]
        cand = []
        for t in ts:
            vals, ids = torch.topk(logp[t], k)
            for v, x in zip(vals.tolist(), ids.tolist(), strict=True):
                cand.append((t, x, v))
                tokens.append(x)
                parents.append(t)
        tree = DraftTree.from_parents(tokens, parents)
        with torch.no_grad():
            out = (
                target(
                    tree.tokens[None],
                    position_ids=tree.position_ids(0)[None],
                    attention_mask=tree.additive_mask(0, target.dtype),
                    logits_positions="all",
                )
                .logits[0]
                .float()
            )
        branch = torch.softmax(out[L:], dim=-1).view(len(ts), k, -1)  # p(. | S[:t+1], x1)
        for j, t in enumerate(ts):
            p1 = logp[t].exp()
            ent.append(float(-(p1 * logp[t]).sum()))
            top1.append(float(p1.max()))
            w = torch.tensor([math.exp(c[2]) for c in cand[j * k : (j + 1) * k]])
            m2 = (w[:, None] * branch[j]).sum(0)
            g = seq[t + 2]  # the target's greedy token after the right depth-1 token S[t+1]
            m2_hit.append(int(m2.argmax()) == g)
            m2_top4.append(g in torch.topk(m2, 4).indices.tolist())
            cov.append(float(w.sum()))
            p_cond.append(float(torch.softmax(first[t + 1], dim=-1)[g]))
            p_marg.append(float(m2[g]))
    n = len(ent)
    return {
        "positions": n,
        "prompts": len(prompts),
        "next_token_entropy_nats": statistics.fmean(ent),
        "next_token_top1_prob": statistics.fmean(top1),
        "share_top1_prob_over_0.9": sum(x > 0.9 for x in top1) / n,
        "depth2_m2_argmax_is_greedy": sum(m2_hit) / n,
        "depth2_greedy_in_m2_top4": sum(m2_top4) / n,
        "depth2_top_k": k,
        "depth2_topk_coverage": statistics.fmean(cov),
        "depth2_p_conditional_of_greedy": statistics.fmean(p_cond),
        "depth2_p_marginal_of_greedy": statistics.fmean(p_marg),
    }


def evidence(args) -> dict:
    """`conditional_evidence` for the toy target and (when materialized) the real one, same prompt texts."""
    from data_gen.toy.tokenizer import prompt_ids as toy_prompt_ids
    from jetflow_pl.chat import prompt_ids as chat_prompt_ids
    from jetflow_pl.prompt_files import load_local_rows

    texts = {
        d: [r["prompt"] for r in load_local_rows(REPO / f"bench/prompts/heldout_eval_{d}.jsonl")]
        for d in DOMAINS
    }
    out = {
        "prompts": "bench/prompts/heldout_eval_<domain>.jsonl (16 each)",
        "max_new_tokens": args.evidence_tokens,
    }
    targets = {
        "toy_small": (args.target, toy_prompt_ids),
        "smollm2_135m_instruct": (args.real_target, chat_prompt_ids),
    }
    for name, (path, fmt) in targets.items():
        if not (Path(path) / "config.json").is_file():
            out[name] = {"skipped": f"{path} not materialized (python -m data_gen.real_target)"}
            continue
        tokenizer, target = load_target(Path(path))
        out[name] = {"path": str(path)}
        for d in DOMAINS:
            t0 = time.perf_counter()
            ids = [fmt(tokenizer, s) for s in texts[d]]
            out[name][d] = conditional_evidence(target, ids, args.evidence_tokens, 4, tokenizer.eos_token_id)
            out[name][d]["seconds"] = time.perf_counter() - t0
            print(f"  {name} {d}: {out[name][d]}", flush=True)
        del target
    return out


# ---------------------------------------------------------------------------------------------- merge
#: per-head sections a run on another core can contribute, and the settings each must share
MERGED = {"train": None, "eval": "eval_settings", "eval_seconds": None, "refine": "refine_settings"}


def require_same(results: dict, key: str, value, what: str) -> None:
    """Record `value` under `key`, or refuse (`what`) when `results` already holds other `key` settings:
    one results file never mixes two protocols."""
    if results.setdefault(key, value) != value:
        raise SystemExit(f"error: {what}: {key} {results[key]} differ from {value}")


def describe_heads(results: dict, running: list[str]) -> dict:
    """What each head of this results file is (the heads it holds and the ones this run trains or
    evaluates): the file names its heads, not every head this script knows."""
    held = {h for section in MERGED for h in results.get(section, {})}
    return {h: {"what": HEADS[h][0], "changes": HEADS[h][1]} for h in HEADS if h in held or h in running}


def merge_results(results: dict, others: list[dict]) -> dict:
    """Fold other runs' per-head sections into `results` (one head per core, then one report). A head
    already present is kept; runs evaluated with other settings (prompts, budgets, tokens, width, threads)
    or another base config are refused, so a merged table never mixes two protocols."""
    for other in others:
        if other.get("base_config", results.get("base_config")) != results.get("base_config"):
            raise SystemExit(
                f"error: cannot merge runs of {other['base_config']} into {results['base_config']}"
            )
        for section, settings in MERGED.items():
            if section not in other:
                continue
            if settings and settings in other:
                require_same(results, settings, other[settings], "cannot merge")
            for head, value in other[section].items():
                results.setdefault(section, {}).setdefault(head, value)
        for key in ("prompt_overlap_with_training", "prompt_counts"):
            if key in other:
                results.setdefault(key, other[key])
        results["commands"] = [*results.get("commands", []), *other.get("commands", [])]
    return results


# --------------------------------------------------------------------------------------------- report
def _share(rows, key: str) -> float:
    rounds = sum(r["rounds"] for r in rows)
    return sum(r[key] for r in rows) / rounds if rounds else 0.0


def _survival(rows) -> list[float]:
    """P(round accepts >= k drafts), k = 1..15, pooled over the prompts' rounds."""
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in r["hist"].items()})
    total = sum(hist.values())
    return [
        sum(v for a, v in hist.items() if a - 1 >= d) / total if total else 0.0
        for d in range(1, BLOCK_DEPTHS + 1)
    ]


def cell_stats(rows, n_boot: int) -> dict:
    """tau (mean over prompts) with its prompt-bootstrap interval, per-depth acceptance, faithfulness."""
    taus = [r["tau"] for r in rows]
    surv = _survival(rows)
    cond = [surv[0]] + [surv[d] / surv[d - 1] if surv[d - 1] else 0.0 for d in range(1, len(surv))]

    def share(key):
        def stat(idx):
            den = sum(rows[i]["rounds"] for i in idx)
            return sum(rows[i][key] for i in idx) / den if den else 0.0

        return stat

    return {
        "tau": statistics.fmean(taus),
        "tau_ci95": bootstrap_interval(lambda idx: statistics.fmean(taus[i] for i in idx), len(rows), n_boot),
        "prompts": len(rows),
        "rounds": sum(r["rounds"] for r in rows),
        "accept_ge_k": surv,
        "accept_k_given_k_minus_1": cond,
        "rank1_faithful": _share(rows, "rank1"),
        "rank1_faithful_ci95": bootstrap_interval(share("rank1"), len(rows), n_boot),
        "rank1_mean_depth": _share(rows, "rank1_depth_sum"),
        "rank1_mean_accepted": _share(rows, "rank1_accepted_sum"),
        "greedy_faithful": _share(rows, "greedy"),
        "greedy_faithful_ci95": bootstrap_interval(share("greedy"), len(rows), n_boot),
        "mismatches_vs_ar": sum(not r["same_as_ar"] for r in rows),
    }


def ratio_stats(a_rows, b_rows, n_boot: int) -> dict:
    """tau(a) / tau(b) (means over the same prompts) with a paired prompt-bootstrap interval."""
    a, b = [r["tau"] for r in a_rows], [r["tau"] for r in b_rows]

    def stat(idx):
        return sum(a[i] for i in idx) / sum(b[i] for i in idx)

    lo, hi = bootstrap_interval(stat, len(a), n_boot)
    return {"ratio": sum(a) / sum(b), "ci95": [lo, hi], "excludes_1": lo > 1 or hi < 1}


def _rows(ev: dict, domain: str, budget: str) -> list[dict]:
    """One head's per-prompt records of a domain (or of every domain, "all") at a budget."""
    return [r for d in DOMAINS for r in ev[d][budget]] if domain == "all" else ev[domain][budget]


def _budgets(ev: dict, domain: str) -> list[str]:
    """The budgets a head was decoded at in `domain` ("all": those every domain has)."""
    if domain != "all":
        return list(ev[domain])
    return [b for b in ev["math"] if all(b in ev[d] for d in DOMAINS)]


def report(results: dict, n_boot: int) -> dict:
    """Every statistic from the per-prompt records (rerunnable from the JSON alone)."""
    ev = results["eval"]
    stats = {
        head: {
            d: {b: cell_stats(_rows(ev[head], d, b), n_boot) for b in _budgets(ev[head], d)}
            for d in [*DOMAINS, "all"]
        }
        for head in ev
    }
    ratios: dict = {}
    for pair, (c, d, goal) in PAIRS.items():
        if c not in ev or d not in ev:
            continue
        ratios[pair] = {"causal": c, "bidirectional": d, "goal_at_256": goal}
        for domain in [*DOMAINS, "all"]:
            ratios[pair][domain] = {
                b: ratio_stats(_rows(ev[c], domain, b), _rows(ev[d], domain, b), n_boot)
                for b in _budgets(ev[c], domain)
            }
        ratios[pair]["goal_met_at_256"] = {
            domain: r["256"]["ratio"] >= goal and r["256"]["ci95"][0] > 1
            for domain, r in ratios[pair].items()
            if isinstance(r, dict) and "256" in r
        }
    results["stats"], results["ratios"] = stats, ratios
    results["gamma_ratios"] = {
        attention: {
            "gamma7": g7,
            "gamma0": g0,
            **{
                domain: {
                    b: ratio_stats(_rows(ev[g7], domain, b), _rows(ev[g0], domain, b), n_boot)
                    for b in _budgets(ev[g7], domain)
                    if b in _budgets(ev[g0], domain)
                }
                for domain in [*DOMAINS, "all"]
            },
        }  # fmt: skip
        for attention, (g7, g0) in GAMMA_PAIRS.items()
        if g7 in ev and g0 in ev
    }
    rf = results.get("refine", {})
    if rf:
        results["refine_stats"] = {
            h: {b: cell_stats(rf[h]["math"][b], n_boot) for b in rf[h]["math"]} for h in rf
        }
        results["refine_ratios"] = {
            pair: {b: ratio_stats(rf[c]["math"][b], rf[d]["math"][b], n_boot) for b in rf[c]["math"]}
            for pair, (c, d, _) in PAIRS.items()
            if c in rf and d in rf
        }
        # math, the same prompts in both stages; paired by prompt. "pass": the trained head with the
        # refine pass over the base head without it (what a user gains by switching both on)
        results["path_ratios"] = {
            pair: _path_ratios(rf[trained]["math"], rf.get(base, {}).get("math", {}), ev[trained]["math"],
                               ev[base]["math"], n_boot)
            for pair, (trained, base) in PATH_PAIRS.items()
            if trained in rf and trained in ev and base in ev
        }  # fmt: skip
    return results


def _path_ratios(refined: dict, base_refined: dict, plain: dict, base_plain: dict, n_boot: int) -> dict:
    """The four paired tau ratios of a path pair, per budget the trained head was refined at (the base
    head's own refine run is optional: without it that ratio has no cells)."""
    return {
        name: {b: ratio_stats(a[b], c[b], n_boot) for b in refined if b in a and b in c}
        for name, (a, c) in {
            "pass_vs_base_plain": (refined, base_plain),
            "refine_trained_vs_base": (refined, base_refined),
            "plain_trained_vs_base": (plain, base_plain),
            "refine_vs_plain_trained": (refined, plain),
        }.items()
    }


def _ci(x: float, ci) -> str:
    return f"{x:.2f} [{ci[0]:.2f}-{ci[1]:.2f}]"


def _ratio(r: dict) -> str:
    """A ratio_stats cell: three decimals for the ratio (the goals sit at 1.05 and 1.3), two for its CI."""
    return f"{r['ratio']:.3f} [{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}]"


def tables_md(results: dict) -> str:
    """The markdown tables of docs/BENCHMARKS.md's ablation section, from the JSON alone."""
    st, ra = results["stats"], results["ratios"]
    heads = [h for h in HEADS if h in st]
    lines = []
    for domain in [*DOMAINS, "all"]:
        budgets = list(st[heads[0]][domain])
        lines += [f"**{domain}** ({st[heads[0]][domain][budgets[0]]['prompts']} prompts): tau [95% CI]", ""]
        lines += ["| head | " + " | ".join(f"@{b}" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
        for h in heads:
            cells = [_ci(st[h][domain][b]["tau"], st[h][domain][b]["tau_ci95"]) for b in budgets]
            lines.append(f"| {h} | " + " | ".join(cells) + " |")
        for pair, r in ra.items():
            cells = [_ratio(r[domain][b]) for b in budgets]
            lines.append(
                f"| tau ratio {pair} ({r['causal']} / {r['bidirectional']}) | " + " | ".join(cells) + " |"
            )
        for attention, r in results.get("gamma_ratios", {}).items():
            cells = [_ratio(r[domain][b]) if b in r[domain] else "" for b in budgets]
            lines.append(
                f"| tau ratio gamma 7 / gamma 0, {attention} ({r['gamma7']} / {r['gamma0']}) | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    for key, label in (("rank1_faithful", "Rank-1 branch"), ("greedy_faithful", "Greedy branch")):
        lines += [
            f"{label} faithfulness (share of rounds whose branch the target accepted in full, 95% CI):",
            "",
        ]
        cols = [(d, b) for d in [*DOMAINS] for b in st[heads[0]][d]]
        lines += [
            "| head | " + " | ".join(f"{d} @{b}" for d, b in cols) + " |",
            "|---|" + "---:|" * len(cols),
        ]
        for h in heads:
            lines.append(
                f"| {h} | "
                + " | ".join(_ci(st[h][d][b][key], st[h][d][b][key + "_ci95"]) for d, b in cols)
                + " |"
            )
        lines.append("")
    top = list(st[heads[0]]["math"])[-1]
    for key, label in (
        ("accept_ge_k", "P(round accepts >= k drafts)"),
        ("accept_k_given_k_minus_1", "P(accept depth k | depth k-1 accepted)"),
    ):
        lines += [f"{label}, math, budget {top}:", ""]
        lines += ["| head | " + " | ".join(f"k={k}" for k in range(1, 11)) + " |", "|---|" + "---:|" * 10]
        for h in heads:
            lines.append(f"| {h} | " + " | ".join(f"{x:.2f}" for x in st[h]["math"][top][key][:10]) + " |")
        lines.append("")
    rs = results.get("refine_stats")
    if rs:
        f = results["refine_settings"]["refine_factor"]
        lines += [
            f"Math with branch-conditioned refinement (refine_factor {f}): tau, rank-1 faithfulness [95% CI]:",
            "",
        ]
        lines += [
            "| head | budget | tau (refined) | tau (plain) | rank-1 (refined) |",
            "|---|---:|---:|---:|---:|",
        ]
        for h, cells in rs.items():
            for b, c in cells.items():
                # a head refined but never evaluated plain (merged from a refine-only run) has no plain cell
                plain = st.get(h, {}).get("math", {}).get(b)
                plain_cell = _ci(plain["tau"], plain["tau_ci95"]) if plain else ""
                lines.append(
                    f"| {h} | {b} | {_ci(c['tau'], c['tau_ci95'])} | {plain_cell} | "
                    f"{_ci(c['rank1_faithful'], c['rank1_faithful_ci95'])} |"
                )
        for pair, cells in results["refine_ratios"].items():
            for b, x in cells.items():
                lines.append(f"| ratio {pair} | {b} | {_ratio(x)} | | |")
        lines.append("")
    for pair, pr in results.get("path_ratios", {}).items():
        trained, base = PATH_PAIRS[pair]
        labels = {
            "pass_vs_base_plain": f"{trained} + refine / {base} plain",
            "refine_trained_vs_base": f"{trained} + refine / {base} + refine",
            "plain_trained_vs_base": f"{trained} / {base}, both plain",
            "refine_vs_plain_trained": f"{trained}: + refine / plain",
        }
        budgets = list(pr["pass_vs_base_plain"])
        lines += [f"Training for the refine pass ({pair}), math tau ratios paired by prompt [95% CI]:", ""]
        lines += [
            "| ratio | " + " | ".join(f"@{b}" for b in budgets) + " |",
            "|---|" + "---:|" * len(budgets),
        ]
        for key, label in labels.items():
            cells = [_ratio(pr[key][b]) if b in pr[key] else "" for b in budgets]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    ev = results.get("evidence")
    if ev:
        keys = [
            ("next_token_entropy_nats", "entropy (nats)"),
            ("next_token_top1_prob", "top-1 prob"),
            ("share_top1_prob_over_0.9", "share top-1 > 0.9"),
            ("depth2_m2_argmax_is_greedy", "argmax m2 = target's token"),
            ("depth2_greedy_in_m2_top4", "target's token in top-4 of m2"),
            ("depth2_p_conditional_of_greedy", "p_cond(token)"),
            ("depth2_p_marginal_of_greedy", "m2(token)"),
            ("depth2_topk_coverage", "top-4 depth-1 mass"),
        ]
        cols = [
            (t, d)
            for t in ("toy_small", "smollm2_135m_instruct")
            if "skipped" not in ev.get(t, {"skipped": 1})
            for d in DOMAINS
        ]
        lines += ["", "Target conditionals along its own greedy continuations (16 prompts per domain):", ""]
        lines += ["| | " + " | ".join(f"{t} {d}" for t, d in cols) + " |", "|---|" + "---:|" * len(cols)]
        for k, label in keys:
            lines.append(f"| {label} | " + " | ".join(f"{ev[t][d][k]:.3f}" for t, d in cols) + " |")
    return "\n".join(lines)


def plots(results: dict, out: Path, label: str = "toy", prefix: str = "ablation") -> list[Path]:
    """tau vs budget per head (95% CI bars) per domain, the training curves, and per-depth acceptance with
    rank-1 faithfulness on math; titles name the world (`label`), files are `<prefix>_*.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    style = {"causal_g0": ("tab:blue", "-"), "bidir_g0": ("tab:orange", "-"),
             "causal_g7": ("tab:blue", "--"), "bidir_g7": ("tab:orange", "--"),
             "causal_g0_path": ("tab:green", "-"), "causal_g7_path": ("tab:green", "--")}  # fmt: skip
    st = results["stats"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, domain in zip(axes, [*DOMAINS, "all"], strict=True):
        for h in (h for h in HEADS if h in st):
            bs = [int(b) for b in st[h][domain]]
            tau = [st[h][domain][str(b)]["tau"] for b in bs]
            lo = [t - st[h][domain][str(b)]["tau_ci95"][0] for t, b in zip(tau, bs, strict=True)]
            hi = [st[h][domain][str(b)]["tau_ci95"][1] - t for t, b in zip(tau, bs, strict=True)]
            c, ls = style[h]
            ax.errorbar(bs, tau, yerr=[lo, hi], color=c, ls=ls, marker="o", capsize=3, label=h)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="draft budget", ylabel="tau", title=f"{label} {domain}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        "causal vs bidirectional heads (2 layers, same data/seed/steps), 95% prompt-bootstrap CI", fontsize=9
    )
    fig.tight_layout()
    p1 = out / f"{prefix}_tau_vs_budget.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for h, info in results.get("train", {}).items():
        c, ls = style[h]
        val = info["curves"]["val"]
        for ax, key in zip(axes, ("val/loss", "val/sim_tau", "val/tau@64"), strict=True):
            pts = [(r["step"], r[key]) for r in val if key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=c, ls=ls, marker=".", label=h)
    for ax, key in zip(axes, ("val/loss", "val/sim_tau", "val/tau@64 (held-out math)"), strict=True):
        ax.set(xlabel="optimizer step", ylabel=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = out / f"{prefix}_training_curves.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for h in (h for h in HEADS if h in st):
        c, ls = style[h]
        math_cells = st[h]["math"]
        top = list(math_cells)[-1]
        surv = math_cells[top]["accept_ge_k"]
        axes[0].plot(range(1, len(surv) + 1), surv, color=c, ls=ls, marker="o", label=h)
        bs = [int(b) for b in math_cells]
        f = [math_cells[str(b)]["rank1_faithful"] for b in bs]
        err = [
            [x - math_cells[str(b)]["rank1_faithful_ci95"][0] for x, b in zip(f, bs, strict=True)],
            [math_cells[str(b)]["rank1_faithful_ci95"][1] - x for x, b in zip(f, bs, strict=True)],
        ]
        axes[1].errorbar(bs, f, yerr=err, color=c, ls=ls, marker="o", capsize=3, label=h)
    axes[0].set(xlabel="draft depth k", ylabel="P(round accepts >= k drafts)", ylim=(0, 1))
    axes[0].set_title(f"{label} math, budget {top}", fontsize=9)
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel="draft budget", ylabel="rank-1 branch accepted in full", ylim=(0, 1))
    axes[1].set_title(f"{label} math: rank-1 branch faithfulness (95% CI)", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    p3 = out / f"{prefix}_depth_faithfulness.png"
    fig.savefig(p3, dpi=110)
    plt.close(fig)
    return [p1, p2, p3]


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["train", "eval", "evidence", "refine", "merge", "report", "all"])
    p.add_argument("--base", type=Path, default=REPO / "configs/distill/toy_ablation.yaml")
    p.add_argument(
        "--heads",
        nargs="+",
        default=PAIR_HEADS,
        choices=list(HEADS),
        help="default: the causal/bidirectional pairs; the path heads are opt-in (a path head is compared with "
        "its base, so it is trained after it)",
    )
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--tau-every", type=int, default=200, help="val/tau curve every N steps")
    p.add_argument(
        "--fit-timeout",
        type=float,
        default=6 * 3600,
        help="seconds per training run: a guard against a hung fit, not a budget (a SmolLM2 path head "
        "takes ~75 min on one loaded core; a 1 h limit killed one at step ~1950 of 2400)",
    )
    p.add_argument("--root", type=Path, default=REPO / "runs/ablation")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256], help="math budgets")
    p.add_argument(
        "--side-budgets", type=int, nargs="+", default=[16, 256], help="code and prose budgets (cost)"
    )
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--n-prompts", type=int, default=40, help="held-out prompts per domain")
    p.add_argument("--math-first", type=int, default=20, help="first math prompt (0-19 feed val/tau)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="math")
    p.add_argument("--side-max-new-tokens", type=int, default=32, help="code and prose")
    p.add_argument("--evidence-tokens", type=int, default=48)
    p.add_argument("--refine-budgets", type=int, nargs="+", default=[16, 64, 256], help="refine stage (math)")
    p.add_argument("--refine-factor", type=int, default=2, help="refine stage: candidates per kept node")
    p.add_argument("--real-target", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plots", type=Path, default=None, help="write the figures here (e.g. docs/figures)")
    p.add_argument("--label", default="toy", help="the world, in figure titles (e.g. SmolLM2)")
    p.add_argument("--figure-prefix", default="ablation", help="figure files: <prefix>_*.png")
    p.add_argument("--tables", action="store_true", help="print the markdown tables")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/ablation_toy.json")
    p.add_argument(
        "--merge-from", type=Path, nargs="+", default=[], help="merge: results of runs on other cores"
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    base = yaml.safe_load(args.base.read_text())
    args.target = base["model"]["init_args"]["target_path"]
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.setdefault("commands", []).append(
        " ".join(["python", "-m", "bench.ablation", *(argv if argv is not None else sys.argv[1:])])
    )
    results["base_config"] = str(args.base.relative_to(REPO) if args.base.is_absolute() else args.base)
    stages = ["train", "eval", "evidence", "refine", "report"] if args.stage == "all" else [args.stage]
    results["heads"] = describe_heads(
        results, args.heads if {"train", "eval", "refine"} & set(stages) else []
    )

    if "train" in stages:
        results.setdefault("train", {})
        for h in args.heads:
            cfg = run_config(base, h, args.root, args.steps, args.tau_every)
            info = train(h, cfg, args.root, args.fit_timeout)
            results["train"][h] = {"steps": args.steps, **info, "curves": training_curves(args.root / h)}
            write_json(args.out, results, indent=None)

    if "eval" in stages:
        from jetflow_pl.checkpoints import load_draft_head
        from jetflow_pl.runtime.loader import load_backend

        plan = {d: {"budgets": args.budgets if d == "math" else args.side_budgets,
                    "max_new_tokens": args.max_new_tokens if d == "math" else args.side_max_new_tokens}
                for d in DOMAINS}  # fmt: skip
        settings = {"per_domain": plan, "width": args.width, "n_prompts": args.n_prompts,
                    "math_first": args.math_first, "threads": args.threads}  # fmt: skip
        require_same(results, "eval_settings", settings, f"{args.out} was evaluated with other settings")
        results.setdefault("eval", {})
        tokenizer, target = load_target(Path(args.target))
        eos = tokenizer.eos_token_id
        prompts = eval_prompts(tokenizer, args.n_prompts, args.math_first)
        if "prompt_overlap_with_training" not in results:
            from data_gen.toy.splits import heldout_prompts

            texts = {
                d: [
                    r["prompt"]
                    for r in heldout_prompts(d, args.n_prompts + (args.math_first if d == "math" else 0))
                ]
                for d in DOMAINS
            }
            texts["math"] = texts["math"][args.math_first :]
            results["prompt_overlap_with_training"] = check_disjoint(texts, training_prompt_texts(base))
            results["prompt_counts"] = {d: len(v) for d, v in prompts.items()}
            print(f"  prompts {results['prompt_counts']}, overlap with training "
                  f"{results['prompt_overlap_with_training']}", flush=True)  # fmt: skip
        ar_tokens = ar_reference(load_backend("torch", target=target), prompts, plan, eos)
        for h in args.heads:
            if h in results["eval"]:
                print(f"{h}: evaluated, skipped", flush=True)
                continue
            head_dir = args.root / h / "head" / "last"
            print(f"{h}: evaluating {head_dir}", flush=True)
            t0 = time.perf_counter()
            backend = load_backend("torch", target=target, head=load_draft_head(head_dir))
            results["eval"][h] = decode_head(backend, prompts, plan, args.width, eos, ar_tokens)
            results.setdefault("eval_seconds", {})[h] = time.perf_counter() - t0
            write_json(args.out, results, indent=None)

    if "refine" in stages:
        # branch-conditioned refinement (docs/DESIGN.md section 4, step 3): the only place where a head sees
        # its own drafted tokens, so the only place where causal in-block attention can condition a depth
        # on the branch above it
        from jetflow_pl.checkpoints import load_draft_head
        from jetflow_pl.runtime.loader import load_backend

        plan = {"math": {"budgets": args.refine_budgets, "max_new_tokens": args.max_new_tokens}}
        settings = {**plan, "refine_factor": args.refine_factor, "width": args.width,
                    "n_prompts": args.n_prompts, "math_first": args.math_first}  # fmt: skip
        require_same(results, "refine_settings", settings, f"{args.out} was refined with other settings")
        tokenizer, target = load_target(Path(args.target))
        eos = tokenizer.eos_token_id
        prompts = {"math": domain_prompts(tokenizer, "math", args.n_prompts, args.math_first)}
        ar_tokens = ar_reference(load_backend("torch", target=target), prompts, plan, eos)
        results.setdefault("refine", {})
        for h in args.heads:
            if h in results["refine"]:
                continue
            print(f"{h}: refine x{args.refine_factor}", flush=True)
            backend = load_backend(
                "torch", target=target, head=load_draft_head(args.root / h / "head" / "last")
            )
            results["refine"][h] = decode_head(
                backend, prompts, plan, args.width, eos, ar_tokens, refine_factor=args.refine_factor
            )
            write_json(args.out, results, indent=None)

    if "merge" in stages:
        merge_results(results, [json.loads(f.read_text()) for f in args.merge_from])
        results["heads"] = describe_heads(results, [])
        write_json(args.out, results, indent=None)

    if "evidence" in stages and "evidence" not in results:
        results["evidence"] = evidence(args)
        write_json(args.out, results, indent=None)

    if "report" in stages and results.get("eval"):
        report(results, args.bootstrap)
        write_json(args.out, results, indent=None)
        if args.plots:
            print("wrote", *plots(results, args.plots, args.label, args.figure_prefix))
        if args.tables:
            print(tables_md(results))
    return results


if __name__ == "__main__":
    main()
