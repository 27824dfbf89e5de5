"""Writing files so that a crash never leaves half of one, and naming cached results by what made them.

Every file the project writes for a later run to read (a cost profile, an acceptance profile, a
teacher-cache shard, a regenerated dataset's metadata, a benchmark's JSON) goes through
`atomic_write_bytes` / `atomic_write_text` / `atomic_write_json`: the bytes land in a hidden temporary
file beside the target, are flushed to disk, and replace the target in one rename. A reader sees the
old file or the new one, never a prefix of the new one, and a killed writer leaves only a
`.tmp-PID-NAME` file that `stale_temporaries` finds.

What one of them wrote is read back with `read_versioned_json`: the file's format version checked, and
anything wrong with it one `UserInputError` that names the file.

A cache is keyed by `json_digest(fingerprint)`: the SHA-256 of the fingerprint as canonical JSON
(sorted keys), so the same inputs always name the same entry and any change names a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from jetflow_pl.errors import UserInputError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_dir",
    "json_digest",
    "read_versioned_json",
    "stale_temporaries",
    "VersionedJsonFile",
]

T = TypeVar("T")

_TMP_PREFIX = ".tmp-"


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` (parents created) through a temp file + fsync + rename; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """`atomic_write_bytes` of `text` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2, sort_keys: bool = False) -> Path:
    """`obj` as JSON (one trailing newline), written atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def stale_temporaries(folder: str | Path) -> Iterator[Path]:
    """What a killed writer left in `folder`: files and folders named with the temp prefix that
    `atomic_write_*` (and every writer that renames into place) uses, never a finished one."""
    yield from Path(folder).glob(f"{_TMP_PREFIX}*")


def json_digest(obj: Any, length: int | None = None) -> str:
    """SHA-256 hex digest of `obj` as canonical JSON (sorted keys; non-JSON values by `str`), cut to
    `length` characters when given: the name of a cache entry made from `obj`."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    return digest if length is None else digest[:length]


def read_versioned_json(
    path: str | Path, what: str, version: int, make: Callable[..., T], stale: str = ""
) -> T:
    """`make(**data)` from the JSON object in `path`, written in format `version`, or one `UserInputError`
    naming the file and `what` it should be: missing, not JSON, not an object, another version (`stale`:
    what to do about that, appended), or fields `make` refuses (its own message)."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        if data.get("version") != version:
            raise ValueError(f"version {data.get('version')!r}, expected {version}{stale}")
        return make(**data)
    except UserInputError as err:
        raise UserInputError(f"{what} {path}: {err}") from err
    except (OSError, ValueError, TypeError) as err:
        raise UserInputError(f"{what} {path} is not readable ({err})") from err


class VersionedJsonFile:
    """A dataclass kept as one JSON object of format `FILE_VERSION` (its `version` field): `save` writes it
    atomically, `load` reads it back through `read_versioned_json` and sets its `source` field (left out of
    the file) to the path it came from. Subclasses name `FILE_KIND` (the error messages' word for it),
    `FILE_VERSION` and, optionally, `FILE_STALE` (what to do about another version)."""

    FILE_KIND: ClassVar[str]
    FILE_VERSION: ClassVar[int]
    FILE_STALE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)  # type: ignore[call-overload]  (subclasses are dataclasses)
        d.pop("source")
        return d

    def save(self, path: str | Path) -> Path:
        """Write as JSON atomically: a reader never sees half a file."""
        return atomic_write_json(path, self.to_dict(), sort_keys=True)

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        """Read a file written by `save`; anything else is one `UserInputError` naming the file."""
        obj = read_versioned_json(path, cls.FILE_KIND, cls.FILE_VERSION, cls, cls.FILE_STALE)  # type: ignore[attr-defined]
        obj.source = str(path)  # type: ignore[attr-defined]
        return obj
