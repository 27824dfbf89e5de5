"""Crash-safe output for regeneration: shards written atomically, a manifest, resume, the final merge.

`RegenerationWriter` (a `BasePredictionWriter`) buffers finished samples and flushes a shard every
`shard_size` samples: the parquet file is written under a temp name, fsynced, then renamed, so a shard
either exists whole or not at all. The shards are the source of truth: on start the writer reads the ids
of every shard (a rerun skips them) and rewrites the per-rank manifests to match. Under DDP every rank
writes its own shards and manifest; at the end rank 0 merges all shards into `<out>/dataset`, each id once.

`run.json` fingerprints the run (target path and config, tokenizer, generation and data settings); a
folder holding another run's data (or anything else) is refused before a byte is written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pyarrow.parquet as pq
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, TQDMProgressBar

from data_gen.regenerate.prompts import stable_hash
from data_gen.regenerate.schema import ARROW_SCHEMA, make_row, rows_to_table
from jetflow_pl.errors import UserInputError
from jetflow_pl.files import atomic_write_bytes, fsync_dir, stale_temporaries

FORMAT_VERSION = 1

# Batches arrive pre-collated (DataLoader(batch_size=None)); the writer keys rows by sample id, not by
# dataloader index, so Lightning's notice that it cannot infer batch indices is noise here.
warnings.filterwarnings("ignore", message="Couldn't infer the batch indices")


class OutputFolderError(UserInputError):
    """The output folder cannot be used by this run (another run's data, unreadable shard, ...)."""


def is_disk_full(err: BaseException) -> bool:
    """True for "no space left" and "quota exceeded": the errors a rerun after freeing space fixes."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def write_shard_file(rows: list[dict], path: Path) -> None:
    """Write `rows` as one parquet file at `path` and fsync it (the step a full disk breaks)."""
    pq.write_table(rows_to_table(rows), path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def shard_ids(path: Path) -> list[str]:
    """Ids held by one shard (raises OutputFolderError when the file is not a readable shard)."""
    try:
        return [str(x) for x in pq.read_table(path, columns=["id"]).column("id").to_pylist()]
    except Exception as err:
        raise OutputFolderError(
            f"shard {path} is unreadable ({type(err).__name__}: {err}); remove it"
        ) from err


def list_shards(out: Path) -> list[Path]:
    d = out / "shards"
    return sorted(p for p in d.glob("shard-*.parquet") if p.is_file()) if d.is_dir() else []


def merge_shards(out: Path) -> int:
    """Merge every shard into `<out>/dataset` (each id once, sorted by id); returns the row count."""
    import datasets
    import pyarrow as pa

    shards = list_shards(out)
    tables = [pq.read_table(p, schema=ARROW_SCHEMA) for p in shards]
    table = pa.concat_tables(tables) if tables else ARROW_SCHEMA.empty_table()
    ids = table.column("id").to_pylist()
    first: dict[str, int] = {}
    for i, sid in enumerate(ids):
        first.setdefault(sid, i)
    order = sorted(first, key=lambda s: s)
    table = table.take(pa.array([first[s] for s in order], type=pa.int64()))
    ds = datasets.Dataset(table)
    tmp = out / f".tmp-dataset-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    ds.save_to_disk(str(tmp))
    final = out / "dataset"
    old = out / f".old-dataset-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(out)
    if old.exists():
        shutil.rmtree(old)
    return len(order)


class RegenerationWriter(BasePredictionWriter):
    """Writes `RegenerationModule` predictions to `output_dir` (layout in `data_gen.regenerate.schema`).

    Args:
        output_dir: the run folder (created; refused when it holds another run's data).
        shard_size: samples per shard (a crash loses at most this many samples per rank).
        merge: build `<out>/dataset` at the end of the run.
    """

    def __init__(self, output_dir: str, shard_size: int = 256, merge: bool = True) -> None:
        super().__init__(write_interval="batch")
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out = Path(output_dir)
        self.shard_size = shard_size
        self.merge = merge
        self._buffer: list[dict] = []
        self._buffer_ids: list[str] = []
        self._attempt = f"{int(time.time() * 1000):x}-{os.getpid()}"
        self._seq = 0
        self._rank = 0
        self._failed_run = False
        self.counts = {
            "written": 0,
            "truncated": 0,
            "failed": 0,
            "new_tokens": 0,
            "turns": 0,
            "cut_by_context": 0,
        }
        self._t0 = 0.0
        self.summary: dict | None = None

    # ------------------------------------------------------------------ setup: fingerprint + resume
    def run_fingerprint(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        module = pl_module.fingerprint()
        data = trainer.datamodule.fingerprint() if trainer.datamodule is not None else {}
        body = {"format_version": FORMAT_VERSION, "model": module, "data": data}
        return {
            "format_version": FORMAT_VERSION,
            "target_path": module.get("target_path"),
            "source": data.get("source"),
            "config_hash": stable_hash(body),
            "settings": json.loads(json.dumps(body, default=str)),
        }

    def _check_or_create(self, fp: dict) -> None:
        out = self.out
        run_file = out / "run.json"
        if out.exists() and not out.is_dir():
            raise OutputFolderError(f"output_dir {out} exists and is not a folder")
        if out.is_dir() and any(out.iterdir()):
            if not run_file.is_file():
                raise OutputFolderError(
                    f"output_dir {out} is not empty and holds no run.json: it is not a regeneration run "
                    "folder; choose another output_dir"
                )
            try:
                old = json.loads(run_file.read_text())
            except (OSError, ValueError) as err:
                raise OutputFolderError(f"output_dir {out}: run.json is unreadable ({err})") from err
            if old.get("config_hash") != fp["config_hash"]:
                raise OutputFolderError(
                    f"output_dir {out} holds another run's data (target {old.get('target_path')}, source "
                    f"{old.get('source')}, config hash {old.get('config_hash')}; this run: target "
                    f"{fp['target_path']}, source {fp['source']}, config hash {fp['config_hash']}); "
                    "choose a new output_dir or delete that folder"
                )
            return
        (out / "shards").mkdir(parents=True, exist_ok=True)
        (out / "manifest").mkdir(exist_ok=True)
        atomic_write_bytes(run_file, (json.dumps(fp, indent=2, sort_keys=True) + "\n").encode())

    def _reconcile(self) -> dict[str, list[str]]:
        """Rank 0: drop temp files, rebuild the manifests from the shards (the truth)."""
        for d in (self.out, self.out / "shards"):
            for tmp in stale_temporaries(d):
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        by_shard = {p.name: shard_ids(p) for p in list_shards(self.out)}
        per_rank: dict[str, list[str]] = {}
        for name, ids in by_shard.items():
            rank = name.split("-")[1]  # shard-r00000-<attempt>-<seq>.parquet
            per_rank.setdefault(rank, []).append(json.dumps({"shard": name, "ids": ids}))
        mdir = self.out / "manifest"
        mdir.mkdir(exist_ok=True)
        for f in mdir.glob("*.jsonl"):
            if f.stem not in per_rank:
                f.unlink()
        for rank, lines in per_rank.items():
            atomic_write_bytes(mdir / f"{rank}.jsonl", ("\n".join(lines) + "\n").encode())
        return by_shard

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        self._rank = trainer.global_rank
        # every row goes to disk here; keeping all predictions in memory as well would grow without bound
        trainer.predict_loop.return_predictions = False
        fp = self.run_fingerprint(trainer, pl_module)
        if trainer.is_global_zero:
            self._check_or_create(fp)
            self._reconcile()
        trainer.strategy.barrier("regenerate-setup")
        if not trainer.is_global_zero:
            self._check_or_create(fp)
        done: set[str] = set()
        for p in list_shards(self.out):
            done.update(shard_ids(p))
        if trainer.datamodule is not None:
            trainer.datamodule.exclude_ids = done
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ writing
    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        for rec in prediction["records"]:
            self._buffer.append(
                make_row(
                    rec["id"],
                    rec["domain"],
                    rec["prompt_ids"],
                    rec["response_ids"],
                    rec["text"],
                    rec["finish_reason"],
                    rec.get("loss_mask"),
                )
            )
            self.counts["truncated"] += int(rec["truncated"])
            self.counts["turns"] += int(rec.get("turns", 1))
            self.counts["cut_by_context"] += int(bool(rec.get("cut_by_context", False)))
        self.counts["failed"] += len(prediction["failed"])
        self.counts["new_tokens"] += int(prediction["new_tokens"])
        if prediction["failed"]:
            with open(self.out / f"failed-r{self._rank:05d}.jsonl", "a") as f:
                for item in prediction["failed"]:
                    f.write(json.dumps(item) + "\n")
        while len(self._buffer) >= self.shard_size:
            self.flush(self.shard_size)

    def flush(self, n: int | None = None) -> None:
        """Write the first `n` buffered rows (all by default) as one shard: temp file, fsync, rename."""
        rows = self._buffer[: n if n is not None else len(self._buffer)]
        if not rows:
            return
        name = f"shard-r{self._rank:05d}-{self._attempt}-{self._seq:06d}.parquet"
        final = self.out / "shards" / name
        tmp = final.with_name(f".tmp-{name}")
        try:
            write_shard_file(rows, tmp)
        except OSError as err:
            # the half-written temp file is never renamed, so no finished shard is touched; remove it
            # (freeing the space it took) and say what is safe and how to go on
            tmp.unlink(missing_ok=True)
            if is_disk_full(err):
                done = len(list_shards(self.out))
                raise OutputFolderError(
                    f"disk full while writing shard {name} in {self.out / 'shards'} ({err.strerror}): "
                    f"the {done} shard(s) written before it are intact and its {len(rows)} rows were not "
                    "written; free space and rerun the same command to resume"
                ) from err
            raise
        os.replace(tmp, final)
        fsync_dir(final.parent)
        try:
            with open(self.out / "manifest" / f"r{self._rank:05d}.jsonl", "a") as f:
                f.write(json.dumps({"shard": name, "ids": [r["id"] for r in rows]}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            if not is_disk_full(err):
                raise
            # the shard itself is complete; manifests are rebuilt from the shards on the next start
            raise OutputFolderError(
                f"disk full while updating the manifest after shard {name} ({err.strerror}): every shard "
                f"in {self.out / 'shards'} is intact; free space and rerun the same command to resume"
            ) from err
        self._seq += 1
        self.counts["written"] += len(rows)
        del self._buffer[: len(rows)]

    # ------------------------------------------------------------------ end of run
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._failed_run = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "predict" or self._failed_run or not self.out.is_dir():
            return
        self.flush()
        strategy = trainer.strategy
        counts = {
            k: int(strategy.reduce(torch.tensor(float(v), device=strategy.root_device), reduce_op="sum"))
            for k, v in self.counts.items()
        }
        strategy.barrier("regenerate-merge")
        if not trainer.is_global_zero:
            return
        dm = trainer.datamodule
        stats = getattr(dm, "stats", None)
        seconds = time.perf_counter() - self._t0
        try:
            rows = merge_shards(self.out) if self.merge else None
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise OutputFolderError(
                f"disk full while merging {self.out / 'dataset'} ({err.strerror}): every shard in "
                f"{self.out / 'shards'} is intact; free space and rerun the same command (nothing is "
                "regenerated, only the merge runs again)"
            ) from err
        summary = {
            "written": counts["written"],
            "skipped": (stats.already_done + stats.overlong_skipped) if stats else 0,
            "skipped_already_done": stats.already_done if stats else 0,
            "skipped_overlong": stats.overlong_skipped if stats else 0,
            "truncated": counts["truncated"],
            "failed": counts["failed"],
            "new_tokens": counts["new_tokens"],
            "seconds": round(seconds, 3),
            "tokens_per_s": round(counts["new_tokens"] / seconds, 2) if seconds > 0 else 0.0,
            "dataset_rows": rows,
            "dataset": str(self.out / "dataset") if self.merge else None,
            "turns": counts["turns"],
            "conversations_cut_by_context": counts["cut_by_context"],
        }
        if stats is not None and "source" in stats.extra:
            summary["source"] = stats.extra["source"]
        atomic_write_bytes(self.out / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
        self.summary = summary
        print(
            f"regenerate: written={summary['written']} skipped={summary['skipped']} "
            f"(already done {summary['skipped_already_done']}, over-long {summary['skipped_overlong']}) "
            f"truncated={summary['truncated']} failed={summary['failed']} | {summary['new_tokens']} tokens "
            f"in {seconds:.1f}s ({summary['tokens_per_s']:.1f} tok/s) | dataset: {rows} rows in "
            f"{self.out / 'dataset'}",
            flush=True,
        )
        if counts["turns"] > counts["written"] or counts["cut_by_context"]:
            print(
                f"regenerate: {counts['turns']} turns answered in {counts['written']} conversations; "
                f"{counts['cut_by_context']} ended early because the next turn would not fit the context cap",
                flush=True,
            )


class RegenerationProgressBar(TQDMProgressBar):
    """The predict bar counts samples (not batches) and shows generated tokens/s."""

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._samples = 0
        self._tokens = 0
        self._start = 0.0

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        dm = trainer.datamodule
        total = getattr(getattr(dm, "stats", None), "pending", None)
        if trainer.world_size > 1 or total is None:
            total = None
        bar = self.predict_progress_bar
        bar.reset()
        bar.total = total
        bar.initial = 0
        bar.unit = "samples"
        bar.set_description("Regenerating")
        self._samples = self._tokens = 0
        self._start = time.perf_counter()

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._samples += len(outputs["records"]) + len(outputs["failed"])
        self._tokens += int(outputs["new_tokens"])
        bar = self.predict_progress_bar
        if bar is None:
            return
        bar.n = self._samples
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        bar.set_postfix({"tok/s": f"{self._tokens / elapsed:.1f}"}, refresh=False)
        bar.refresh()
