"""What the draft's lm_head costs as `h @ W^T` (the nn.Linear call) and as `W @ h^T` (`few_row_logits`).

    python -m bench.draft_gemm --target models/SmolLM2-135M-Instruct --head heads/smollm2-135m-instruct \\
        --threads 1 --out bench/results/draft_logits_gemm.json

Two tables from one run: (1) the lm_head product alone for M = 1..17 and a few batched sizes, both
forms, median of `--repeats` back-to-back calls each, the forms interleaved so load hits both alike; (2)
the whole draft (`backend.draft`) over an AR step, as paired ratios (one AR round, then one draft, milliseconds
apart: what `cost_profile` measures), with the draft's lm_head in each form. Both forms compute the same
product; the check at the end is their largest absolute difference on the same rows.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from jetflow_pl.runtime.loader import load_backend
from jetflow_pl.tree import DraftTree

REPO = Path(__file__).resolve().parents[1]

ROWS = (*range(1, 18), 30, 60, 120, 240)


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn()` in ms over `repeats` calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def gemm_table(target, repeats: int) -> list[dict]:
    hidden_size = int(target.lm_head.weight.shape[1])
    gen = torch.Generator().manual_seed(0)
    out = []
    for m in ROWS:
        h = torch.randn(m, hidden_size, generator=gen, dtype=target.dtype)
        linear = median_ms(lambda h=h: target.lm_logits(h), repeats)
        transposed = median_ms(lambda h=h: target.few_row_logits(h), repeats)
        out.append({"rows": m, "linear_ms": round(linear, 2), "transposed_ms": round(transposed, 2)})
        print(f"rows {m:4d}: h @ W^T {linear:6.1f} ms   W @ h^T {transposed:6.1f} ms", flush=True)
    return out


def draft_ratios(backend, pairs: int, kv_len: int) -> dict[str, float]:
    """Median draft/t(1) with the draft's lm_head in each form (forms alternate between blocks of pairs)."""
    target = backend.target
    gen = torch.Generator().manual_seed(0)
    backend.prefill(torch.randint(100, int(target.vocab_size) - 100, (kv_len,), generator=gen))
    transposed = target.few_row_logits
    forms = {"linear": target.lm_logits, "transposed": transposed}
    ratios: dict[str, list[float]] = {k: [] for k in forms}

    def ar() -> float:
        t0 = time.perf_counter()
        backend.verify(DraftTree.chain([5]))
        backend.commit([0])
        return time.perf_counter() - t0

    try:
        for block in range(4):
            for name, fn in forms.items() if block % 2 == 0 else reversed(forms.items()):
                target.few_row_logits = fn
                for _ in range(pairs):
                    t_ar = ar()
                    t0 = time.perf_counter()
                    backend.draft(5)
                    t_draft = time.perf_counter() - t0
                    ar()  # the draft's context rows are consumed; an AR round queues new ones
                    ratios[name].append(t_draft / t_ar)
    finally:
        target.few_row_logits = transposed
    return {k: round(statistics.median(v), 3) for k, v in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--pairs", type=int, default=8, help="paired AR/draft samples per form and block (4 blocks)"
    )
    ap.add_argument("--kv-len", type=int, default=256)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = load_backend("torch", target=args.target, head=args.head)
    target = backend.target
    table = gemm_table(target, args.repeats)
    ratios = draft_ratios(backend, args.pairs, args.kv_len)
    print(f"draft / t(1): h @ W^T {ratios['linear']:.2f}   W @ h^T {ratios['transposed']:.2f}", flush=True)
    h = torch.randn(15, int(target.lm_head.weight.shape[1]), generator=torch.Generator().manual_seed(1))
    diff = float((target.lm_logits(h) - target.few_row_logits(h)).abs().max())
    result = {
        "command": shlex.join(
            ["python", "-m", "bench.draft_gemm", *(argv if argv is not None else sys.argv[1:])]
        ),
        "threads": args.threads,
        "torch": torch.__version__,
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "lm_head": list(target.lm_head.weight.shape),
        "gemm_ms": table,
        "draft_over_t1": ratios,
        "max_abs_diff_15_rows": diff,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
