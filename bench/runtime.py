"""Runtime benchmark: decode tokens/s of the ONNX Runtime backend vs the torch backend vs AR, same prompts.

    python -m bench.runtime --out bench/results/runtime.json [--engine-dir DIR] [--variant portable]
                            [--backends torch onnxruntime tensorrt]

Without `--engine-dir` the shipped toy head + target are exported once into `runs/engines/<variant>`
(reused when present). Per backend: AR (budget 0, same loop) and speculative decoding at each budget;
tau, pooled decode tokens/s and speedup vs that backend's own AR, plus the token check against the first
backend's AR (torch by default; the field keeps its name `token_mismatches_vs_torch_ar`). Backends come
from `jetflow_pl.runtime.load_backend`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench.decode import domain_prompts, load_target, mean_tau, run_prompts, tokens_per_s
from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.runtime.loader import BACKEND_KINDS, ENGINE_KINDS, load_backend

REPO = Path(__file__).resolve().parents[1]


def ensure_engine(engine_dir: Path | None, variant: str) -> Path:
    """The engine dir to benchmark: the given one, or the shipped pair exported once into runs/engines."""
    if engine_dir is not None:
        return engine_dir
    from export.onnx_export import ExportSettings, export_engine

    cached = REPO / "runs" / "engines" / variant
    if not (cached / "config.json").is_file():
        export_engine(
            ExportSettings(head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=cached, variant=variant)
        )
    return cached


def measure(backend, prompts, budgets, width, max_new, eos, reference=None) -> dict:
    ar = run_prompts(ARGenerator(backend, eos_token_id=eos), prompts, max_new)
    ar_tps = tokens_per_s(ar)
    out = {"ar_tokens_per_s": ar_tps, "budgets": {}}
    for budget in budgets:
        runs = run_prompts(SpeculativeGenerator(backend, budget, width, eos_token_id=eos), prompts, max_new)
        tps = tokens_per_s(runs)
        ref = reference if reference is not None else ar
        out["budgets"][str(budget)] = {
            "tau": mean_tau(runs),
            "decode_tokens_per_s": tps,
            "speedup_vs_own_ar": tps / ar_tps if ar_tps else 0.0,
            "token_mismatches_vs_torch_ar": sum(r.tokens != a.tokens for r, a in zip(runs, ref, strict=True)),
        }
    return out, ar


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dir", type=Path, default=None)
    p.add_argument("--variant", choices=["plugin", "portable"], default="portable")
    p.add_argument("--head", type=Path, default=SMALL_HEAD_DIR)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--domain", default="math")
    p.add_argument("--n-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKEND_KINDS,
        default=["torch", "onnxruntime"],
        help="backend kinds to measure; the first one's AR is the token reference",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/runtime.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    needs_engine = any(kind in ENGINE_KINDS for kind in args.backends)
    engine = ensure_engine(args.engine_dir, args.variant) if needs_engine else None
    tokenizer, target = load_target(SMALL_TARGET_DIR)
    head = load_draft_head(args.head).eval()
    prompts = domain_prompts(tokenizer, args.domain, args.n_prompts)
    eos = tokenizer.eos_token_id
    t0 = time.time()
    measured, reference = {}, None
    for kind in args.backends:
        backend = load_backend(
            kind,
            target=target,
            head=head,
            engine_dir=engine,
            intra_op_threads=args.threads,
            topk=max(8, args.width),
        )
        res, ar = measure(backend, prompts, args.budgets, args.width, args.max_new_tokens, eos, reference)
        measured[kind] = res
        reference = ar if reference is None else reference
    result = {
        "command": " ".join(["python", "-m", "bench.runtime", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": args.threads,
        },
        "engine_dir": str(engine) if engine is not None else None,
        "variant": json.loads((engine / "config.json").read_text())["variant"]
        if engine is not None
        else None,
        "domain": args.domain,
        "n_prompts": args.n_prompts,
        "max_new_tokens": args.max_new_tokens,
        **measured,
        "wall_seconds": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name in args.backends:
        r = result[name]
        cells = ", ".join(
            f"b{b}: tau {v['tau']:.2f} {v['decode_tokens_per_s']:.0f} tok/s" for b, v in r["budgets"].items()
        )
        print(f"{name:12s} AR {r['ar_tokens_per_s']:.0f} tok/s | {cells}")
    return result


if __name__ == "__main__":
    main()
