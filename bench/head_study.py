"""The head-training study on the real target: which levers move tau (issue: a real LLM end to end).

    python -m bench.head_study --base configs/distill/smollm2.yaml --steps 400 --out bench/results/head_study_smollm2.json

Every experiment is the committed base config with a few keys changed (`EXPERIMENTS`), trained for the
same number of steps (so a loaded machine slows a run down but does not change its result), on the same
regenerated data and ONE teacher cache (built by the first run with every layer any experiment taps,
`STUDY_TAPS`; each later run reads its own layers from it: the target runs once for the whole study). Each head is then measured with the speculative decoder on held-out
prompts (`bench/decode.py`'s functions: tau at budgets 16 and 64, lossless check against AR) and its
training curve (val agreement / simulated tau per validation) is read from the CSV log.

Runs are resumable: an experiment whose head and evaluation exist is skipped, so the command can be rerun
after a crash or with more experiments.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

#: every layer the experiments tap (the shared teacher cache stores all of them)
STUDY_TAPS = [1, 15, 27, 29]

#: name -> (what it tests, {dotted key: value}); keys are relative to the config root
EXPERIMENTS: dict[str, tuple[str, dict]] = {
    "l1_default": (
        "1 layer, DESIGN default tap [15] (middle layer), random init",
        {
            "model.init_args.num_head_layers": 1,
        },
    ),
    "l2_default": ("2 layers, default taps [1, 27], random init", {}),
    "l2_late_taps": (
        "2 layers, late taps [27, 29], random init",
        {
            "model.init_args.target_layer_ids": [27, 29],
        },
    ),
    "l2_slice": (
        "2 layers copied from target layers 28-29, one tap [27] (fc = I): a slice of the target",
        {
            "model.init_args.target_layer_ids": [27],
            "model.init_args.init_from_target_layers": [28, 29],
        },
    ),
    "l2_slice_taps": (
        "2 layers copied from 28-29, taps [1, 27] (random fc)",
        {
            "model.init_args.init_from_target_layers": [28, 29],
        },
    ),
    "l2_slice_lr3e-3": (
        "l2_slice at lr 3e-3",
        {
            "model.init_args.target_layer_ids": [27],
            "model.init_args.init_from_target_layers": [28, 29],
            "model.init_args.lr": 0.003,
        },
    ),
    "l2_lr3e-3": (
        "2 layers, default taps [1, 27], random init, lr 3e-3",
        {
            "model.init_args.lr": 0.003,
        },
    ),
    "l2_b8": (
        "2 layers, default taps, block_size 8 with 2x the anchors (the same loss rows per step)",
        {
            "model.init_args.block_size": 8,
            "model.init_args.num_anchors": 32,
        },
    ),
    "l2_slice_lr3e-4": (
        "l2_slice at lr 3e-4",
        {
            "model.init_args.target_layer_ids": [27],
            "model.init_args.init_from_target_layers": [28, 29],
            "model.init_args.lr": 0.0003,
        },
    ),
}


def set_dotted(cfg: dict, key: str, value) -> None:
    node = cfg
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


#: every experiment starts from these (the DESIGN defaults: default taps, random init), whatever the base
#: config ships with (the committed SmolLM2 config uses the study's winner, l2_slice)
STUDY_DEFAULTS: dict = {
    "model.init_args.target_layer_ids": None,
    "model.init_args.init_from_target_layers": None,
}


def experiment_config(base: dict, name: str, changes: dict, root: Path, steps: int) -> dict:
    """The base config with `changes`, its outputs under `root/name`, `steps` steps, one final val/tau."""
    cfg = copy.deepcopy(base)
    run = root / name
    for key, value in {**STUDY_DEFAULTS, **changes}.items():
        set_dotted(cfg, key, value)
    t = cfg["trainer"]
    t["max_steps"] = steps
    t["max_time"] = None
    t["default_root_dir"] = str(run)
    t["val_check_interval"] = max(steps // 4, 1)
    t["logger"]["init_args"]["save_dir"] = str(run)
    cfg["model"]["init_args"]["max_minutes"] = None  # the cosine runs over the steps
    for cb in t["callbacks"]:
        args = cb["init_args"]
        if cb["class_path"].endswith("ModelCheckpoint"):
            args["dirpath"] = str(run / "checkpoints")
            args["every_n_train_steps"] = steps
        elif cb["class_path"].endswith("AcceptanceLengthCallback"):
            args["every_n_steps"] = 0  # measured once at the end (and by the evaluation below)
        elif cb["class_path"].endswith("HFHeadExport"):
            args["dirpath"] = str(run / "head")
    # one cache for the whole study: it stores every layer an experiment taps, each head reads its own
    cfg["data"]["init_args"]["teacher_cache"] = str(root / "teacher_cache")
    cfg["data"]["init_args"]["teacher_cache_taps"] = STUDY_TAPS
    return cfg


def training_curve(run: Path) -> list[dict]:
    """The validation rows of the run's CSV log (step, val agreement at depths 1-3, val simulated tau)."""
    rows = []
    for path in sorted(run.glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for r in csv.DictReader(f):
                if r.get("val/sim_tau"):
                    keep = {"step": int(r["step"]), "val_sim_tau": float(r["val/sim_tau"])}
                    for k in ("val/loss", "val/agree_d1", "val/agree_d2", "val/agree_d3", "val/tau"):
                        if r.get(k):
                            keep[k.replace("/", "_")] = float(r[k])
                    rows.append(keep)
    return rows


def evaluate(target_dir: Path, head_dir: Path, budgets, n_prompts: int, max_new: int, domains) -> dict:
    """tau and the lossless check per domain and budget (bench/decode.py's functions)."""
    from bench.decode import domain_prompts, load_target, mean_tau, run_prompts
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.loader import load_backend

    tokenizer, target = load_target(target_dir)
    head = load_draft_head(head_dir)
    eos = tokenizer.eos_token_id
    backend = load_backend("torch", target=target, head=head)
    out = {}
    for domain in domains:
        prompts = domain_prompts(tokenizer, domain, n_prompts)
        ar = run_prompts(ARGenerator(backend, eos), prompts, max_new)
        row = {}
        for b in budgets:
            runs = run_prompts(SpeculativeGenerator(backend, b, 4, eos_token_id=eos), prompts, max_new)
            row[str(b)] = {
                "tau": mean_tau(runs),
                "mismatches_vs_ar": sum(r.tokens != a.tokens for r, a in zip(runs, ar, strict=True)),
            }
        out[domain] = row
        print(f"  {domain}: " + ", ".join(f"tau@{b} {row[str(b)]['tau']:.2f}" for b in budgets), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, default=REPO / "configs/distill/smollm2.yaml")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--only", nargs="*", default=None, help="experiment names (default: all)")
    p.add_argument("--root", type=Path, default=REPO / "runs/head_study")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    p.add_argument("--n-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--domains", nargs="+", default=["math", "code", "prose"])
    p.add_argument("--out", type=Path, default=REPO / "bench/results/head_study_smollm2.json")
    args = p.parse_args(argv)
    base = yaml.safe_load(args.base.read_text())
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"experiments": {}}
    results["command"] = " ".join(
        ["python", "-m", "bench.head_study", *(argv if argv is not None else sys.argv[1:])]
    )
    results["base_config"] = str(args.base)
    results["steps"] = args.steps
    names = args.only or list(EXPERIMENTS)
    for name in names:
        what, changes = EXPERIMENTS[name]
        done = results["experiments"].get(name, {})
        if done.get("eval") and done.get("steps") == args.steps:
            print(f"{name}: done, skipped")
            continue
        run = args.root / name
        cfg = experiment_config(base, name, changes, args.root, args.steps)
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        print(f"{name}: {what}", flush=True)
        t0 = time.perf_counter()
        if not (run / "head" / "last" / "config.json").is_file():
            with (run / "fit.log").open("w") as log:
                subprocess.run(
                    [sys.executable, "-m", "jetflow_pl", "fit", "--config", str(run / "config.yaml")],
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=True,
                )
        fit_s = time.perf_counter() - t0
        head_dir = run / "head" / "last"
        ev = evaluate(
            Path(cfg["model"]["init_args"]["target_path"]),
            head_dir,
            args.budgets,
            args.n_prompts,
            args.max_new_tokens,
            args.domains,
        )
        results["experiments"][name] = {
            "what": what,
            "changes": changes,
            "steps": args.steps,
            "fit_seconds": fit_s,
            "curve": training_curve(run),
            "eval": ev,
            "eval_settings": {
                "budgets": args.budgets,
                "n_prompts": args.n_prompts,
                "max_new_tokens": args.max_new_tokens,
                "width": 4,
            },
        }
        from bench.decode import write_json

        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
