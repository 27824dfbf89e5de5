"""The teacher cache (jetflow_pl/training/teacher_cache.py): the cached path trains exactly what the online
path trains, a killed build resumes to the same cache, foreign caches and dtype overflows are refused with
one line, and neither building nor reading holds more than about one shard in memory.

Real components throughout: the toy `tiny` target (2 layers, hidden 64, vocab 96) saved to disk, real
`datasets` folders in the regeneration schema, real safetensors shards, a real Lightning fit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from fake_rows import random_rows
from lightning.pytorch import Callback, Trainer

from jetflow_pl.errors import UserInputError
from jetflow_pl.training.anchors import sample_anchors
from jetflow_pl.training.data import DistillDataModule, open_regenerated
from jetflow_pl.training.masks import document_positions
from jetflow_pl.training.module import DistillationModule
from jetflow_pl.training.step import distill_step, target_features
from jetflow_pl.training.teacher_cache import (
    TeacherCache,
    TeacherCacheError,
    TeacherCacheOverflowError,
    build_teacher_cache,
    staging_path,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96  # conftest.TINY_VOCAB
MASK_ID = 2  # toy convention: 0 pad, 1 eos, 2 mask
TAPS = [1, 0]  # both layers of the tiny target, in a non-sorted order: the cache must keep the head's order


def _docs(n: int, seed: int = 0, max_resp: int = 30) -> list[dict]:
    return random_rows(n, VOCAB, seed, response_len=(8, max_resp))


def _save(docs: list[dict], root: Path) -> Path:
    from datasets import Dataset

    Dataset.from_list(docs).save_to_disk(str(root / "dataset"))
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(_docs(60), tmp_path_factory.mktemp("regen"))


def _module(target_dir: Path, **kw) -> DistillationModule:
    args = dict(
        target_path=str(target_dir),
        block_size=4,
        mask_token_id=MASK_ID,
        num_anchors=4,
        target_layer_ids=TAPS,
        lr=1e-3,
        warmup_steps=1,
        seed=0,
    )
    args.update(kw)
    return DistillationModule(**args)


def _data(dataset_dir: Path, cache: Path | None, **kw) -> DistillDataModule:
    args = dict(
        dataset_path=str(dataset_dir),
        seq_len=64,
        batch_size=3,
        val_fraction=0.1,
        max_val_rows=2,
        split_documents=False,
        teacher_cache=None if cache is None else str(cache),
        teacher_cache_dtype="float32",
        teacher_cache_shard_mb=0.1,
    )
    args.update(kw)
    return DistillDataModule(**args)


def _build(cache: Path, module: DistillationModule, dataset_dir: Path, **kw):
    target, target_path = module.teacher_source()
    args = dict(storage_dtype="float32", shard_mb=0.1, progress=False)
    args.update(kw)
    return build_teacher_cache(cache, target, target_path, open_regenerated(dataset_dir), **args)


def _shard_tensors(cache: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted((cache / "shards").glob("*.safetensors"))}


def _assert_same_cache(a: Path, b: Path) -> None:
    meta_a, meta_b = (json.loads((p / "cache.json").read_text()) for p in (a, b))
    for key in ("format", "version", "complete", "fingerprint", "layout", "shards"):
        assert meta_a[key] == meta_b[key], key
    ta, tb = _shard_tensors(a), _shard_tensors(b)
    assert sorted(ta) == sorted(tb) == [sh["file"] for sh in meta_a["shards"]]
    for name in ta:
        assert torch.equal(ta[name]["offsets"], tb[name]["offsets"]), name
        # the same fp32 forward of the same documents on the same machine; allow last-bit differences
        # (thread scheduling), far below anything a wrong row, document or position would produce (O(1))
        for key in ("taps", "hidden"):
            torch.testing.assert_close(ta[name][key], tb[name][key], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ equality
def test_compute_features_equals_a_forward_over_each_document_alone(tiny_target_dir: Path) -> None:
    from jetflow_pl.target import TargetModel
    from jetflow_pl.training.teacher_cache import compute_features

    target = TargetModel.from_pretrained(tiny_target_dir, tap_layer_ids=TAPS)
    rng = random.Random(2)
    docs = [[rng.randint(3, VOCAB - 1) for _ in range(n)] for n in (17, 0, 5, 40, 1, 23, 40, 9)]
    got = {i: (t, h) for i, t, h in compute_features(target, docs, batch_tokens=64)}  # several batches
    assert sorted(got) == list(range(len(docs)))
    for i, ids in enumerate(docs):
        t, h = got[i]
        assert t.shape == (len(ids), 2 * target.hidden_size) and h.shape == (len(ids), target.hidden_size)
        if not ids:
            continue
        ref = target(torch.tensor([ids]), logits_positions=None, return_hidden=True, use_cache=False)
        # a padded batch row vs the document alone: the same fp32 function up to rounding
        torch.testing.assert_close(t, ref.taps[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, ref.hidden[0], rtol=1e-5, atol=1e-5)


def test_cached_features_loss_and_grads_equal_the_online_path(
    tiny_target_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    module = _module(tiny_target_dir)
    dm = _data(dataset, tmp_path / "cache")
    dm.attach_teacher(*module.teacher_source())
    stats = dm.build_teacher_cache(progress=False)
    assert stats.shards_total > 5 and stats.shards_built == stats.shards_total  # several shards exercised
    dm.setup("fit")
    target, head = module.target, module.head
    checked_rows = 0
    rows = dm.train_dataloader().dataset
    for batch in torch.utils.data.DataLoader(rows, batch_size=3):  # in row order, to match the segments
        ids, lm, doc = batch["input_ids"], batch["loss_mask"], batch["doc_ids"]
        B, S = ids.shape
        taps, hidden = target_features(target, ids, doc, document_positions(doc, B, S))
        real = torch.zeros(B, S, dtype=torch.bool)  # positions that hold a document (not the padding tail)
        for b, segs in enumerate(dm.train_segments[checked_rows : checked_rows + B]):
            for _, _, start, n in segs:
                real[b, start : start + n] = True
        # per-document fp32 forward (cache) vs one packed forward (online): same function, different
        # matmul shapes, so only rounding differs (~1e-7 relative per op over 2 layers)
        torch.testing.assert_close(batch["taps"][real], taps[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch["teacher_hidden"][real], hidden[real], rtol=1e-5, atol=1e-5)
        assert not batch["taps"][~real].any()
        checked_rows += B
    assert checked_rows == len(dm.train_segments)

    batch = next(iter(dm.train_dataloader()))
    ids, lm, doc = batch["input_ids"], batch["loss_mask"], batch["doc_ids"]
    anchors = sample_anchors(lm, doc, head.block_size, 4, torch.Generator().manual_seed(3))
    results = {}
    for path in ("online", "cached"):
        head.zero_grad(set_to_none=True)
        extra = {"taps": batch["taps"], "teacher_hidden": batch["teacher_hidden"]} if path == "cached" else {}
        out = distill_step(target, head, ids, lm, doc, num_anchors=4, chunk_size=7, anchors=anchors, **extra)
        out["loss"].backward()
        results[path] = (out, {n: p.grad.clone() for n, p in head.named_parameters()})
    (on, g_on), (ca, g_ca) = results["online"], results["cached"]
    assert on["num_rows"] == ca["num_rows"] > 0
    assert torch.equal(on["agree_correct"], ca["agree_correct"])
    # inputs agree to ~1e-6 (above); loss and grads are smooth functions of them through one head layer
    # and the lm_head, so they agree to the same order; a misaligned teacher row or tap moves them by O(1)
    torch.testing.assert_close(ca["loss"], on["loss"], rtol=1e-5, atol=1e-6)
    for name in g_on:
        torch.testing.assert_close(g_ca[name], g_on[name], rtol=1e-4, atol=1e-6, msg=name)


class _Record(Callback):
    """Train losses per step, and how often the target's first layer ran before / during training."""

    def __init__(self, layer_calls: list) -> None:
        self.losses: list[float] = []
        self.calls = layer_calls
        self.calls_at_start = self.calls_at_end = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self.calls_at_start = len(self.calls)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.calls_at_end = len(self.calls)


def _trainer(root: Path, steps: int, callbacks=()) -> Trainer:
    return Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=steps,
        default_root_dir=str(root),
        callbacks=list(callbacks),
    )


def test_fit_on_the_cache_builds_it_never_runs_the_target_and_tracks_online(
    tiny_target_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    runs = {}
    for path in ("online", "cached", "cached_again"):
        module = _module(tiny_target_dir)
        rec = _Record([])
        module.teacher_source()[0].layers[0].register_forward_hook(
            lambda *a, calls=rec.calls: calls.append(1)
        )
        trainer = _trainer(tmp_path / path, 4, [rec])
        trainer.fit(module, datamodule=_data(dataset, None if path == "online" else cache))
        runs[path] = (rec, trainer.callback_metrics)
    assert (cache / "cache.json").is_file() and not staging_path(cache).exists()  # built by prepare_data
    (on, _), (ca, ca_metrics), (again, _) = runs["online"], runs["cached"], runs["cached_again"]
    assert on.calls_at_end - on.calls_at_start >= 4  # online: one target forward per step at least
    assert ca.calls_at_start > 0  # the first cached run built the cache (in prepare_data)...
    assert ca.calls_at_end == ca.calls_at_start  # ...and never ran the target while training/validating
    assert again.calls_at_end == 0  # a complete cache: no target forward at all
    assert "val/sim_tau" in ca_metrics and "val/loss" in ca_metrics
    # step 1 sees identical weights: loss equal to rounding; AdamW then normalizes ~1e-7 gradient
    # differences, so later steps drift apart slightly but stay far closer than a changed teacher would
    assert ca.losses[0] == pytest.approx(on.losses[0], rel=1e-5)
    assert ca.losses == pytest.approx(on.losses, rel=1e-3)
    assert again.losses == pytest.approx(ca.losses, rel=1e-5)


# ------------------------------------------------------------------------------------------ resume
def test_crash_mid_build_resumes_to_the_uninterrupted_cache(
    tiny_target_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    module = _module(tiny_target_dir)
    ref = _build(tmp_path / "ref", module, dataset)

    class Crash(RuntimeError):
        pass

    def crash_after_three(i: int, path: Path) -> None:
        if i == 2:
            # a half-written shard of the next step, as a kill during `save_file` would leave it
            (path.parent / f".tmp-99999-{path.name.replace('00002', '00003')}").write_bytes(b"\0" * 100)
            raise Crash

    cache = tmp_path / "cache"
    with pytest.raises(Crash):
        _build(cache, module, dataset, on_shard_written=crash_after_three)
    stage = staging_path(cache)
    assert not cache.exists() and (stage / "cache.json").is_file()  # never looks finished
    with pytest.raises(TeacherCacheError, match="unfinished build"):
        TeacherCache(cache)
    done = {p.name: p.stat().st_mtime_ns for p in (stage / "shards").glob("shard-*")}
    assert len(done) == 3

    again = _build(cache, module, dataset, shard_mb=50.0)  # a changed shard_mb keeps the started plan
    assert again.shards_built == ref.shards_total - 3
    assert not stage.exists() and not list((cache / "shards").glob(".tmp-*"))
    for name, mtime in done.items():  # finished shards were kept, not recomputed
        assert (cache / "shards" / name).stat().st_mtime_ns == mtime
    _assert_same_cache(cache, tmp_path / "ref")
    assert _build(cache, module, dataset).shards_built == 0  # complete: a no-op


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    from jetflow_pl.target import TargetModel
    from jetflow_pl.training.data import open_regenerated
    from jetflow_pl.training.teacher_cache import build_teacher_cache
    target = TargetModel.from_pretrained(sys.argv[1], tap_layer_ids=[1, 0])
    build_teacher_cache(sys.argv[3], target, sys.argv[1], open_regenerated(sys.argv[2]),
                        storage_dtype="float32", shard_mb=0.02, progress=False)
    """
)


def test_sigkill_mid_build_then_rerun_gives_the_same_cache(tiny_target_dir: Path, tmp_path: Path) -> None:
    data = _save(_docs(120, seed=5), tmp_path / "data")  # ~120 shards: the kill lands mid-build
    module = _module(tiny_target_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cache = tmp_path / "cache"
    stage = staging_path(cache)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(tiny_target_dir), str(data), str(cache)],
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len(list((stage / "shards").glob("shard-*"))) >= 10:
            break
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.05))
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert alive, f"the build finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    assert not cache.exists()
    killed_with = len(list((stage / "shards").glob("shard-*")))
    stats = _build(cache, module, data, shard_mb=0.02)
    assert (
        0 < stats.shards_built < stats.shards_total and stats.shards_built == stats.shards_total - killed_with
    )
    _build(tmp_path / "ref", module, data, shard_mb=0.02)
    _assert_same_cache(cache, tmp_path / "ref")


# ------------------------------------------------------------------------------------------ refusals
def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_a_cache_of_another_target_taps_data_or_dtype_is_refused(
    tiny_target_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    from data_gen.toy.target_trainer import build_tiny_target

    cache = tmp_path / "cache"
    _build(cache, _module(tiny_target_dir), dataset)
    TeacherCache(cache)  # fine as it is

    # a head tapping a subset of the cached layers uses the cache (no rebuild); a layer the cache lacks is
    # refused (test_a_cache_of_more_layers_serves_a_head_tapping_a_subset)
    subset = _module(tiny_target_dir, target_layer_ids=[0])
    assert _build(cache, subset, dataset).shards_built == 0

    other_target = Path(build_tiny_target(str(tmp_path / "other_target"), vocab_size=VOCAB, seed=1))
    with pytest.raises(TeacherCacheError, match="another target weights") as err:
        _build(cache, _module(other_target), dataset)
    _one_line(err)

    docs = _docs(60)
    docs[17]["input_ids"][5] = (docs[17]["input_ids"][5] + 1) % VOCAB  # one token differs
    changed = _save(docs, tmp_path / "changed")
    with pytest.raises(TeacherCacheError, match=r"another dataset \(input_ids\)") as err:
        _build(cache, _module(tiny_target_dir), changed)
    _one_line(err)

    with pytest.raises(TeacherCacheError, match="another storage dtype") as err:
        _build(cache, _module(tiny_target_dir), dataset, storage_dtype="bfloat16")
    _one_line(err)

    # the same refusal when training is set up on it (every rank checks in `setup`)
    dm = _data(changed, cache)
    dm.attach_teacher(*_module(tiny_target_dir).teacher_source())
    with pytest.raises(TeacherCacheError, match="another dataset"):
        dm.setup("fit")

    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(TeacherCacheError, match="is not a teacher cache"):
        _build(tmp_path / "junk", _module(tiny_target_dir), dataset)


def test_bad_cache_settings_fail_clearly(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="split_documents: false"):
        _data(dataset, tmp_path / "c", split_documents=True)
    with pytest.raises(UserInputError, match="needs dataset_path"):
        DistillDataModule(
            tokenizer_path=str(tmp_path), teacher_cache=str(tmp_path / "c"), split_documents=False
        )
    with pytest.raises(UserInputError, match="teacher_cache_dtype must be one of"):
        _data(dataset, tmp_path / "c", teacher_cache_dtype="int8")
    dm = _data(dataset, tmp_path / "c")
    with pytest.raises(UserInputError, match="no target to build or check the cache with"):
        dm.prepare_data()


def test_a_value_beyond_the_storage_dtype_is_refused_and_nothing_is_left(
    tiny_target_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    # the tiny target with a final-norm gain of 3e5: its final hidden states (|h| ~ 1e5) exceed float16's
    # 65504, as the ~2.5e4 residual channels of SmolLM2 would in a slightly larger model
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir))
    with torch.no_grad():
        model.model.norm.weight.fill_(3e5)
    big = tmp_path / "big_target"
    model.save_pretrained(str(big))
    module = _module(big, target_layer_ids=[0])  # the tap (layer 0's output) is not scaled, the hidden is
    cache = tmp_path / "cache"
    with pytest.raises(TeacherCacheOverflowError, match="beyond float16's largest value 65504") as err:
        _build(cache, module, dataset, storage_dtype="float16")
    msg = _one_line(err)
    assert "final hidden state" in msg and "bfloat16" in msg
    assert not cache.exists() and not staging_path(cache).exists()
    _build(cache, module, dataset, storage_dtype="bfloat16")  # float32's range: fits
    hidden = TeacherCache(cache).features(0)[1]
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden.float()).all()
    assert float(hidden.float().abs().max()) > 65504


# ------------------------------------------------------------------------------------------ memory
_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from jetflow_pl.target import TargetModel
    from jetflow_pl.training.data import open_regenerated
    from jetflow_pl.training.teacher_cache import TeacherCache, build_teacher_cache

    def kib(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])

    target = TargetModel.from_pretrained(sys.argv[1], tap_layer_ids=[1, 0])
    ds = open_regenerated(sys.argv[2])
    with torch.no_grad():  # warm up the allocator and the kernels on one document
        target(torch.tensor([ds[0]["input_ids"]]), logits_positions=None, return_hidden=True, use_cache=False)
    Path("/proc/self/clear_refs").write_text("5")
    base = kib("VmRSS")
    stats = build_teacher_cache(sys.argv[3], target, sys.argv[1], ds, storage_dtype="float32",
                                shard_mb=float(sys.argv[4]), batch_tokens=2048, progress=False)
    build_peak = kib("VmHWM") - base
    cache = TeacherCache(sys.argv[3])
    Path("/proc/self/clear_refs").write_text("5")
    base = kib("VmRSS")
    order = torch.randperm(cache.num_rows, generator=torch.Generator().manual_seed(0)).tolist()
    total = 0
    for row in order:
        taps, hidden = cache.features(row)
        total += taps.numel() + hidden.numel()
    read_peak = kib("VmHWM") - base
    print(json.dumps({"build_peak_kib": build_peak, "read_peak_kib": read_peak, "floats": total,
                      "max_shard_bytes": stats.max_shard_bytes, "shards": stats.shards_total}))
    """
)


def test_building_and_reading_hold_about_one_shard_not_the_cache(
    tiny_target_dir: Path, tmp_path: Path
) -> None:
    # 1200 documents of ~300 tokens x (2 taps + hidden) x 64 floats: a ~280 MiB fp32 cache in 4 MiB shards.
    # A builder or reader that kept the cache (or a growing part of it) would add >= 140 MiB of resident
    # memory; holding one shard plus one forward batch adds a few MiB (allocator noise: a few MiB more).
    docs = []
    rng = random.Random(1)
    for i in range(1200):
        n = rng.randint(250, 350)
        docs.append(
            {
                "id": f"{i:05d}",
                "input_ids": [rng.randint(3, VOCAB - 1) for _ in range(n)],
                "loss_mask": [1] * n,
            }
        )
    data = _save(docs, tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    res = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tiny_target_dir), str(data), str(tmp_path / "cache"), "4"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    cache_mib = out["floats"] * 4 / 2**20
    assert cache_mib > 250 and out["shards"] >= 60
    assert out["max_shard_bytes"] <= 4 * 2**20
    assert out["build_peak_kib"] / 1024 < cache_mib / 4, out
    assert out["read_peak_kib"] / 1024 < cache_mib / 4, out


def test_a_cache_of_more_layers_serves_a_head_tapping_a_subset(tiny_target_dir, dataset, tmp_path):
    """One cache with every layer of a tap sweep (here [0, 1]) serves a head tapping [1] exactly as a cache
    built for [1] alone: same columns, same values; a head tapping a layer the cache lacks is refused."""
    full = tmp_path / "cache-all"
    wide = _module(tiny_target_dir, target_layer_ids=[1])
    dm = _data(dataset, full, teacher_cache_taps=[0, 1])
    dm.attach_teacher(*wide.teacher_source())
    dm.prepare_data()
    assert list(wide.teacher_source()[0].tap_layer_ids) == [1]  # the build restores the head's taps
    assert json.loads((full / "cache.json").read_text())["layout"]["tap_layer_ids"] == [0, 1]
    only = tmp_path / "cache-1"
    _build(only, wide, dataset)
    fp = _data(dataset, only)
    fp.attach_teacher(*wide.teacher_source())
    expected = fp.expected_fingerprint()
    a, b = TeacherCache(full, expected), TeacherCache(only, expected)
    for row in (0, 7, 59):
        for x, y in zip(a.features(row), b.features(row), strict=True):
            # the same fp32 forward, computed in two builds: last-bit differences only
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert a.taps_dim == b.taps_dim == 64
    narrow = _module(tiny_target_dir, target_layer_ids=[0])
    other = _data(dataset, only)
    other.attach_teacher(*narrow.teacher_source())
    with pytest.raises(TeacherCacheError, match="not a subset"):
        TeacherCache(only, other.expected_fingerprint())
