"""`DistillDataModule`: tokenized `(input_ids, loss_mask)` documents, packed into fixed-length rows.

Sources (docs/DESIGN.md section 3):

- a regenerated dataset folder (`datasets.load_from_disk`; the schema of `data_gen/regenerate/schema.py`:
  columns `id, domain, input_ids, loss_mask, prompt_len, response, finish_reason`). The folder may be the
  regeneration output root (its `dataset/` subfolder is used) or the dataset folder itself;
- any `DocumentSource` a config names by `class_path` (`documents:`), e.g. the toy corpora as they are
  (`data_gen.toy.documents.ToyDocuments`), so the distillation stage also runs without regeneration.

Documents are optionally re-weighted per domain (`domain_weights`: 2.0 = every document twice, 0.5 = a
seeded half), split into train / held-out at the document level, shuffled by `seed` and packed into rows
of `seq_len` tokens. Every batch is a dict of `[B, S]` tensors `input_ids` (long), `loss_mask` (bool) and
`doc_ids` (long; a new document starts wherever the id changes, see `training.anchors.segment_ids`).

Packing (`split_documents`):

- `True`: the shuffled documents are concatenated into one stream and cut every `seq_len` tokens, so no
  token is wasted; a document cut at a row boundary continues in the next row as a new segment (it then
  lacks its earlier context). Only the last, partial row is padded.
- `False`: documents are never cut (longer ones are truncated to `seq_len`); a document that does not fit
  in the current row starts the next row, whose unused tail is padded. Every block then sees its whole
  prompt, exactly as at inference, at the cost of a little padding.

Padding rows carry `pad_token_id`, their own doc id (never merged with a real document) and
`loss_mask=False`, so no anchor and no attention ever reaches them.

Regenerate if absent (`regenerate_config`): when `dataset_path` does not exist, `prepare_data` (Lightning
runs it once per node, on local rank 0, before any `setup`) runs the regeneration stage first, i.e.
exactly `python -m jetflow_pl predict --config <regenerate_config>` with the writer's `output_dir` pointed
at a staging folder next to `dataset_path` and `regenerate_overrides` applied. It runs in a subprocess so
that its own Trainer cannot disturb the fit's (process group, devices, seeds). Only a finished run is
renamed to `dataset_path` (one atomic `rename`), so an interrupted regeneration never looks like a
dataset; rerunning `fit` resumes the staging run (the regeneration writer skips finished ids).

Teacher cache (`teacher_cache`): after the data is there, `prepare_data` also builds (or finishes) the
on-disk cache of the target's features for every document (`teacher_cache.py`), with the target of the
attached `DistillationModule`; `setup` checks its fingerprint on every rank. Each packed row then also
carries `taps` `[S, n*H]` and `teacher_hidden` `[S, H]` (storage dtype, zeros on padding), read per row
from at most one memory-mapped shard, and the step does not run the target.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Sampler

from jetflow_pl.errors import UserInputError

from .teacher_cache import (
    DEFAULT_STORAGE_DTYPE,
    STORAGE_DTYPES,
    TeacherCache,
    build_teacher_cache,
    cache_fingerprint,
    dataset_identity,
)


# --------------------------------------------------------------------------------------------- loading
def open_regenerated(path: str | Path):
    """The regenerated `datasets.Dataset` at `path` (or `<path>/dataset`), memory-mapped, schema-checked."""
    from datasets import load_from_disk

    path = Path(path)
    if not path.exists():
        raise UserInputError(
            f"dataset_path {str(path)!r} does not exist (regenerate it with `python -m jetflow_pl predict "
            "--config configs/regenerate/...`, or set data.init_args.regenerate_config to do it here)"
        )
    if (path / "dataset").is_dir():
        path = path / "dataset"
    try:
        ds = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise UserInputError(f"dataset_path {str(path)!r} is not a saved dataset ({err})") from err
    missing = [c for c in ("input_ids", "loss_mask") if c not in ds.column_names]
    if missing:
        raise UserInputError(
            f"dataset at {str(path)!r} lacks column(s) {missing}; expected the regeneration schema "
            "(id, domain, input_ids, loss_mask, prompt_len, response, finish_reason)"
        )
    return ds


def load_regenerated(path: str | Path) -> list[dict]:
    """Documents `{"input_ids", "loss_mask", "domain", "source_row"}` from a regenerated dataset folder.

    `source_row` is the document's row in the dataset: the key of its teacher-cache entry.
    """
    ds = open_regenerated(path)
    cols = ["input_ids", "loss_mask"] + (["domain"] if "domain" in ds.column_names else [])
    docs = []
    for i, row in enumerate(ds.select_columns(cols)):
        ids, mask = list(row["input_ids"]), [bool(m) for m in row["loss_mask"]]
        if len(ids) != len(mask):
            raise UserInputError(f"a row of {str(path)!r} has input_ids and loss_mask of different lengths")
        docs.append(
            {"input_ids": ids, "loss_mask": mask, "domain": row.get("domain", "") or "", "source_row": i}
        )
    return docs


class DocumentSource:
    """Documents for `DistillDataModule(documents=...)`, named in a config by `class_path`.

    `load()` returns dicts with `input_ids` (list of ids), `loss_mask` (list of 0/1, 1 on response
    tokens) and optionally `domain`. Stages provide their own (the toy world's `ToyDocuments`), so the
    library never imports them.
    """

    def load(self) -> list[dict]:
        raise NotImplementedError

    def describe(self) -> str:
        """A few words for messages ('the toy corpora {...}')."""
        return type(self).__name__


# ---------------------------------------------------------------------------------------- regeneration
def dataset_ready(path: str | Path) -> bool:
    """True when `path` holds a saved dataset (or a regeneration output root with one in `dataset/`)."""
    path = Path(path)
    return any(
        (d / "dataset_info.json").is_file() or (d / "state.json").is_file() for d in (path, path / "dataset")
    )


def set_dotted(cfg: dict, key: str, value: Any) -> None:
    """`cfg["a"]["b"]["c"] = value` for `key="a.b.c"` (missing dicts are created; lists are refused)."""
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserInputError(
                f"regenerate_overrides: {key!r} goes through {part!r}, which is not a mapping"
            )
        node = child
    node[parts[-1]] = value


def regeneration_config(config_path: str | Path, output_dir: Path, overrides: dict[str, Any] | None) -> dict:
    """The predict config of `config_path` with `overrides` applied and its writer aimed at `output_dir`."""
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise UserInputError(f"regenerate_config {str(path)!r} does not exist")
    cfg = yaml.safe_load(path.read_text()) or {}
    if not isinstance(cfg, dict):
        raise UserInputError(f"regenerate_config {str(path)!r} is not a mapping")
    for key, value in (overrides or {}).items():
        set_dotted(cfg, str(key), value)
    trainer = cfg.setdefault("trainer", {})
    writers = [
        cb
        for cb in trainer.get("callbacks") or []
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("RegenerationWriter")
    ]
    if len(writers) != 1:
        raise UserInputError(
            f"regenerate_config {str(path)!r} must have exactly one RegenerationWriter callback, found {len(writers)}"
        )
    writers[0].setdefault("init_args", {})["output_dir"] = str(output_dir)
    trainer["default_root_dir"] = str(output_dir.parent / "logs")
    return cfg


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL it when the parent dies. The regeneration child ignores
    SIGTERM while Lightning runs, so a parent stopped from outside used to leave it writing on alone (and
    a rerun then raced it in the same staging folder). Killing it is safe: shards are written atomically
    and a rerun resumes (tests/test_regenerate.py, the SIGKILL test)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))


def run_tied_to_parent(cmd: list[str]) -> int:
    """`subprocess.run(cmd)`'s return code, the child killed if this process dies first (on Linux)."""
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.run(cmd, check=False, preexec_fn=preexec).returncode


def regenerate_dataset(
    config_path: str | Path, dataset_path: str | Path, overrides: dict[str, Any] | None = None
) -> Path:
    """Run the regeneration stage (`python -m jetflow_pl predict`) and move its output to `dataset_path`.

    The run writes into `<parent>/.<name>.regenerating/out` (resumable: a rerun after a crash continues
    it) and is renamed to `dataset_path` only once its merged `dataset/` exists, so readers never see a
    half-written dataset. Returns `dataset_path`.
    """
    import yaml

    dest = Path(dataset_path)
    staging = dest.parent / f".{dest.name}.regenerating"
    out = staging / "out"
    cfg = regeneration_config(config_path, out, overrides)
    staging.mkdir(parents=True, exist_ok=True)
    cfg_file = staging / "regenerate.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "jetflow_pl", "predict", "--config", str(cfg_file)]
    rank_zero_info(
        f"[DistillDataModule] {str(dest)!r} does not exist: regenerating it with the target first\n"
        f"  {' '.join(cmd)}   (from {config_path}; output renamed to {dest} when complete)"
    )
    rc = run_tied_to_parent(cmd)
    if rc != 0:
        msg = (
            f"regenerating {str(dest)!r} failed: `{' '.join(cmd)}` exited with status {rc} (its output is "
            f"above); rerun to resume it, or delete {str(staging)!r} to start over"
        )
        raise UserInputError(msg) if rc == 2 else RuntimeError(msg)
    if not dataset_ready(out):
        raise RuntimeError(f"the regeneration run finished but {str(out / 'dataset')!r} was not written")
    shutil.copyfile(cfg_file, out / "regenerate.yaml")  # provenance, inside the folder before the rename
    try:
        os.rename(out, dest)
    except OSError:
        if not dataset_ready(dest):  # not a concurrent run that finished first (e.g. another node)
            raise
    shutil.rmtree(staging, ignore_errors=True)
    return dest


def apply_domain_weights(docs: list[dict], weights: dict[str, float] | None, seed: int) -> list[dict]:
    """Repeat each document `floor(w)` times plus once more with probability `w - floor(w)` (seeded)."""
    if not weights:
        return docs
    for d, w in weights.items():
        if w < 0:
            raise UserInputError(f"domain_weights[{d!r}] must be >= 0, got {w}")
    rng = random.Random(seed)
    out: list[dict] = []
    for doc in docs:
        w = float(weights.get(doc["domain"], 1.0))
        reps = int(w) + (1 if rng.random() < w - int(w) else 0)
        out.extend([doc] * reps)
    return out


# --------------------------------------------------------------------------------------------- packing
def pack_documents(
    docs: Sequence[dict],
    seq_len: int,
    pad_token_id: int = 0,
    split_documents: bool = True,
    return_segments: bool = False,
) -> dict[str, torch.Tensor]:
    """Pack documents (in the given order) into `[N, seq_len]` rows; see the module docstring.

    Returns `input_ids` (long), `loss_mask` (bool), `doc_ids` (long: 0, 1, 2, ... per row in order of
    appearance, the padding tail one more than the row's last document). With `return_segments` also
    `segments`: per row a list of `(source_row, doc_start, row_start, length)` (the document's
    `source_row`, -1 without one), i.e. where each piece of each document landed (for the teacher cache).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    rows_ids: list[list[int]] = []
    rows_mask: list[list[bool]] = []
    rows_doc: list[list[int]] = []
    rows_seg: list[list[tuple[int, int, int, int]]] = []
    cur_seg: list[tuple[int, int, int, int]] = []
    cur_ids: list[int] = []
    cur_mask: list[bool] = []
    cur_doc: list[int] = []
    n_docs = 0  # documents (segments) in the current row

    def flush() -> None:
        nonlocal cur_ids, cur_mask, cur_doc, n_docs, cur_seg
        if not cur_ids:
            return
        pad = seq_len - len(cur_ids)
        rows_ids.append(cur_ids + [pad_token_id] * pad)
        rows_mask.append(cur_mask + [False] * pad)
        rows_doc.append(cur_doc + [n_docs] * pad)
        rows_seg.append(cur_seg)
        cur_ids, cur_mask, cur_doc, n_docs, cur_seg = [], [], [], 0, []

    for doc in docs:
        ids, mask = list(doc["input_ids"]), [bool(m) for m in doc["loss_mask"]]
        if not ids:
            continue
        src = int(doc.get("source_row", -1))
        if not split_documents:
            ids, mask = ids[:seq_len], mask[:seq_len]
            if len(cur_ids) + len(ids) > seq_len:
                flush()
            cur_seg.append((src, 0, len(cur_ids), len(ids)))
            cur_ids += ids
            cur_mask += mask
            cur_doc += [n_docs] * len(ids)
            n_docs += 1
            continue
        start = 0
        while ids:
            room = seq_len - len(cur_ids)
            take = min(room, len(ids))
            cur_seg.append((src, start, len(cur_ids), take))
            start += take
            cur_ids += ids[:take]
            cur_mask += mask[:take]
            cur_doc += [n_docs] * take
            n_docs += 1
            ids, mask = ids[take:], mask[take:]
            if len(cur_ids) == seq_len:
                flush()
    flush()
    if not rows_ids:
        out = {
            "input_ids": torch.zeros(0, seq_len, dtype=torch.long),
            "loss_mask": torch.zeros(0, seq_len, dtype=torch.bool),
            "doc_ids": torch.zeros(0, seq_len, dtype=torch.long),
        }
    else:
        out = {
            "input_ids": torch.tensor(rows_ids, dtype=torch.long),
            "loss_mask": torch.tensor(rows_mask, dtype=torch.bool),
            "doc_ids": torch.tensor(rows_doc, dtype=torch.long),
        }
    if return_segments:
        out["segments"] = rows_seg
    return out


class PackedRows(Dataset):
    """Rows of a packed tensor dict; `__getitem__` returns `{name: [S] tensor}`."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


class CachedPackedRows(PackedRows):
    """Packed rows plus their cached target features: `taps` `[S, n*H]` and `teacher_hidden` `[S, H]`
    (storage dtype, zeros on padding), read per row from the teacher cache (never the whole cache)."""

    def __init__(self, tensors: dict[str, torch.Tensor], segments: list, cache: TeacherCache) -> None:
        super().__init__(tensors)
        if len(segments) != len(self):
            raise ValueError(f"{len(segments)} segment lists for {len(self)} packed rows")
        self.segments = segments
        self.cache = cache

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        S = int(item["input_ids"].shape[0])
        taps = torch.zeros(S, self.cache.taps_dim, dtype=self.cache.storage_dtype)
        hidden = torch.zeros(S, self.cache.hidden_size, dtype=self.cache.storage_dtype)
        for src, doc_start, row_start, n in self.segments[i]:
            t, h = self.cache.features(src, n, start=doc_start)
            taps[row_start : row_start + n] = t
            hidden[row_start : row_start + n] = h
        item["taps"] = taps
        item["teacher_hidden"] = hidden
        return item


class EpochShuffleSampler(Sampler[int]):
    """A seeded permutation per epoch (`seed + epoch`): the same order on every run and after a resume.

    `resume_at(epoch, skip)` makes the next iteration of `epoch` start after its first `skip` indices
    (a mid-epoch resume continues with exactly the rows the interrupted run would have seen next).
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = int(n), int(seed), 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        self.epoch = int(epoch)

    def resume_at(self, epoch: int, skip: int) -> None:
        self._resume = (int(epoch), max(0, int(skip)))

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        if self._resume is not None and self._resume[0] == self.epoch:
            order = order[self._resume[1] :]
            self._resume = None
        return iter(order)


# --------------------------------------------------------------------------------------------- module
class DistillDataModule(LightningDataModule):
    """Packed distillation rows from a regenerated folder or a `DocumentSource` (see module docstring).

    Args:
        dataset_path: a regenerated dataset folder (or the regeneration output root); or `documents`.
        regenerate_config: a regeneration (predict) config; if `dataset_path` does not exist,
            `prepare_data` creates it by running that config (module docstring).
        regenerate_overrides: dotted keys of that config to replace, e.g.
            `{"data.init_args.source": "toy:all:train:1200", "model.init_args.target_path": ...}`.
        documents: a `DocumentSource` (by `class_path`) used when there is no `dataset_path`.
        tokenizer_path: a tokenizer folder whose pad id pads the rows of `documents` (default pad: 0).
        domain_weights: per-domain repeat factor applied before the split (missing domains: 1.0).
        seq_len: packed row length.
        split_documents: packing mode (module docstring).
        batch_size: rows per batch.
        val_fraction: fraction of documents held out for validation (at least one document when > 0).
        max_val_rows: cap on packed validation rows (`None` = all).
        pad_token_id: id written into padding (default: the tokenizer's pad id in toy mode, else 0).
        seed: document shuffling, domain re-weighting, the held-out split and the row order.
        num_workers: DataLoader workers.
        teacher_cache: a teacher-cache folder (`teacher_cache.py`): batches then carry the target's cached
            `taps` and `teacher_hidden` and the step does not run the target. `prepare_data` builds it
            (or finishes an interrupted build) with the attached `DistillationModule`'s target when it is
            missing; a cache of another target, taps, dtype or dataset is refused. Needs `dataset_path`
            and `split_documents: false`. `None` (default): the online path.
        teacher_cache_dtype: storage dtype of a new cache: `bfloat16` (default), `float16` or `float32`.
        teacher_cache_shard_mb: approximate shard size of a new cache (what the builder holds in memory).
        teacher_cache_batch_tokens: padded tokens per target forward while building.
        teacher_cache_device: where the target runs while building (default: CUDA when available).
        teacher_cache_taps: target layers a new cache stores (default: the head's `target_layer_ids`). A
            superset lets one cache serve heads with different taps (a tap sweep computes the target
            once); a cache is usable by any head whose layers it holds.
    """

    def __init__(
        self,
        dataset_path: str | None = None,
        regenerate_config: str | None = None,
        regenerate_overrides: dict[str, Any] | None = None,
        documents: DocumentSource | None = None,
        tokenizer_path: str | None = None,
        domain_weights: dict[str, float] | None = None,
        seq_len: int = 256,
        split_documents: bool = True,
        batch_size: int = 8,
        val_fraction: float = 0.02,
        max_val_rows: int | None = 32,
        pad_token_id: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        teacher_cache: str | None = None,
        teacher_cache_dtype: str = DEFAULT_STORAGE_DTYPE,
        teacher_cache_shard_mb: float = 128.0,
        teacher_cache_batch_tokens: int = 4096,
        teacher_cache_device: str | None = None,
        teacher_cache_taps: list[int] | None = None,
    ) -> None:
        super().__init__()
        if dataset_path is not None and documents is not None:
            raise UserInputError("DistillDataModule takes dataset_path or documents, not both")
        if regenerate_config is not None and dataset_path is None:
            raise UserInputError("regenerate_config needs dataset_path (where the regenerated data goes)")
        if seq_len < 2:
            raise UserInputError(f"seq_len must be >= 2, got {seq_len}")
        if batch_size < 1:
            raise UserInputError(f"batch_size must be >= 1, got {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise UserInputError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if teacher_cache is not None:
            if dataset_path is None:
                raise UserInputError(
                    "teacher_cache needs dataset_path: the cache holds the target's features per row of a "
                    "regenerated dataset folder"
                )
            if split_documents:
                raise UserInputError(
                    "teacher_cache needs split_documents: false (a document cut at a row boundary would get "
                    "features computed with context that the online path does not give it)"
                )
            if teacher_cache_dtype not in STORAGE_DTYPES:
                raise UserInputError(
                    f"teacher_cache_dtype must be one of {list(STORAGE_DTYPES)}, got {teacher_cache_dtype!r}"
                )
            if teacher_cache_shard_mb <= 0 or teacher_cache_batch_tokens < 1:
                raise UserInputError("teacher_cache_shard_mb must be > 0 and teacher_cache_batch_tokens >= 1")
        if dataset_path is None and documents is None:
            raise UserInputError(
                "DistillDataModule needs dataset_path (a regenerated folder) or documents (a "
                "DocumentSource, e.g. data_gen.toy.documents.ToyDocuments)"
            )
        # a DocumentSource object would be pickled into checkpoints, which load with weights_only: keep its
        # description instead
        self.save_hyperparameters(ignore=["documents"])
        self.hparams["documents"] = documents.describe() if documents is not None else None
        self.dataset_path = dataset_path
        self.regenerate_config = regenerate_config
        self.regenerate_overrides = dict(regenerate_overrides) if regenerate_overrides else None
        self.tokenizer_path = tokenizer_path
        self.documents = documents
        self.domain_weights = dict(domain_weights) if domain_weights else None
        self.seq_len = int(seq_len)
        self.split_documents = bool(split_documents)
        self.batch_size = int(batch_size)
        self.val_fraction = float(val_fraction)
        self.max_val_rows = max_val_rows
        self.pad_token_id = pad_token_id
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        self.teacher_cache = teacher_cache
        self.teacher_cache_dtype = teacher_cache_dtype
        self.teacher_cache_shard_mb = float(teacher_cache_shard_mb)
        self.teacher_cache_batch_tokens = int(teacher_cache_batch_tokens)
        self.teacher_cache_device = teacher_cache_device
        self.teacher_cache_taps = [int(i) for i in teacher_cache_taps] if teacher_cache_taps else None
        self.train_rows: dict[str, torch.Tensor] | None = None
        self.val_rows: dict[str, torch.Tensor] | None = None
        self.train_segments: list | None = None
        self.val_segments: list | None = None
        self.cache: TeacherCache | None = None
        self._teacher: tuple | None = None
        self._resume: dict | None = None
        self._sampler: EpochShuffleSampler | None = None

    # ------------------------------------------------------------------ data
    def load_documents(self) -> list[dict]:
        if self.dataset_path is not None:
            return load_regenerated(self.dataset_path)
        return self.documents.load()

    def _source_name(self) -> str:
        return str(self.dataset_path) if self.dataset_path is not None else self.documents.describe()

    def _pad_id(self) -> int:
        if self.pad_token_id is not None:
            return int(self.pad_token_id)
        if self.tokenizer_path is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.tokenizer_path), local_files_only=True)
            if tok.pad_token_id is not None:
                return int(tok.pad_token_id)
        return 0

    def prepare_data(self) -> None:
        """Regenerate `dataset_path` with the target when it is missing and `regenerate_config` is set;
        then build (or finish) the teacher cache when `teacher_cache` is set.

        Lightning calls this on one process per node (local rank 0) before `setup` on every rank, so the
        target generates the data (and computes the cache) once; the other ranks wait at the barrier and
        then read it.
        """
        if (
            self.dataset_path is not None
            and self.regenerate_config is not None
            and not dataset_ready(self.dataset_path)
        ):
            if Path(self.dataset_path).exists():
                raise UserInputError(
                    f"dataset_path {self.dataset_path!r} exists but holds no saved dataset; delete it to "
                    "regenerate, or point dataset_path elsewhere"
                )
            regenerate_dataset(self.regenerate_config, self.dataset_path, self.regenerate_overrides)
        if self.teacher_cache is not None:
            self.build_teacher_cache()

    # ------------------------------------------------------------------ teacher cache
    def attach_teacher(self, target, target_path: str | Path) -> None:
        """Name the target (a `TargetModel` tapping the head's layers) the cache is built from / checked
        against, when no trainer with a `DistillationModule` is attached (scripts, benchmarks)."""
        self._teacher = (target, str(target_path))

    def _teacher_source(self) -> tuple:
        if self._teacher is not None:
            return self._teacher
        trainer = getattr(self, "trainer", None)
        module = trainer.lightning_module if trainer is not None else None
        source = getattr(module, "teacher_source", None)
        if source is None:
            raise UserInputError(
                "teacher_cache: no target to build or check the cache with (attach a DistillationModule "
                "through the Trainer, or call attach_teacher(target, target_path))"
            )
        return source()

    def expected_fingerprint(self) -> dict:
        """The fingerprint a usable cache must carry: this dataset, the target, its taps and dtypes."""
        target, target_path = self._teacher_source()
        ds = open_regenerated(self.dataset_path)
        return cache_fingerprint(
            target_path, target.tap_layer_ids, target.dtype, self.teacher_cache_dtype, dataset_identity(ds)
        )

    def build_teacher_cache(self, progress: bool = True):
        """Build or finish `teacher_cache` (a no-op when complete and matching); returns `BuildStats`."""
        target, target_path = self._teacher_source()
        device = self.teacher_cache_device
        if device is None and torch.cuda.is_available():
            device = "cuda"
        head_taps = list(target.tap_layer_ids)
        cache_taps = self.teacher_cache_taps or head_taps
        missing = [i for i in head_taps if i not in cache_taps]
        if missing:
            raise UserInputError(
                f"teacher_cache_taps {cache_taps} lacks the head's target_layer_ids {missing}: the cache must "
                "hold every layer the head taps"
            )
        rank_zero_info(f"[DistillDataModule] teacher cache {self.teacher_cache!r}: checking / building")
        target.set_taps(cache_taps)
        try:
            stats = build_teacher_cache(
                self.teacher_cache,
                target,
                target_path,
                open_regenerated(self.dataset_path),
                storage_dtype=self.teacher_cache_dtype,
                shard_mb=self.teacher_cache_shard_mb,
                batch_tokens=self.teacher_cache_batch_tokens,
                device=device,
                progress=progress,
            )
        finally:
            target.set_taps(head_taps)
        if stats.shards_built:
            rank_zero_info(
                f"[DistillDataModule] teacher cache {self.teacher_cache!r}: {stats.shards_built} of "
                f"{stats.shards_total} shards, {stats.tokens_built} tokens in {stats.seconds:.1f} s "
                f"({stats.tokens_per_s:.0f} tokens/s)"
            )
        return stats

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        docs = self.load_documents()
        if not docs:
            raise UserInputError(
                f"no documents in {self._source_name()}: the dataset is empty (or the source yields none)"
            )
        n_resp = sum(1 for d in docs for m in d["loss_mask"] if m)
        if n_resp == 0:
            raise UserInputError(
                f"the dataset {self._source_name()} has {len(docs)} documents but no "
                "response tokens (loss_mask is 0 everywhere): nothing to distill; regenerate the responses"
            )
        docs = apply_domain_weights(docs, self.domain_weights, self.seed)
        # hold out whole documents (after weighting a repeated document could straddle the split, so
        # split the distinct documents first)
        distinct: dict[int, int] = {}
        for i, d in enumerate(docs):
            distinct.setdefault(id(d), i)
        keys = sorted(distinct.values())
        rng = random.Random(self.seed)
        n_val = 0
        if self.val_fraction > 0:
            n_val = min(max(1, int(round(self.val_fraction * len(keys)))), len(keys) - 1)
        val_keys = set(rng.sample(keys, n_val)) if n_val else set()
        val_ids = {id(docs[i]) for i in val_keys}
        train_docs = [d for d in docs if id(d) not in val_ids]
        val_docs = [docs[i] for i in sorted(val_keys)]
        rng.shuffle(train_docs)
        pad = self._pad_id()
        cached = self.teacher_cache is not None
        self.train_rows = pack_documents(train_docs, self.seq_len, pad, self.split_documents, cached)
        self.val_rows = pack_documents(val_docs, self.seq_len, pad, self.split_documents, cached)
        if cached:
            self.train_segments = self.train_rows.pop("segments")
            self.val_segments = self.val_rows.pop("segments")
        if self.max_val_rows is not None:
            self.val_rows = {k: v[: int(self.max_val_rows)] for k, v in self.val_rows.items()}
            if cached:
                self.val_segments = self.val_segments[: int(self.max_val_rows)]
        if cached:
            self.cache = TeacherCache(self.teacher_cache, self.expected_fingerprint())
        if len(PackedRows(self.train_rows)) == 0:
            raise UserInputError("no training rows after packing (every document went to validation)")

    def stats(self) -> dict[str, float]:
        """Rows and token usage of the packed training set (after `setup`)."""
        if self.train_rows is None:
            raise RuntimeError("call setup() first")
        lm = self.train_rows["loss_mask"]
        return {
            "train_rows": int(lm.shape[0]),
            "val_rows": int(self.val_rows["loss_mask"].shape[0]),
            "loss_tokens": int(lm.sum()),
            "loss_token_fraction": float(lm.float().mean()) if lm.numel() else 0.0,
        }

    # ------------------------------------------------------------------ loaders
    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: where in which epoch training stood (for a mid-epoch resume)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or self._sampler is None:
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": self._sampler.epoch, "batches_done": int(done), "seed": self.seed}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict) if state_dict else None

    def _rows(self, tensors: dict[str, torch.Tensor], segments: list | None) -> PackedRows:
        if self.cache is None:
            return PackedRows(tensors)
        return CachedPackedRows(tensors, segments, self.cache)

    def train_dataloader(self) -> DataLoader:
        ds = self._rows(self.train_rows, self.train_segments)
        sampler = EpochShuffleSampler(len(ds), self.seed)
        if self._resume and self._resume.get("seed", self.seed) == self.seed:
            sampler.resume_at(self._resume["epoch"], self._resume["batches_done"] * self.batch_size)
            self._resume = None
        self._sampler = sampler
        return DataLoader(
            ds,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=False,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_rows is None or self.val_rows["input_ids"].shape[0] == 0:
            return []
        return DataLoader(
            self._rows(self.val_rows, self.val_segments),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
        )
