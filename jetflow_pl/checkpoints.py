"""Loading weights from disk without trusting the file: safetensors only, checked before use.

Why a separate check: safetensors itself refuses a truncated or garbled file, but its error
("Error while deserializing header: ...") names no file, and `from_pretrained` would otherwise fall back
to `pytorch_model.bin` (a pickle) for a head folder. Every loader of a target or head folder calls
`check_safetensors_dir` first, so a bad file fails in one line naming it, before any model is built.
Reading the header maps the file and parses a few kilobytes: it costs nothing next to loading weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from jetflow_pl.errors import CheckpointError, MissingPathError, UserInputError

#: weight files that are pickles: loading one could run code, so they are refused, never loaded
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_safetensors_file(path: Path) -> None:
    """Raise CheckpointError naming `path` unless it is a complete, parseable safetensors file."""
    from safetensors import safe_open

    try:
        # safe_open validates the header and that the tensors' byte ranges cover the file exactly,
        # so a truncated copy is caught here (not half-way through loading)
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: all mean "this file is bad"
        raise CheckpointError(
            f"corrupt or truncated safetensors file {path} ({err}); re-copy or re-save this file"
        ) from err


def check_safetensors_dir(path: str | Path, what: str) -> list[Path]:
    """Check that the HF folder `path` holds its weights as complete safetensors files; return them.

    `what` ("target", "draft head") goes into the messages. A sharded checkpoint's index must list only
    files that exist. A folder with only pickle weights (`pytorch_model.bin`, ...) is refused: this
    project never unpickles model weights.
    """
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"{what} path does not exist: {path}")
    if not path.is_dir():
        raise UserInputError(f"{what} path {path} is not a folder (expected an HF model folder)")
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"unreadable safetensors index {index} ({err})") from err
        missing = [name for name in listed if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists missing weight files: {', '.join(missing)}")
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_WEIGHT_SUFFIXES)
        hint = (
            f" (found {', '.join(pickles)}: pickle weights are refused because loading them can run "
            "code; convert them once with safetensors in a trusted environment)"
            if pickles
            else ""
        )
        raise CheckpointError(f"no model.safetensors in the {what} folder {path}{hint}")
    for f in files:
        check_safetensors_file(f)
    return files


def load_draft_head(path: str | Path):
    """`DraftHead.from_pretrained(path)` from safetensors only, with every failure one clear error."""
    from jetflow_pl.head import DraftHead

    path = Path(path)
    files = check_safetensors_dir(path, "draft head")
    if not (path / "config.json").is_file():
        raise UserInputError(f"draft head folder {path} has no config.json")
    try:
        head = DraftHead.from_pretrained(path, use_safetensors=True, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, UserInputError):
            raise
        raise CheckpointError(f"cannot load the draft head from {path}: {type(err).__name__}: {err}") from err
    if int(head.config.draft_vocab_size or 0) > 0:
        _load_draft_vocab(head, path, files)
    return head


def _load_draft_vocab(head, path: Path, files: list[Path]) -> None:
    """Check that the head's draft vocabulary was in its weights, or set it from vLLM's `d2t` offsets (a
    head folder written for vLLM, or an EAGLE-3-style head; its `lm_head.weight` rows are the target's,
    which the runtimes here take from the target itself). `DraftHead` ignores both tensors on load, so
    this reads the files' keys rather than the loading info."""
    from safetensors import safe_open

    from jetflow_pl.head.draft_vocab import BUFFER, set_draft_vocab
    from jetflow_pl.head.engine_formats import draft_vocab_from_d2t

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            if BUFFER in keys:
                return
            if "d2t" in keys:
                try:
                    set_draft_vocab(head, draft_vocab_from_d2t(f.get_tensor("d2t")))
                except ValueError as err:
                    raise CheckpointError(
                        f"{path}: its d2t offsets are not a draft vocabulary: {err}"
                    ) from err
                return
    if int(head.config.draft_vocab_size) == int(head.config.vocab_size):
        # vLLM's spelling of "no draft vocabulary" (a folder written for it): draft over every id
        set_draft_vocab(head, None)
        return
    # from_pretrained would leave the buffer uninitialised: the head would draft from garbage ids
    raise CheckpointError(
        f"{path}/config.json says draft_vocab_size={head.config.draft_vocab_size}, but its weights hold "
        "no draft_vocab (write the head with `python -m jetflow_pl draft-vocab` or set_draft_vocab)"
    )
