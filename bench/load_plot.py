"""One figure for a load sweep: throughput and request latency against concurrency, one line per config.

Shared by `bench/batching.py` (the engine in-process) and `bench/serve_load.py` (through HTTP), so both
sweeps read the same way. Needs matplotlib; without it the benches still write their JSON and say so.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def budget_label(budget: str) -> str:
    return "AR (budget 0)" if budget == "0" else f"budget {budget}"


def plot_load(
    series: Mapping[str, Sequence[Mapping[str, float]]], xlabel: str, title: str, out: Path
) -> Path | None:
    """`series`: label -> points with `x`, `tokens_per_s`, `latency_p50_s` and optionally `latency_p99_s`.
    Writes `out` (PNG) and returns it, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    with_p99 = False
    for label, points in series.items():
        x = [p["x"] for p in points]
        ax_t.plot(x, [p["tokens_per_s"] for p in points], marker="o", label=label)
        (line,) = ax_l.plot(x, [p["latency_p50_s"] for p in points], marker="o", label=f"{label} p50")
        if all("latency_p99_s" in p for p in points):
            with_p99 = True
            ax_l.plot(x, [p["latency_p99_s"] for p in points], marker="x", ls="--", color=line.get_color())
    for ax in (ax_t, ax_l):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("completion tokens / s")
    ax_t.legend(fontsize=8)
    ax_l.set_ylabel("request latency, s" + (" (p50 solid, p99 dashed)" if with_p99 else " (p50)"))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
