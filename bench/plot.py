"""Figures and markdown tables from a `bench/run_all.py` results JSON alone (no model is loaded).

    python -m bench.plot bench/results/suite.json --out docs/figures [--tables]

Figures (PNG, matplotlib Agg): tau vs budget per head type (toy math bold, code/prose thin; the
out-of-corpus code set in a second panel), speedup vs budget per head type (vs the own AR loop and vs HF
`generate()`, median with min/max bars, the CPU ceiling marked), the verify cost t(N)/t(1), and the
per-depth acceptance at the largest budget. `--tables` prints the markdown tables of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"causal": "tab:blue", "bidirectional": "tab:orange", "chain": "tab:green"}
DOMAIN_STYLE = {"math": ("-", 2.4, "o"), "code": ("--", 1.0, "."), "prose": (":", 1.0, ".")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _budgets(rows: dict) -> list[int]:
    return sorted(int(b) for b in rows)


def _title(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    return (
        f"toy target, width {s['width']}, {s['max_new_tokens']} new tokens, {m['threads']} thread(s) on "
        f"{m['cpu_model']} ({s['repeats']} repeats)"
    )


def plot_tau(results: dict, out: Path) -> Path:
    """tau vs budget: panel 1 the toy domains (math bold), panel 2 the out-of-corpus code prompts."""
    plt = _plt()
    ood = results.get("heldout", {}).get("code_ood")
    fig, axes = plt.subplots(1, 2 if ood else 1, figsize=(11 if ood else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    for domain, (ls, lw, mk) in DOMAIN_STYLE.items():
        for head, rows in results["decode"][domain]["heads"].items():
            bs = _budgets(rows)
            ax.plot(
                bs,
                [rows[str(b)]["tau"] for b in bs],
                ls=ls,
                lw=lw,
                marker=mk,
                color=COLORS.get(head),
                label=f"{head} ({domain})",
            )
    ax.set(xlabel="draft budget (tree nodes - 1)", ylabel="tau (tokens / verify)")
    ax.set_title("toy held-out prompts (math bold, code dashed, prose dotted)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    if ood:
        ax2 = axes[0][1]
        for head, rows in ood["heads"].items():
            bs = _budgets(rows)
            ax2.plot(bs, [rows[str(b)]["tau"] for b in bs], marker="o", color=COLORS.get(head), label=head)
        ax2.set(xlabel="draft budget", ylabel="tau")
        ax2.set_title("out-of-corpus code (stdlib packages never in training)", fontsize=9)
        ax2.legend(fontsize=8)
    for a in axes[0]:
        _budget_axis(a, _budgets(results["decode"]["math"]["heads"]["causal"]))
        a.set_ylim(bottom=0.9)
        a.grid(alpha=0.3)
    fig.suptitle(_title(results), fontsize=8)
    fig.tight_layout()
    return _save(fig, out / "tau_vs_budget.png")


def plot_speedup(results: dict, out: Path) -> Path:
    """Speedup vs budget on toy math, vs the own AR loop (with the CPU ceiling) and vs HF generate()."""
    plt = _plt()
    math = results["decode"]["math"]
    keys = [("speedup_vs_ar", "vs own AR loop")]
    if "hf_generate" in math:
        keys.append(("speedup_vs_hf", "vs HF generate() greedy"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        for head, rows in math["heads"].items():
            bs = _budgets(rows)
            med = [rows[str(b)][key]["median"] for b in bs]
            lo = [m - rows[str(b)][key]["min"] for m, b in zip(med, bs, strict=True)]
            hi = [rows[str(b)][key]["max"] - m for m, b in zip(med, bs, strict=True)]
            ax.errorbar(bs, med, yerr=[lo, hi], marker="o", capsize=3, color=COLORS.get(head), label=head)
        if key == "speedup_vs_ar":
            for head, color in COLORS.items():
                pts = [
                    (int(b), c[head]["ceiling_vs_ar"])
                    for b, c in results.get("ceiling", {}).items()
                    if head in c
                ]
                if pts:
                    ax.plot(*zip(*sorted(pts), strict=True), ls="none", marker="x", ms=9, color=color,
                            label=f"{head}: ceiling tau/(t(N)/t(1)+draft)")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="draft budget", ylabel="decode speedup (tokens/s ratio)")
        _budget_axis(ax, _budgets(math["heads"]["causal"]))
        ax.set_title(f"toy math, {label}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(results), fontsize=8)
    fig.tight_layout()
    return _save(fig, out / "speedup_vs_budget.png")


def plot_verify_cost(results: dict, out: Path) -> Path:
    """t(N)/t(1) of the target verify forward, with the draft step's cost in the same units."""
    plt = _plt()
    vc = results["verify_cost"]
    ns = sorted(int(n) for n in vc["ratio"])
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for key, label, color in (
        ("ratio", "verify t(N)/t(1)", "tab:red"),
        ("draft_ratio", "draft t/t(1)", "tab:purple"),
    ):
        med = [vc[key][str(n)]["median"] for n in ns]
        lo = [m - vc[key][str(n)]["min"] for m, n in zip(med, ns, strict=True)]
        hi = [vc[key][str(n)]["max"] - m for m, n in zip(med, ns, strict=True)]
        ax.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, color=color, label=label)
    ax.set(xlabel="tree nodes N (log scale)", ylabel="cost / t(1)", ylim=(0, None))
    _budget_axis(ax, ns)
    ax.set_title(f"target verify cost (t(1) = {vc['verify_ms']['1']['median']:.2f} ms)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=7)
    fig.tight_layout()
    return _save(fig, out / "verify_cost.png")


def acceptance_by_depth(hist: dict[str, int]) -> list[float]:
    """P(a round accepts >= k drafts), k = 1.. from an accept-length histogram (length = drafts + 1)."""
    total = sum(hist.values())
    top = max(int(k) for k in hist)
    return [sum(v for k, v in hist.items() if int(k) - 1 >= d) / total for d in range(1, top)]


def plot_acceptance(results: dict, out: Path) -> Path:
    """Per-depth acceptance at the largest budget on toy math: where one head keeps more drafts."""
    plt = _plt()
    heads = results["decode"]["math"]["heads"]
    b = str(max(_budgets(heads["causal"])))
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for head, rows in heads.items():
        surv = acceptance_by_depth(rows[b]["accept_histogram"])
        ax.plot(range(1, len(surv) + 1), surv, marker="o", color=COLORS.get(head), label=f"{head}")
    ax.set(xlabel="draft depth k", ylabel="P(round accepts >= k drafts)", ylim=(0, 1))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"toy math, budget {b}: acceptance by depth", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out / "acceptance_by_depth.png")


def make_all(results: dict, out: Path) -> list[Path]:
    """Every figure into `out` (created); returns the written paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_tau(results, out), plot_speedup(results, out), plot_verify_cost(results, out),
            plot_acceptance(results, out)]  # fmt: skip


def _budget_axis(ax, ticks: list[int]) -> None:
    """Log-scale x with the measured values as plain tick labels (no 6x10^0 minor labels)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FixedFormatter([str(t) for t in ticks]))
    ax.xaxis.set_minor_locator(NullLocator())


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


# ----------------------------------------------------------------------------------------- tables
def _m(x: dict, fmt: str = "{:.0f}") -> str:
    """Median with [min-max] of a spread dict."""
    return f"{fmt.format(x['median'])} [{fmt.format(x['min'])}-{fmt.format(x['max'])}]"


def best_budget(rows: dict) -> str:
    """The budget with the highest median speedup over the own AR loop.

    Chosen on the paired ratio (AR and the head decode each prompt back to back in the same repeat),
    not on raw tokens/s, whose median moves with the machine's load from one repeat to the next."""
    return max(rows, key=lambda b: rows[b]["speedup_vs_ar"]["median"])


def readme_table(results: dict) -> str:
    math = results["decode"]["math"]
    bs = _budgets(math["heads"]["causal"])
    hf = math.get("hf_generate")
    lines = [
        "| toy math | "
        + " | ".join(f"tau @{b}" for b in bs)
        + " | best budget | tok/s | vs own AR | vs HF generate |",
        "|---|" + "---:|" * (len(bs) + 4),
    ]
    for head, rows in math["heads"].items():
        bb = best_budget(rows)
        r = rows[bb]
        vs_hf = _m(r["speedup_vs_hf"], "{:.2f}") if "speedup_vs_hf" in r else "-"
        lines.append(
            f"| {head} | " + " | ".join(f"{rows[str(b)]['tau']:.2f}" for b in bs)
            + f" | {bb} | {_m(r['decode_tokens_per_s'])} | {_m(r['speedup_vs_ar'], '{:.2f}')} | {vs_hf} |"
        )  # fmt: skip
    ar = _m(math["ar"]["decode_tokens_per_s"])
    hf_s = _m(hf["decode_tokens_per_s"]) if hf else "not measured"
    lines.append("")
    lines.append(f"Baselines (tok/s, median [min-max]): own AR loop {ar}; HF `generate()` greedy {hf_s}.")
    return "\n".join(lines)


def domain_table(block: dict) -> str:
    bs = _budgets(block["heads"]["causal"])
    lines = ["| head | " + " | ".join(f"@{b}: tau / tok/s" for b in bs) + " |", "|---|" + "---:|" * len(bs)]
    for head, rows in block["heads"].items():
        cells = [
            f"{rows[str(b)]['tau']:.2f} / {rows[str(b)]['decode_tokens_per_s']['median']:.0f}" for b in bs
        ]
        lines.append(f"| {head} | " + " | ".join(cells) + " |")
    ar = block["ar"]["decode_tokens_per_s"]["median"]
    hf = block.get("hf_generate", {}).get("decode_tokens_per_s", {}).get("median")
    lines.append(
        f"| AR (own loop / HF generate) | {ar:.0f} / {hf:.0f} tok/s |" if hf else f"| AR | {ar:.0f} |"
    )
    return "\n".join(lines)


def verify_table(results: dict) -> str:
    vc = results["verify_cost"]
    ns = sorted(int(n) for n in vc["ratio"])
    lines = ["| N (tree nodes) | " + " | ".join(map(str, ns)) + " |", "|---|" + "---:|" * len(ns)]
    lines.append("| verify ms | " + " | ".join(_m(vc["verify_ms"][str(n)], "{:.2f}") for n in ns) + " |")
    lines.append("| t(N)/t(1) | " + " | ".join(_m(vc["ratio"][str(n)], "{:.2f}") for n in ns) + " |")
    lines.append("| draft t/t(1) | " + " | ".join(_m(vc["draft_ratio"][str(n)], "{:.2f}") for n in ns) + " |")
    return "\n".join(lines)


def ceiling_md(results: dict) -> str:
    lines = [
        "| budget | head | tau | t(N)/t(1) | draft/t(1) | ceiling vs AR | measured vs AR |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for b, heads in sorted(results.get("ceiling", {}).items(), key=lambda kv: int(kv[0])):
        for head, c in heads.items():
            lines.append(
                f"| {b} | {head} | {c['tau']:.2f} | {c['verify_ratio']:.2f} | {c['draft_ratio']:.2f} | "
                f"{c['ceiling_vs_ar']:.2f} | {c['measured_vs_ar']:.2f} |"
            )
    return "\n".join(lines)


def ort_md(results: dict) -> str:
    o = results.get("ort", {})
    if "skipped" in o:
        return f"ONNX Runtime: skipped ({o['skipped']})."
    lines = [
        "| ONNX Runtime (portable graphs) | tau (torch tau) | tok/s ORT | tok/s torch | mismatches vs torch AR |",
        "|---|---:|---:|---:|---:|",
    ]
    ar = o["ar"]
    torch_ar = results["decode"]["math"]["ar"]["decode_tokens_per_s"]["median"]
    lines.append(
        f"| AR | 1.00 | {_m(ar['decode_tokens_per_s'])} | {torch_ar:.0f} | {ar['mismatches_vs_torch_ar']} |"
    )
    for b, r in o["speculative"].items():
        tt = f"{r['torch_tau']:.2f}" if r["torch_tau"] is not None else "-"
        ttp = f"{r['torch_decode_tokens_per_s']:.0f}" if r["torch_decode_tokens_per_s"] else "-"
        lines.append(
            f"| budget {b} | {r['tau']:.2f} ({tt}) | {_m(r['decode_tokens_per_s'])} | {ttp} | {r['mismatches_vs_torch_ar']} |"
        )
    if o.get("export_seconds"):
        lines.append(
            f"\nExport of both graphs (once, cached in `{o['engine_dir']}`): {o['export_seconds']:.0f} s."
        )
    return "\n".join(lines)


def throughput_md(results: dict) -> str:
    out = []
    rg = results.get("regenerate", {})
    if "tokens_per_s" in rg:
        cells = ", ".join(f"batch {bs}: {_m(v)}" for bs, v in rg["tokens_per_s"].items())
        out.append(
            f"- Regeneration (`{rg['command']}`), generated tokens/s: {cells}; identical outputs across batch sizes: {rg['outputs_identical_across_batch_sizes']}."
        )
    else:
        out.append(f"- Regeneration: skipped ({rg.get('skipped')}).")
    d = results.get("distill", {})
    if "result" in d:
        out.append(f"- Distillation ({d.get('source')}): {_distill_summary(d['result'])}")
    else:
        out.append(f"- Distillation: skipped ({d.get('skipped')}).")
    return "\n".join(out)


def _distill_summary(r: dict) -> str:
    """The headline numbers of `bench/distill.py step` (its JSON layout, read defensively: the script has
    another owner and may change; anything missing reads as 'see the JSON')."""
    try:
        st = r["step_time"]
        b = st["batch"]
        step = st["distill_step_s"]["median"]
        tokens = b["rows"] * b["seq_len"]
        text = (
            f"one distillation step on {b['rows']} x {b['seq_len']} tokens ({b['valid_blocks']} blocks of "
            f"{b['block_size']}) takes {step:.2f} s median = {tokens / step:.0f} training tokens/s, "
            f"{st['distill_step_over_target_forward']:.1f}x the target forward alone "
            f"({st['target_forward_s']['median']:.2f} s)"
        )
    except (KeyError, TypeError, ZeroDivisionError):
        return "see the JSON"
    try:
        runs = r["loss_memory"]["runs"]
        mem = ", ".join(
            f"{x['impl']}{'' if x['chunk_size'] is None else ' ' + str(x['chunk_size'])}: "
            f"{x['loss_step_peak_delta_mib']:.0f} MiB"
            for x in runs
        )
        text += f"; loss-step peak memory at vocab {r['loss_memory']['vocab']}: {mem}"
    except (KeyError, TypeError):
        pass
    return text + "."


def ratio_interval(hist_a: dict[str, int], hist_b: dict[str, int], n: int = 2000) -> tuple[float, float]:
    """Approximate 95% interval of pooled-tau(a) / pooled-tau(b), resampling rounds (seeded bootstrap).

    Rounds of one prompt are not independent, so this understates the uncertainty somewhat; it is a
    guide to whether a ratio is resolved by the prompt set at all, not a significance test."""
    import random

    rng = random.Random(0)
    xa = [int(k) for k, v in hist_a.items() for _ in range(v)]
    xb = [int(k) for k, v in hist_b.items() for _ in range(v)]
    ratios = sorted(
        (sum(rng.choices(xa, k=len(xa))) / len(xa)) / (sum(rng.choices(xb, k=len(xb))) / len(xb))
        for _ in range(n)
    )
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def causal_vs_bidir_md(results: dict, domain: str = "math") -> str:
    """tau(causal) / tau(bidirectional) per budget, and acceptance by depth at the largest budget."""
    heads = results["decode"][domain]["heads"]
    if "bidirectional" not in heads:
        return f"causal vs bidirectional: no bidirectional head ({results.get('skipped', {}).get('bidirectional')})"
    c, d = heads["causal"], heads["bidirectional"]
    bs = _budgets(c)
    lines = ["| toy " + domain + " | " + " | ".join(f"@{b}" for b in bs) + " |", "|---|" + "---:|" * len(bs)]
    lines.append("| tau causal | " + " | ".join(f"{c[str(b)]['tau']:.2f}" for b in bs) + " |")
    lines.append("| tau bidirectional | " + " | ".join(f"{d[str(b)]['tau']:.2f}" for b in bs) + " |")
    lines.append("| ratio | " + " | ".join(f"{c[str(b)]['tau'] / d[str(b)]['tau']:.3f}" for b in bs) + " |")
    top = str(bs[-1])
    lo, hi = ratio_interval(c[top]["accept_histogram"], d[top]["accept_histogram"])
    sc = acceptance_by_depth(c[top]["accept_histogram"])
    sd = acceptance_by_depth(d[top]["accept_histogram"])
    k = max(len(sc), len(sd))
    sc, sd = sc + [0.0] * (k - len(sc)), sd + [0.0] * (k - len(sd))
    lines += ["", f"Pooled-tau ratio at budget {top}: approximate 95% interval {lo:.2f}-{hi:.2f} "
              f"(rounds resampled: {c[top]['rounds']} causal, {d[top]['rounds']} bidirectional).", "",
              f"| P(round accepts >= k drafts), budget {top} | " + " | ".join(f"k={i}" for i in range(1, k + 1)) + " |",
              "|---|" + "---:|" * k,
              "| causal | " + " | ".join(f"{x:.2f}" for x in sc) + " |",
              "| bidirectional | " + " | ".join(f"{x:.2f}" for x in sd) + " |"]  # fmt: skip
    tc = results["heads"]["causal"].get("training")
    tb = results["heads"]["bidirectional"].get("training")
    if tc and tb:
        n = min(len(tc["val_agree_by_depth"]), len(tb["val_agree_by_depth"]))
        lines += ["", "| training validation (last eval) | " + " | ".join(f"d{i}" for i in range(1, n + 1))
                  + " | val loss | sim. tau | real tau @64 |", "|---|" + "---:|" * (n + 3)]  # fmt: skip
        for name, t in (("causal top-1 agreement", tc), ("bidirectional top-1 agreement", tb)):
            cells = " | ".join(f"{x:.2f}" for x in t["val_agree_by_depth"][:n])
            lines.append(
                f"| {name} | {cells} | {t['val_loss']:.3f} | {t['val_sim_tau']:.2f} | {t['val_tau']:.2f} |"
            )
    return "\n".join(lines)


def tables(results: dict) -> str:
    md = ["## README table", "", readme_table(results), "", "### causal vs bidirectional", "",
          causal_vs_bidir_md(results), ""]  # fmt: skip
    for d in ("math", "code", "prose"):
        md += [f"### {d}", "", domain_table(results["decode"][d]), ""]
    if "heldout" in results:
        md += ["### out-of-corpus code", "", domain_table(results["heldout"]["code_ood"]), ""]
    md += ["### verify cost", "", verify_table(results), "", ceiling_md(results), "", ort_md(results), "",
           throughput_md(results)]  # fmt: skip
    return "\n".join(md)


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="?", default=Path("bench/results/suite.json"))
    p.add_argument("--out", type=Path, default=Path("docs/figures"))
    p.add_argument("--tables", action="store_true", help="print the markdown tables")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    paths = make_all(results, args.out)
    for f in paths:
        print(f"wrote {f}")
    if args.tables:
        print(tables(results))
    return paths


if __name__ == "__main__":
    main()
