"""How long a user's first `generate --budget auto` takes on a machine with no cost profile yet.

Each pass runs three `python -m jetflow_pl generate` commands against one fresh cost-profile cache and
times each end to end (model loading, any measurement, the answer):

1. `first`: no profile on disk, so a quick one-pass profile is measured before the answer;
2. `cached`: the same command again, the profile read from the cache (the floor: loading + answer);
3. `measure_costs`: `--measure-costs`, the full profile measured now (what every first call cost
   before the quick profile existed).

A pass runs idle and again with `--load N` busy-looping processes beside it (a shared machine). The
measurement's own seconds are read from the profile files (`measure_seconds`).

    python -m bench.first_call --target models/SmolLM2-135M-Instruct --head heads/smollm2-135m-instruct \\
        --repeats 2 --load 2 --out bench/results/first_call_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jetflow_pl.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
PROMPT = "What is 7 times 8? Answer briefly."
RUNS = ("first", "cached", "measure_costs")


def _busy() -> None:
    while True:
        pass


def one_pass(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The three commands against one fresh cache: wall seconds and the profile's measuring seconds."""
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JETFLOW_PL_CACHE_DIR": cache}
        for run in RUNS:
            cmd = [sys.executable, "-m", "jetflow_pl", "generate", "--target", str(args.target)]
            cmd += [
                "--head",
                str(args.head),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                str(args.max_new_tokens),
            ]
            cmd += ["--threads", str(args.threads)] + (["--measure-costs"] if run == "measure_costs" else [])
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"{run} failed:\n{proc.stderr[-2000:]}")
            (profile,) = Path(cache, "cost_profiles").glob("*.json")
            data = json.loads(profile.read_text())
            measured = "measured now" in proc.stderr or "re-measured" in proc.stderr
            out[run] = {
                "wall_s": wall,
                "measure_s": float(data["measure_seconds"]) if measured else 0.0,
                "profile_repeats": int(data["repeats"]),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--head", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="passes per condition")
    p.add_argument("--load", type=int, default=2, help="busy processes beside the loaded passes (0: none)")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/first_call.json")
    args = p.parse_args(argv)
    conditions = {"idle": 0, **({f"load_{args.load}": args.load} if args.load else {})}
    passes: dict[str, list[dict]] = {name: [] for name in conditions}
    for rep in range(args.repeats):
        for name, busy in conditions.items():
            workers = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(busy)]
            for w in workers:
                w.start()
            try:
                passes[name].append(one_pass(args))
            finally:
                for w in workers:
                    w.terminate()
            row = passes[name][-1]
            print(
                f"{name} pass {rep + 1}: " + ", ".join(f"{r} {row[r]['wall_s']:.1f}s" for r in RUNS),
                flush=True,
            )
    summary = {
        name: {
            run: {key: statistics.median(ps[run][key] for ps in rows) for key in ("wall_s", "measure_s")}
            for run in RUNS
        }
        for name, rows in passes.items()
    }
    report = {
        "command": "python -m bench.first_call " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "target": str(args.target),
        "head": str(args.head),
        "threads": args.threads,
        "passes": passes,
        "median": summary,
    }
    atomic_write_json(args.out, report)
    for name, runs in summary.items():
        print(
            f"{name} (median of {args.repeats}): "
            + ", ".join(f"{r} {v['wall_s']:.1f}s (measuring {v['measure_s']:.1f}s)" for r, v in runs.items())
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
