"""The teacher cache: what a distillation step needs from the frozen target, computed once, on disk.

Why: the online step (`distill_step` without cached tensors) runs the whole target over every batch to
get the head's context (the tapped layers) and the teacher (the final hidden state). On a CPU with a
30-layer target that forward is most of the step, and it is the same every epoch. The cache runs it once
per regenerated document and training reads the result back (SpecForge's "offline" mode).

What is stored, per document (row `i` of the regenerated `datasets` folder, positions from 0, exactly
what the packed training forward computes for that document, up to float rounding):

- `taps`   `[S_i, n*H]`: the outputs of the head's `target_layer_ids`, concatenated (`TargetModel.taps`);
- `hidden` `[S_i, H]`:   the target's final (post-norm) hidden state, the lm_head input. Teacher logits are
  still `lm_head(hidden)` at the gathered positions, in chunks (`losses.chunked_kl_loss`): no `[S, V]`
  tensor is ever written or built.

Layout of the folder:

    <cache>/cache.json                  format, fingerprint, layout, the shard plan, build statistics
    <cache>/shards/shard-00000.safetensors
                                        `taps` [T, n*H], `hidden` [T, H] (storage dtype) and `offsets`
                                        [docs + 1] int64 for the contiguous dataset rows `rows = a..b-1`

Building (`build_teacher_cache`) is resumable and atomic: the shard plan (contiguous row ranges of about
`shard_mb` each) is fixed when the build starts and stored in `<parent>/.<name>.building/cache.json`;
every shard is written to a temp name, fsynced and renamed, so a shard exists whole or not at all; a rerun
skips the finished shards; only when every shard exists is the staging folder renamed to `<cache>`, so the
configured path either holds a complete cache or nothing. The builder holds one shard (plus one forward
batch) in memory; the reader (`TeacherCache`) keeps at most one shard memory-mapped.

Fingerprint: the target's config and weights (a hash of each safetensors file's header and of 16
evenly spaced 1 MiB samples of it: an identity, not an integrity check), the tap layer ids, the target's
compute dtype, the storage dtype and a content hash of the dataset's `input_ids`. Opening a cache whose
fingerprint differs from the expected one is refused with one line naming the first differing field.

Storage dtype (`STORAGE_DTYPES`): the values are refused, with one line naming the layer, when a finite
value exceeds the dtype's range (Llama-family targets carry a few residual channels of magnitude ~1e4;
SmolLM2-135M reaches 2.5e4, within float16's 65504 by a factor of only 2.6). Measured effect of each
dtype on the real target: docs/DISTILLATION.md, bench/results/distill_cached.json.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jetflow_pl.errors import UserInputError
from jetflow_pl.files import atomic_write_text, fsync_dir, json_digest, stale_temporaries

FORMAT = "jetflow-teacher-cache"
FORMAT_VERSION = 1
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_STORAGE_DTYPE = "bfloat16"
_SAMPLE_BLOCKS, _SAMPLE_BYTES = 16, 1 << 20
_HASH_BATCH_ROWS = 4096


class TeacherCacheError(UserInputError):
    """A teacher cache that cannot be used: another target/taps/data, unreadable, or not a cache."""


class TeacherCacheOverflowError(TeacherCacheError):
    """The target's features do not fit the chosen storage dtype (a value beyond its finite range)."""


# ---------------------------------------------------------------------------------------------- identity
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_identity(path: Path) -> dict[str, Any]:
    """Size and a hash of the safetensors header plus `_SAMPLE_BLOCKS` evenly spaced 1 MiB samples.

    Reading whole multi-GB weight files at every training start would cost more than it protects; a
    retrained or re-quantized checkpoint changes the sampled bytes (the header alone would not see it).
    """
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _SAMPLE_BLOCKS * _SAMPLE_BYTES:
            h.update(f.read())
        else:
            head_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(head_len, 1 << 24)))
            span = size - _SAMPLE_BYTES
            for i in range(_SAMPLE_BLOCKS):
                f.seek(span * i // (_SAMPLE_BLOCKS - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return {"file": path.name, "bytes": size, "sampled_sha256": h.hexdigest()}


def target_identity(target_path: str | Path) -> dict[str, Any]:
    """The target's config (canonical JSON hash, without version/path noise) and weight files' identity."""
    path = Path(target_path)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    weights = [_file_identity(p) for p in sorted(path.glob("*.safetensors")) if p.is_file()]
    return {"config_sha256": json_digest(cfg), "weights": weights}


def dataset_identity(ds) -> dict[str, Any]:
    """Rows, tokens and a content hash of the `input_ids` column of a `datasets.Dataset` (streamed).

    Lengths and values are hashed separately so the hash does not depend on how the rows are batched.
    """
    import numpy as np
    import pyarrow.compute as pc

    h_len, h_val, tokens = hashlib.sha256(), hashlib.sha256(), 0
    for tbl in ds.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=_HASH_BATCH_ROWS):
        col = tbl.column("input_ids").combine_chunks()
        lengths = np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype="<i8")
        values = np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False), dtype="<i8")
        h_len.update(lengths.tobytes())
        h_val.update(values.tobytes())
        tokens += int(lengths.sum())
    return {
        "rows": len(ds),
        "tokens": tokens,
        "input_ids_sha256": _sha256((h_len.hexdigest() + h_val.hexdigest()).encode()),
    }


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in STORAGE_DTYPES.items():
        if dt == dtype:
            return name
    return str(dtype).replace("torch.", "")


def cache_fingerprint(
    target_path: str | Path,
    tap_layer_ids: Sequence[int],
    target_dtype: torch.dtype,
    storage_dtype: str,
    dataset: dict[str, Any],
) -> dict[str, Any]:
    """Everything the cached tensors depend on (see the module docstring). `dataset`: `dataset_identity`."""
    ident = target_identity(target_path)
    return {
        "target_config_sha256": ident["config_sha256"],
        "target_weights": ident["weights"],
        "tap_layer_ids": [int(i) for i in tap_layer_ids],
        "target_dtype": dtype_name(target_dtype),
        "storage_dtype": storage_dtype,
        "dataset": dataset,
    }


_FIELD_NAMES = {
    "target_config_sha256": "target config",
    "target_weights": "target weights",
    "tap_layer_ids": "tap layer ids",
    "target_dtype": "target dtype",
    "storage_dtype": "storage dtype",
    "dataset": "dataset (input_ids)",
}


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64:
        return value[:12]
    if isinstance(value, dict) and "input_ids_sha256" in value:
        return f"{value['rows']} rows, {value['tokens']} tokens, {value['input_ids_sha256'][:12]}"
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return ",".join(f"{w['file']}:{w['sampled_sha256'][:12]}" for w in value)
    return json.dumps(value)


def fingerprint_mismatch(stored: dict, expected: dict, taps_subset: bool = False) -> str | None:
    """A short description of the first differing fingerprint field, or None when they agree.

    `taps_subset`: the cache may store more tapped layers than expected (a cache built once with every
    layer a tap sweep needs serves each head its own layers); the others must agree exactly."""
    for key, name in _FIELD_NAMES.items():
        if key == "tap_layer_ids" and taps_subset:
            if set(expected.get(key) or ()) <= set(stored.get(key) or ()):
                continue
            return (
                f"{name} (cache: {_short(stored.get(key))}, now: {_short(expected.get(key))}, not a subset)"
            )
        if stored.get(key) != expected.get(key):
            return f"{name} (cache: {_short(stored.get(key))}, now: {_short(expected.get(key))})"
    return None


# ---------------------------------------------------------------------------------------------- files
def _read_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / "cache.json").read_text())
    except (OSError, ValueError) as err:
        raise TeacherCacheError(f"teacher_cache {str(folder)!r} has no readable cache.json ({err})") from err
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise TeacherCacheError(
            f"teacher_cache {str(folder)!r} is not a {FORMAT} v{FORMAT_VERSION} folder "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r})"
        )
    return meta


def staging_path(cache_dir: str | Path) -> Path:
    """Where an unfinished build of `cache_dir` lives (renamed to `cache_dir` when complete)."""
    dest = Path(cache_dir)
    return dest.parent / f".{dest.name}.building"


def cache_ready(cache_dir: str | Path) -> bool:
    """True when `cache_dir` holds a finished cache (its cache.json says complete)."""
    path = Path(cache_dir) / "cache.json"
    if not path.is_file():
        return False
    try:
        return bool(json.loads(path.read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def plan_shards(lengths: Sequence[int], token_bytes: int, shard_bytes: int) -> list[list[int]]:
    """Contiguous `[start, stop)` row ranges of at most `shard_bytes` each (one row at least)."""
    limit = max(1, int(shard_bytes) // max(1, int(token_bytes)))
    plan: list[list[int]] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + int(n) > limit:
            plan.append([start, i])
            start, tokens = i, 0
        tokens += int(n)
    if len(lengths) > start:
        plan.append([start, len(lengths)])
    return plan


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


# ---------------------------------------------------------------------------------------------- build
@dataclass
class BuildStats:
    """What one `build_teacher_cache` call did."""

    path: Path
    shards_total: int
    shards_built: int
    tokens_built: int
    seconds: float
    max_shard_bytes: int  # largest shard buffer the builder held (one shard at a time)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_built / self.seconds if self.seconds > 0 else 0.0


def _check_range(x: torch.Tensor, storage: torch.dtype, what: str, tap_layer_ids: Sequence[int], H: int):
    """Refuse (one line) a finite value that `storage` cannot represent (it would become inf)."""
    if not storage.is_floating_point or torch.finfo(storage).max >= torch.finfo(torch.float32).max:
        return
    mag = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))
    top = float(mag.max()) if mag.numel() else 0.0
    limit = float(torch.finfo(storage).max)
    if top > limit:
        channel = int(mag.amax(dim=0).argmax()) if mag.dim() == 2 else 0
        where = what
        if what == "taps":
            where = f"the tap of layer {list(tap_layer_ids)[channel // H]}"
        name = dtype_name(storage)
        raise TeacherCacheOverflowError(
            f"teacher cache: {where} reaches |x| = {top:.4g}, beyond {name}'s largest value {limit:.6g}; "
            f"set teacher_cache_dtype: bfloat16 (float32's range) or float32"
        )


def _forward_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (rows x longest) stays within `batch_tokens`."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, int(n)) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, int(n))
    if cur:
        groups.append(cur)
    return groups


@torch.no_grad()
def compute_features(
    target, docs: Sequence[Sequence[int]], batch_tokens: int = 4096
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield `(i, taps [S_i, n*H], hidden [S_i, H])` for every document `i`, positions from 0.

    Documents go through the target in right-padded batches of at most `batch_tokens` padded tokens,
    grouped by length (so little compute goes to padding; the yield order is therefore not `i` order).
    Each document is its own row (causal attention never reaches the padding after it), so its values
    equal a forward over that document alone, up to float rounding. Only one batch is alive at a time.
    """
    device = target.device
    order = sorted((i for i in range(len(docs)) if len(docs[i])), key=lambda i: len(docs[i]))
    for i in range(len(docs)):
        if not len(docs[i]):  # an empty document (never trained on): nothing to run
            n_taps = len(target.tap_layer_ids) * target.hidden_size
            yield i, torch.zeros(0, n_taps), torch.zeros(0, target.hidden_size)
    for group in _forward_batches([len(docs[i]) for i in order], batch_tokens):
        members = [order[g] for g in group]
        longest = max(len(docs[i]) for i in members)
        ids = torch.zeros(len(members), longest, dtype=torch.long)
        att = torch.zeros(len(members), longest, dtype=torch.long)
        for r, i in enumerate(members):
            ids[r, : len(docs[i])] = torch.as_tensor(docs[i], dtype=torch.long)
            att[r, : len(docs[i])] = 1
        res = target(
            ids.to(device),
            attention_mask=att.to(device),
            logits_positions=None,
            return_hidden=True,
            use_cache=False,
        )
        for r, i in enumerate(members):
            n = len(docs[i])
            yield i, res.taps[r, :n], res.hidden[r, :n]
        del res


def build_teacher_cache(
    cache_dir: str | Path,
    target,
    target_path: str | Path,
    dataset,
    *,
    storage_dtype: str = DEFAULT_STORAGE_DTYPE,
    shard_mb: float = 128.0,
    batch_tokens: int = 4096,
    device: str | torch.device | None = None,
    progress: bool = True,
    on_shard_written: Callable[[int, Path], None] | None = None,
) -> BuildStats:
    """Build (or finish) the teacher cache of `dataset` at `cache_dir`; a no-op when it is complete.

    Args:
        target: a `TargetModel` tapping the head's `target_layer_ids` (in that order).
        target_path: its folder (for the fingerprint).
        dataset: the regenerated `datasets.Dataset` (its `input_ids` column is read shard by shard).
        storage_dtype: `float32` | `bfloat16` | `float16` (module docstring).
        shard_mb: approximate shard size; only used when a build starts (a resumed build keeps its plan).
        batch_tokens: padded tokens per target forward.
        device: where the target runs while building (default: its current device).
        on_shard_written: called after each shard is renamed into place (index, path).

    Raises:
        TeacherCacheError: `cache_dir` (or its staging folder) holds a cache of another fingerprint, or
            something that is not a cache.
        TeacherCacheOverflowError: a value exceeds `storage_dtype`'s range (the unfinished build is removed:
            it can never complete with that dtype).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    if storage_dtype not in STORAGE_DTYPES:
        raise UserInputError(
            f"teacher_cache_dtype must be one of {list(STORAGE_DTYPES)}, got {storage_dtype!r}"
        )
    if not target.tap_layer_ids:
        raise UserInputError("the target taps no layer: call target.set_taps(head.target_layer_ids) first")
    t0 = time.monotonic()
    dest = Path(cache_dir)
    fp = cache_fingerprint(
        target_path, target.tap_layer_ids, target.dtype, storage_dtype, dataset_identity(dataset)
    )
    if dest.exists():
        if not (dest / "cache.json").is_file():
            raise TeacherCacheError(
                f"teacher_cache {str(dest)!r} exists but is not a teacher cache (no cache.json); delete it "
                "or point teacher_cache elsewhere"
            )
        meta = _read_meta(dest)
        _check_fingerprint(dest, meta, fp, taps_subset=True)
        return BuildStats(dest, len(meta["shards"]), 0, 0, time.monotonic() - t0, 0)

    stage = staging_path(dest)
    H, n_taps = int(target.hidden_size), len(target.tap_layer_ids)
    storage = STORAGE_DTYPES[storage_dtype]
    token_bytes = (n_taps + 1) * H * torch.tensor([], dtype=storage).element_size()
    if (stage / "cache.json").is_file():
        meta = _read_meta(stage)
        _check_fingerprint(stage, meta, fp)
    else:
        if stage.exists() and any(stage.iterdir()):
            raise TeacherCacheError(
                f"{str(stage)!r} exists but holds no teacher cache build; delete it to build {str(dest)!r}"
            )
        lengths = _lengths(dataset)
        plan = plan_shards(lengths, token_bytes, int(shard_mb * (1 << 20)))
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "complete": False,
            "fingerprint": fp,
            "layout": {
                "tap_layer_ids": list(fp["tap_layer_ids"]),
                "hidden_size": H,
                "taps_dim": n_taps * H,
                "storage_dtype": storage_dtype,
            },
            "target_path": str(target_path),
            "shards": [
                {"file": shard_name(i), "rows": r, "tokens": int(sum(lengths[r[0] : r[1]]))}
                for i, r in enumerate(plan)
            ],
        }
        (stage / "shards").mkdir(parents=True, exist_ok=True)
        atomic_write_text(stage / "cache.json", json.dumps(meta, indent=1))
    shard_dir = stage / "shards"
    for stale in stale_temporaries(shard_dir):  # a temp file of a killed run: never a finished shard
        stale.unlink(missing_ok=True)
    fp_hash = json_digest(fp)

    todo = []
    for i, sh in enumerate(meta["shards"]):
        if not _shard_ok(shard_dir / sh["file"], sh, fp_hash, safe_open):
            todo.append(i)
    total = sum(sh["tokens"] for sh in meta["shards"])
    done = total - sum(meta["shards"][i]["tokens"] for i in todo)

    orig_device = target.device
    if device is not None:
        target.to(device)
    built_tokens, max_bytes = 0, 0
    bar = tqdm(
        total=total,
        initial=done,
        unit="tok",
        unit_scale=True,
        desc=f"teacher cache {dest.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        for i in todo:
            sh = meta["shards"][i]
            a, b = sh["rows"]
            docs = [list(x) for x in dataset[a:b]["input_ids"]]
            n_tok = sum(len(d) for d in docs)
            if n_tok != sh["tokens"]:
                raise TeacherCacheError(
                    f"the dataset changed under the teacher cache build at rows {a}..{b - 1}"
                )
            taps = torch.empty(n_tok, n_taps * H, dtype=storage)
            hidden = torch.empty(n_tok, H, dtype=storage)
            offsets = torch.zeros(len(docs) + 1, dtype=torch.long)
            offsets[1:] = torch.tensor([len(d) for d in docs], dtype=torch.long).cumsum(0)
            for j, tp, hd in compute_features(target, docs, batch_tokens):
                _check_range(tp, storage, "taps", target.tap_layer_ids, H)
                _check_range(hd, storage, "the final hidden state", target.tap_layer_ids, H)
                a0, a1 = int(offsets[j]), int(offsets[j + 1])
                taps[a0:a1] = tp.to(storage).cpu()
                hidden[a0:a1] = hd.to(storage).cpu()
                bar.update(a1 - a0)
            max_bytes = max(max_bytes, taps.nbytes + hidden.nbytes)
            path = shard_dir / sh["file"]
            tmp = shard_dir / f".tmp-{os.getpid()}-{sh['file']}"
            save_file(
                {"taps": taps, "hidden": hidden, "offsets": offsets},
                str(tmp),
                metadata={"rows": f"{a},{b}", "fingerprint_sha256": fp_hash},
            )
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(shard_dir)
            del taps, hidden
            built_tokens += n_tok
            if on_shard_written is not None:
                on_shard_written(i, path)
    except TeacherCacheOverflowError:
        shutil.rmtree(stage, ignore_errors=True)  # can never finish with this dtype
        raise
    finally:
        bar.close()
        if device is not None:
            target.to(orig_device)
    seconds = time.monotonic() - t0
    meta["complete"] = True
    meta["build"] = {"seconds_last_run": seconds, "tokens_last_run": built_tokens, "total_tokens": total}
    atomic_write_text(stage / "cache.json", json.dumps(meta, indent=1))
    try:
        os.rename(stage, dest)
    except OSError:
        if not cache_ready(dest):  # not a concurrent builder that finished first
            raise
        shutil.rmtree(stage, ignore_errors=True)
    fsync_dir(dest.parent)
    return BuildStats(dest, len(meta["shards"]), len(todo), built_tokens, seconds, max_bytes)


def _lengths(dataset) -> list[int]:
    import pyarrow.compute as pc

    out: list[int] = []
    for tbl in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=_HASH_BATCH_ROWS):
        out.extend(int(n) for n in pc.list_value_length(tbl.column("input_ids")).to_pylist())
    return out


def _shard_ok(path: Path, sh: dict, fp_hash: str, safe_open) -> bool:
    """A finished shard of this build (renamed into place, so whole); a damaged file is redone."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            return (
                md.get("fingerprint_sha256") == fp_hash
                and md.get("rows") == f"{sh['rows'][0]},{sh['rows'][1]}"
            )
    except Exception:  # noqa: BLE001 - unreadable: rebuild it
        path.unlink(missing_ok=True)
        return False


def _check_fingerprint(folder: Path, meta: dict, expected: dict, taps_subset: bool = False) -> None:
    diff = fingerprint_mismatch(meta.get("fingerprint", {}), expected, taps_subset)
    if diff:
        raise TeacherCacheError(
            f"teacher_cache {str(folder)!r} was built for another {diff}; delete it to rebuild, or point "
            "teacher_cache elsewhere"
        )


# ---------------------------------------------------------------------------------------------- read
class TeacherCache:
    """Read access to a finished cache: `features(row, n)` -> the first `n` positions of document `row`.

    At most one shard is open (memory-mapped) at a time, so reading a whole epoch in random order keeps
    the resident set bounded by one shard. Picklable (DataLoader workers reopen lazily).
    """

    def __init__(self, cache_dir: str | Path, expected_fingerprint: dict | None = None) -> None:
        from safetensors import safe_open

        self.path = Path(cache_dir)
        if not cache_ready(self.path):
            hint = ""
            if (staging_path(self.path) / "cache.json").is_file():
                hint = (
                    " (an unfinished build is in "
                    + repr(str(staging_path(self.path)))
                    + "; rerun to finish it)"
                )
            raise TeacherCacheError(f"teacher_cache {str(self.path)!r} is not a finished teacher cache{hint}")
        self.meta = _read_meta(self.path)
        if expected_fingerprint is not None:
            _check_fingerprint(self.path, self.meta, expected_fingerprint, taps_subset=True)
        lay = self.meta["layout"]
        self.hidden_size = int(lay["hidden_size"])
        self.stored_tap_layer_ids = tuple(lay["tap_layer_ids"])
        # a cache holding more layers than the head taps serves the head's own, in the head's order
        wanted = tuple(expected_fingerprint["tap_layer_ids"]) if expected_fingerprint else None
        self._columns: torch.Tensor | None = None
        if wanted is not None and wanted != self.stored_tap_layer_ids:
            H = self.hidden_size
            self._columns = torch.cat(
                [torch.arange(H) + H * self.stored_tap_layer_ids.index(i) for i in wanted]
            )
        self.tap_layer_ids = wanted or self.stored_tap_layer_ids
        self.taps_dim = len(self.tap_layer_ids) * self.hidden_size
        self.storage_dtype = STORAGE_DTYPES[lay["storage_dtype"]]
        self._starts = [int(sh["rows"][0]) for sh in self.meta["shards"]]
        self._offsets: list[list[int]] = []
        for sh in self.meta["shards"]:
            try:
                with safe_open(str(self.path / "shards" / sh["file"]), framework="pt") as f:
                    self._offsets.append(f.get_tensor("offsets").tolist())
            except Exception as err:  # noqa: BLE001
                raise TeacherCacheError(
                    f"teacher cache shard {sh['file']} in {str(self.path)!r} is unreadable ({err})"
                ) from err
        self.num_rows = sum(len(o) - 1 for o in self._offsets)
        self._open: tuple[int, Any] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = None
        return state

    def close(self) -> None:
        self._open = None

    def length(self, row: int) -> int:
        s = bisect.bisect_right(self._starts, int(row)) - 1
        o = self._offsets[s]
        j = int(row) - self._starts[s]
        return o[j + 1] - o[j]

    def _handle(self, shard: int):
        from safetensors import safe_open

        if self._open is None or self._open[0] != shard:
            self._open = None  # drop (unmap) the previous shard first
            f = safe_open(str(self.path / "shards" / self.meta["shards"][shard]["file"]), framework="pt")
            self._open = (shard, f)
        return self._open[1]

    def features(
        self, row: int, length: int | None = None, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(taps [n, n*H], hidden [n, H])` of positions `start .. start+n-1` of document `row` (copies;
        the taps of the expected layers only, when the cache stores more)."""
        if not 0 <= int(row) < self.num_rows:
            raise IndexError(f"row {row} is outside the teacher cache's {self.num_rows} documents")
        s = bisect.bisect_right(self._starts, int(row)) - 1
        j = int(row) - self._starts[s]
        a, b = self._offsets[s][j], self._offsets[s][j + 1]
        n = (b - a - start) if length is None else int(length)
        if start < 0 or n < 0 or a + start + n > b:
            raise IndexError(
                f"positions {start}..{start + n - 1} are outside document {row} ({b - a} tokens)"
            )
        f = self._handle(s)
        lo, hi = a + start, a + start + n
        taps = f.get_slice("taps")[lo:hi]
        if self._columns is not None:
            taps = taps[:, self._columns]
        return taps, f.get_slice("hidden")[lo:hi]
