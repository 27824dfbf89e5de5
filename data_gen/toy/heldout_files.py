"""Write the toy held-out prompt sets as jsonl files: what the val/tau callback and benches read.

`python -m data_gen.toy.heldout_files` rewrites `data_gen/toy/assets/heldout_prompts/<domain>.jsonl`
(20 prompts per domain, seed 0: the set `AcceptanceLengthCallback` encoded from `data_gen.toy` before
it read files, so val/tau stays comparable across that change). Rows are `{"id", "domain", "prompt"}`.
The files are committed because the library must not import the toy world, and because the code domain
is drawn from the interpreter's standard library, which changes between Python versions; the
generating Python version is recorded in `README.md` beside them.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Sequence
from pathlib import Path

from data_gen.toy.splits import DOMAINS, heldout_prompts
from jetflow_pl.files import atomic_write_text

DEFAULT_DIR = Path(__file__).parent / "assets" / "heldout_prompts"
DEFAULT_N = 20
DEFAULT_SEED = 0


def heldout_rows(domain: str, n: int = DEFAULT_N, seed: int = DEFAULT_SEED) -> list[dict]:
    """The rows of one domain's file: `heldout_prompts(domain, n, seed)` reduced to id, domain, prompt."""
    return [
        {"id": r["id"], "domain": domain, "prompt": r["prompt"]} for r in heldout_prompts(domain, n, seed)
    ]


def jsonl_text(rows: Sequence[dict]) -> str:
    """One JSON object per line, keys sorted, so the file bytes are a function of the rows alone."""
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows)


def write_heldout_files(out_dir: Path, n: int = DEFAULT_N, seed: int = DEFAULT_SEED) -> list[Path]:
    """Write `<out_dir>/<domain>.jsonl` for every toy domain (temp file + rename) and a README."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for domain in DOMAINS:
        path = out_dir / f"{domain}.jsonl"
        atomic_write_text(path, jsonl_text(heldout_rows(domain, n, seed)))
        paths.append(path)
    readme = (
        "# Toy held-out prompts\n\n"
        f"`{n}` held-out prompts per toy domain (`data_gen.toy.splits.heldout_prompts(domain, {n}, {seed})`),\n"
        "never present in any toy training set. Read by `AcceptanceLengthCallback(prompts_file=...)` in the\n"
        "distillation configs and by the benches.\n\n"
        "Made by:\n\n"
        f"    python -m data_gen.toy.heldout_files --n {n} --seed {seed}\n\n"
        f"with Python {platform.python_version()} (the code domain is drawn from that interpreter's stdlib).\n"
    )
    (out_dir / "README.md").write_text(readme, encoding="utf-8")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m data_gen.toy.heldout_files", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, default=DEFAULT_DIR)
    p.add_argument("--n", type=int, default=DEFAULT_N, help="prompts per domain")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = p.parse_args(argv)
    for path in write_heldout_files(args.out, args.n, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
