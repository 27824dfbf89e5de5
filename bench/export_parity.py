"""Export parity on a real pair: every output's error against its tolerance, per variant, and greedy decodes.

    python -m bench.export_parity --head HEAD --target models/SmolLM2-135M-Instruct \
        --out bench/results/export_parity_smollm2.json

For each variant (portable, plugin, attention) it runs the exporter (`export/onnx_export.py`, which applies
the parity rule of `export/parity.py` and refuses a failing graph), then reads the measured error and
tolerance of every output from the engine's `config.json`, and decodes held-out prompts greedily through
the exported graphs on ONNX Runtime (speculative, budget 16) and through the torch backend (AR), counting
token mismatches. Prints a markdown table (docs/EXPORT.md carries it).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("portable", "plugin", "attention")


def decode_compare(engine_dir: Path, target_dir: Path, head_dir: Path, n_prompts: int, max_new: int) -> dict:
    """Greedy tokens through the exported graphs (ONNX Runtime, budget 16) vs the torch backend (AR)."""
    from bench.decode import domain_prompts, load_target
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.loader import load_backend

    tokenizer, target = load_target(target_dir)
    head = load_draft_head(head_dir)
    eos = tokenizer.eos_token_id
    ort = SpeculativeGenerator(load_backend("onnxruntime", engine_dir=engine_dir), 16, 4, eos_token_id=eos)
    ref = ARGenerator(load_backend("torch", target=target, head=head), eos)
    prompts = domain_prompts(
        tokenizer, "math", n_prompts, first=20
    )  # the evaluation prompts (bench/decode.py)
    out = {"prompts": len(prompts), "tokens": 0, "mismatching_prompts": 0, "tau": []}
    for p in prompts:
        a, b = ort.generate(p, max_new), ref.generate(p, max_new)
        out["tokens"] += len(b.tokens)
        out["mismatching_prompts"] += int(a.tokens != b.tokens)
        out["tau"].append(a.tau)
    return out


def main(argv: list[str] | None = None) -> dict:
    from export.onnx_export import ExportSettings, export_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", type=Path, required=True)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--n-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    results: dict = {
        "command": " ".join(
            ["python", "-m", "bench.export_parity", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "head": str(args.head),
        "target": str(args.target),
        "variants": {},
    }
    root = Path(tempfile.mkdtemp(prefix="export_parity_"))
    try:
        for variant in args.variants:
            t0 = time.perf_counter()
            engine = export_engine(
                ExportSettings(head=args.head, target=args.target, out=root / variant, variant=variant)
            )
            export_s = time.perf_counter() - t0
            parity = json.loads((engine / "config.json").read_text())["parity"]
            row = {"export_seconds": export_s, "parity": parity}
            row["decode"] = decode_compare(
                engine, args.target, args.head, args.n_prompts, args.max_new_tokens
            )
            results["variants"][variant] = row
            print(f"{variant}: exported in {export_s:.0f}s; decode {row['decode']}", flush=True)
            shutil.rmtree(engine, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from bench.decode import write_json

    write_json(args.out, results)
    print(markdown_table(results))
    return results


def markdown_table(results: dict) -> str:
    """One row per (variant, graph, output): error, tolerance, margin."""
    lines = [
        "| variant | graph | output | error | tolerance | tolerance / error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for variant, row in results["variants"].items():
        for graph, outputs in row["parity"]["graphs"].items():
            for name, c in outputs.items():
                if c["kind"] == "ids":
                    lines.append(f"| {variant} | {graph} | {name} | {c['mismatches']} differ | exact | |")
                else:
                    margin = c["tolerance"] / c["error"] if c["error"] > 0 else float("inf")
                    lines.append(
                        f"| {variant} | {graph} | {name} | {c['error']:.2e} | {c['tolerance']:.2e} | {margin:.0f}x |"
                    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
