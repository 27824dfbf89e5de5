"""Target regeneration (data_gen/regenerate): exactness, resume, crash safety, bad input, schema.

Real tiny models on disk, seeded, fp32, CPU. The tiny target is random-init with a large init range so
greedy outputs vary from token to token (a default-init tiny model repeats one token, which would make
the exactness check vacuous). The tokenizer is the shipped toy tokenizer when present, else a small one
trained in about a second on a fraction of the toy corpora.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from regen_configs import predict_run_config, predict_trainer

from data_gen.regenerate import (
    OutputFolderError,
    PromptDataModule,
    PromptSourceError,
    RegenerationModule,
    RegenerationWriter,
    batched_generate,
)
from data_gen.regenerate.prompts import bucket_batches, chat_prompt_ids, collate_left
from data_gen.regenerate.schema import COLUMNS, check_row
from data_gen.regenerate.writer import list_shards, shard_ids

pytestmark = [
    pytest.mark.filterwarnings("ignore:Couldn.t infer the batch indices"),
    pytest.mark.usefixtures("one_thread"),
]

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "data_gen" / "toy" / "assets" / "small"
MAX_NEW = 12


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


@pytest.fixture(scope="module")
def rg_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _has_tokenizer(SMALL):
        return SMALL
    from data_gen.toy.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("rg_tok")
    train_tokenizer(str(out), vocab_size=300, corpus_scale=0.01)
    return out


@pytest.fixture(scope="module")
def rg_target_dir(tmp_path_factory: pytest.TempPathFactory, rg_tokenizer_dir: Path) -> Path:
    """A tiny random Qwen3 target (toy preset `tiny`, ids 0/1/2 = pad/eos/mask) with varied outputs."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from data_gen.toy.target_trainer import make_config

    vocab = len(AutoTokenizer.from_pretrained(rg_tokenizer_dir))
    torch.manual_seed(0)
    cfg = make_config("tiny", vocab, max_position_embeddings=256)
    cfg.initializer_range = 0.3
    model = Qwen3ForCausalLM(cfg).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    out = tmp_path_factory.mktemp("rg_target")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def module(rg_target_dir: Path, rg_tokenizer_dir: Path) -> RegenerationModule:
    return RegenerationModule(
        str(rg_target_dir), tokenizer_path=str(rg_tokenizer_dir), max_new_tokens=MAX_NEW
    )


def _run(tmp: Path, module, dm, out: Path, shard_size: int = 3) -> RegenerationWriter:
    writer = RegenerationWriter(str(out), shard_size=shard_size)
    predict_trainer(tmp, writer).predict(module, datamodule=dm, return_predictions=False)
    return writer


def _hf_alone(model, prompt: list[int], max_new: int, stop_ids: list[int]) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=stop_ids,
    )
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------------------------- exactness


def predict_config(tmp_path, out, target_dir, tokenizer_dir, source: str, max_new_tokens: int) -> dict:
    """A LightningCLI predict config for a regeneration run into `out` (shards of 2 rows)."""
    args = {
        "target_path": str(target_dir),
        "tokenizer_path": str(tokenizer_dir),
        "max_new_tokens": max_new_tokens,
    }
    return predict_run_config(tmp_path, out, args, source)


def test_greedy_batched_generation_equals_hf_generate_alone(module):
    """Left padding, length buckets and rows leaving the batch at different steps change no token."""
    dm = PromptDataModule("toy:all:heldout:4", batch_size=5)
    dm.prepare_items(module.tokenizer, module.context_length, 20)
    items = dm.items
    # a frequent token as an extra stop id, so rows finish at different steps (some by "eos", some by length)
    probe, _ = batched_generate(
        module.target, **_tensors(collate_left(items, dm.pad_id)), max_new_tokens=20, stop_ids=[1]
    )
    counts: dict[int, int] = {}
    for row in probe:
        for t in row[1:-1]:
            counts[t] = counts.get(t, 0) + 1
    stops = sorted({1, max(counts, key=counts.get)})
    finished = {"eos": 0, "length": 0}
    padded = 0
    for batch in bucket_batches(items, 5, None, 20):
        b = collate_left(batch, dm.pad_id)
        padded += int((b["attention_mask"] == 0).sum())
        toks, reasons = batched_generate(module.target, **_tensors(b), max_new_tokens=20, stop_ids=stops)
        for it, tk, why in zip(batch, toks, reasons, strict=True):
            assert tk == _hf_alone(module.target.model, it.prompt_ids, 20, stops), it.id
            assert (why == "eos") == (tk[-1] in stops)
            finished[why] += 1
    assert finished["eos"] > 0 and finished["length"] > 0 and padded > 0


def _tensors(b: dict) -> dict:
    return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}


@pytest.mark.skipif(not (SMALL / "config.json").is_file(), reason="shipped toy target not built yet")
def test_greedy_exact_on_shipped_small_toy_target():
    """The shipped trained toy target: length-bucketed, left-padded batches equal HF generate() alone."""
    small = RegenerationModule(str(SMALL), max_new_tokens=48)
    dm = PromptDataModule("toy:all:heldout:4", batch_size=5)
    dm.prepare_items(small.tokenizer, small.context_length, 48)
    reasons = []
    for batch in bucket_batches(dm.items, 5, None, 48):
        b = collate_left(batch, dm.pad_id)
        toks, why = batched_generate(small.target, **_tensors(b), max_new_tokens=48, stop_ids=small.stop_ids)
        for it, tk in zip(batch, toks, strict=True):
            assert tk == _hf_alone(small.target.model, it.prompt_ids, 48, small.stop_ids), it.id
        reasons += why
    assert len(reasons) == 12


def test_sampling_uses_per_sample_seeds_independent_of_batch(rg_target_dir, rg_tokenizer_dir):
    m = RegenerationModule(
        str(rg_target_dir), tokenizer_path=str(rg_tokenizer_dir), max_new_tokens=10, temperature=1.0, seed=3
    )
    dm = PromptDataModule("toy:math:heldout:4", batch_size=4)
    dm.prepare_items(m.tokenizer, m.context_length, 10)
    together = m.predict_step(collate_left(dm.items, dm.pad_id))["records"]
    alone = [m.predict_step(collate_left([it], dm.pad_id))["records"][0] for it in dm.items]
    assert [r["response_ids"] for r in together] == [r["response_ids"] for r in alone]
    assert len({tuple(r["response_ids"]) for r in together}) > 1


def test_speculative_head_gives_the_same_greedy_output(tmp_path, module, rg_target_dir, rg_tokenizer_dir):
    from jetflow_pl.head import DraftHead, DraftHeadConfig

    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(module.target.config, num_hidden_layers=1, block_size=4, mask_token_id=2)
    DraftHead(cfg).save_pretrained(tmp_path / "head")
    spec = RegenerationModule(
        str(rg_target_dir),
        tokenizer_path=str(rg_tokenizer_dir),
        max_new_tokens=MAX_NEW,
        head_path=str(tmp_path / "head"),
        spec_budget=4,
        spec_width=2,
    )
    dm = PromptDataModule("toy:code:heldout:3", batch_size=3)
    dm.prepare_items(module.tokenizer, module.context_length, MAX_NEW)
    b = collate_left(dm.items, dm.pad_id)
    a, s = module.predict_step(b)["records"], spec.predict_step(b)["records"]
    assert [(r["response_ids"], r["finish_reason"]) for r in a] == [
        (r["response_ids"], r["finish_reason"]) for r in s
    ]
    # the speculative run shares one fingerprint with the plain greedy run (same output)
    assert spec.fingerprint() == module.fingerprint()


# ---------------------------------------------------------------------------------------------- sources
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sources_single_turn_multi_turn_and_formats(tmp_path, module):
    import datasets

    from data_gen.toy.tokenizer import prompt_ids

    tok = module.tokenizer
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "an old answer to be regenerated"},
    ]
    rows = [
        {"id": "a", "domain": "math", "prompt": "What is 1 + 1?", "messages": None},
        {"id": "b", "domain": "", "prompt": None, "messages": chat},
    ]
    src = _write_jsonl(tmp_path / "p.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    arrow = next((tmp_path / "disk").glob("*.arrow"))
    for source in (src, tmp_path / "p.parquet", tmp_path / "disk", arrow):
        dm = PromptDataModule(str(source))
        dm.prepare_items(tok, module.context_length, MAX_NEW)
        by_id = {it.id: it for it in dm.items}
        assert by_id["a"].prompt_ids == prompt_ids(tok, "What is 1 + 1?"), source
        assert by_id["b"].prompt_ids == chat_prompt_ids(tok, chat[:-1]), source
        assert by_id["a"].domain == "math"


def test_plain_prompts_for_a_base_model(tmp_path, module):
    """`chat_template: false`: the row's text (in `prompt_template`) tokenized as it is, with the
    tokenizer's own special tokens; a chat row gives its last user turn; more turns are refused."""
    tok = module.tokenizer
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "old"}]
    rows = [{"id": "a", "prompt": "def add(a, b):"}, {"id": "b", "messages": chat}]
    src = str(_write_jsonl(tmp_path / "p.jsonl", rows))
    dm = PromptDataModule(src, chat_template=False, prompt_template="Q: {prompt}\nA:")
    dm.prepare_items(tok, module.context_length, MAX_NEW)
    by_id = {it.id: it for it in dm.items}
    assert by_id["a"].prompt_ids == tok("Q: def add(a, b):\nA:")["input_ids"]
    assert by_id["b"].prompt_ids == tok("Q: What is 2 + 3?\nA:")["input_ids"]
    assert by_id["a"].prompt_ids != chat_prompt_ids(
        tok, [{"role": "user", "content": "Q: def add(a, b):\nA:"}]
    )
    # the hash of a chat run is unchanged by the new settings at their defaults; a plain run differs
    assert "chat_template" not in PromptDataModule(src).fingerprint()
    assert dm.fingerprint()["chat_template"] is False
    for bad, message in (
        (dict(max_turns=2), "one plain prompt per row"),
        (dict(prompt_template="no slot"), "must contain"),
    ):
        with pytest.raises(PromptSourceError, match=message):
            PromptDataModule(src, chat_template=False, **bad).prepare_items(
                tok, module.context_length, MAX_NEW
            )


def test_overlong_policies_skip_and_truncate_are_counted(tmp_path, module):
    rows = [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 400}]
    src = str(_write_jsonl(tmp_path / "p.jsonl", rows))
    skip = PromptDataModule(src, overlong="skip")
    skip.prepare_items(module.tokenizer, module.context_length, MAX_NEW)
    assert [it.id for it in skip.items] == ["short"] and skip.stats.overlong_skipped == 1
    trunc = PromptDataModule(src, overlong="truncate", max_prompt_len=40)
    trunc.prepare_items(module.tokenizer, module.context_length, MAX_NEW)
    long = next(it for it in trunc.items if it.id == "long")
    full = chat_prompt_ids(module.tokenizer, [{"role": "user", "content": rows[1]["prompt"]}])
    assert long.truncated and long.prompt_ids == full[-40:] and trunc.stats.truncated == 1


def test_length_buckets_keep_padding_small():
    from data_gen.regenerate.prompts import PromptItem

    g = torch.Generator().manual_seed(0)
    items = [PromptItem(str(i), "", [5] * int(torch.randint(5, 200, (1,), generator=g))) for i in range(64)]
    batches = bucket_batches(items, 8, 4096, 64)
    assert sorted(it.id for b in batches for it in b) == sorted(it.id for it in items)

    def padding(bs):
        return sum(max(len(i.prompt_ids) for i in b) * len(b) - sum(len(i.prompt_ids) for i in b) for b in bs)

    in_order = [items[i : i + 8] for i in range(0, len(items), 8)]
    assert padding(batches) < 0.25 * padding(in_order)
    assert all(len(b) * (len(b[0].prompt_ids) + 64) <= 4096 or len(b) == 1 for b in batches)


# ---------------------------------------------------------------------------------------------- bad input
def _bad_case(tmp: Path, case: str) -> tuple[str, dict]:
    if case == "missing path":
        return str(tmp / "nope.jsonl"), {}
    if case == "empty dataset":
        (tmp / "empty.jsonl").write_text("")
        return str(tmp / "empty.jsonl"), {}
    if case == "no prompt column":
        return str(_write_jsonl(tmp / "p.jsonl", [{"id": "a", "question": "hi"}])), {}
    if case == "row without prompt":
        return str(_write_jsonl(tmp / "p.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "text": "x"}])), {}
    if case == "malformed chat":
        rows = [
            {"id": "a", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "b", "messages": [{"who": "me"}]},
        ]
        return str(_write_jsonl(tmp / "p.jsonl", rows)), {}
    if case == "prompt longer than context":
        return str(_write_jsonl(tmp / "p.jsonl", [{"id": "a", "prompt": "word " * 400}])), {}
    raise AssertionError(case)


BAD = {
    "missing path": "does not exist",
    "empty dataset": "is empty",
    "no prompt column": "has no 'prompt' or 'messages' column",
    "row without prompt": "row 1 \\(id 'b'\\) has no 'prompt' field",
    "malformed chat": "row 1 \\(id 'b'\\): malformed chat",
    "prompt longer than context": "more than the limit of 244 \\(model context 256 - max_new_tokens 12\\)",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_with_one_message_and_writes_nothing(tmp_path, module, case):
    source, kw = _bad_case(tmp_path, case)
    out = tmp_path / "out"
    with pytest.raises(PromptSourceError, match=BAD[case]) as info:
        _run(tmp_path, module, PromptDataModule(source, **kw), out)
    assert "\n" not in str(info.value)
    assert not out.exists()


def test_output_folder_of_another_run_is_refused_untouched(tmp_path, module):
    out = tmp_path / "out"
    _run(tmp_path, module, PromptDataModule("toy:math:heldout:2", batch_size=2), out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(OutputFolderError, match="holds another run's data"):
        _run(tmp_path, module, PromptDataModule("toy:code:heldout:2", batch_size=2), out)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match="not a regeneration run folder"):
        _run(tmp_path, module, PromptDataModule("toy:math:heldout:2"), stranger)
    assert sorted(p.name for p in stranger.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------- end to end
def test_predict_writes_schema_dataset_exact_rows_and_resumes(tmp_path, module):
    import datasets

    out = tmp_path / "out"
    dm = PromptDataModule("toy:all:heldout:3", batch_size=4)
    w = _run(tmp_path, module, dm, out, shard_size=3)
    assert w.summary["written"] == 9 and w.summary["skipped"] == 0 and w.summary["failed"] == 0
    ds = datasets.load_from_disk(str(out / "dataset"))
    assert tuple(ds.column_names) == COLUMNS and len(ds) == 9
    assert str(ds.features["input_ids"].feature.dtype) == "int32"
    prompts = {it.id: it.prompt_ids for it in dm.items}
    first = {r["id"]: r for r in ds}
    for r in ds:
        check_row(r)
        p = r["prompt_len"]
        assert r["input_ids"][:p] == prompts[r["id"]]
        assert r["input_ids"][p:] == _hf_alone(
            module.target.model, prompts[r["id"]], MAX_NEW, module.stop_ids
        )
        assert (r["finish_reason"] == "eos") == (r["input_ids"][-1] in module.stop_ids)
        assert r["response"] == module.tokenizer.decode(r["input_ids"][p:], skip_special_tokens=True)
    manifest = [json.loads(x) for f in (out / "manifest").glob("*.jsonl") for x in f.read_text().splitlines()]
    assert sorted(i for m in manifest for i in m["ids"]) == sorted(first)
    # lose one shard and the merged dataset: the rerun regenerates exactly those ids
    victim = list_shards(out)[0]
    lost = shard_ids(victim)
    victim.unlink()
    w2 = _run(tmp_path, module, PromptDataModule("toy:all:heldout:3", batch_size=4), out, shard_size=3)
    assert w2.summary["written"] == len(lost) and w2.summary["skipped_already_done"] == 9 - len(lost)
    ds2 = datasets.load_from_disk(str(out / "dataset"))
    assert sorted(ds2["id"]) == sorted(first) and {r["id"]: r for r in ds2} == first
    summary = json.loads((out / "summary.json").read_text())
    assert summary["written"] == len(lost)


def test_sigkill_mid_run_then_rerun_gives_every_id_once(tmp_path, rg_target_dir, rg_tokenizer_dir):
    """The real `python -m jetflow_pl predict` command, killed with SIGKILL after its first shard lands."""
    import datasets

    out = tmp_path / "out"
    cfg = predict_config(tmp_path, out, rg_target_dir, rg_tokenizer_dir, "toy:math:heldout:24", 48)
    config = tmp_path / "regen.yaml"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    cmd = [sys.executable, "-m", "jetflow_pl", "predict", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list_shards(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_shards = list_shards(out)
    assert killed_shards and not (out / "dataset").exists()  # killed part-way
    # a half-written temp shard, as a kill during a write leaves it: must be ignored and cleaned
    (out / "shards" / ".tmp-shard-r00000-dead-000099.parquet").write_bytes(b"PAR1 truncated")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "regenerate: written=" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    ids_per_shard = [shard_ids(p) for p in list_shards(out)]  # every shard readable
    all_ids = [i for ids in ids_per_shard for i in ids]
    assert len(all_ids) == len(set(all_ids)) == 24
    assert summary["skipped_already_done"] == sum(len(shard_ids(p)) for p in killed_shards)
    ds = datasets.load_from_disk(str(out / "dataset"))
    assert len(ds) == 24 and sorted(ds["id"]) == sorted(all_ids)
    assert not list((out / "shards").glob(".tmp-*"))


def test_bench_writes_tokens_per_s_json(tmp_path, rg_target_dir, rg_tokenizer_dir):
    from bench import regenerate as bench

    out = tmp_path / "bench.json"
    args = ["--target", str(rg_target_dir), "--tokenizer", str(rg_tokenizer_dir), "--n-per-domain", "2"]
    bench.main([*args, "--max-new-tokens", "4", "--batch-sizes", "1", "4", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [r["batch_size"] for r in res["runs"]] == [1, 4]
    assert all(r["tokens_per_s"] > 0 for r in res["runs"]) and res["outputs_identical_across_batch_sizes"]


@pytest.mark.slow
def test_ddp_two_cpu_ranks_write_own_shards_and_merge_once(tmp_path, rg_target_dir, rg_tokenizer_dir):
    """`strategy: ddp` on 2 CPU processes (gloo): per-rank shards and manifests, one merged dataset."""
    import datasets

    out = tmp_path / "out"
    cfg = predict_config(tmp_path, out, rg_target_dir, rg_tokenizer_dir, "toy:math:heldout:9", 8)
    cfg["trainer"].update(devices=2, strategy="ddp")
    config = tmp_path / "ddp.yaml"
    config.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "jetflow_pl", "predict", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = {p.name.split("-")[1] for p in list_shards(out)}
    assert ranks == {"r00000", "r00001"}
    assert sorted(p.name for p in (out / "manifest").iterdir()) == ["r00000.jsonl", "r00001.jsonl"]
    ds = datasets.load_from_disk(str(out / "dataset"))
    assert len(ds) == len(set(ds["id"])) == 9
    # lose rank 1's shards: a rerun under DDP regenerates exactly those ids
    lost = [i for p in list_shards(out) if p.name.split("-")[1] == "r00001" for i in shard_ids(p)]
    for p in list_shards(out):
        if p.name.split("-")[1] == "r00001":
            p.unlink()
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["written"] == len(lost)
    ds = datasets.load_from_disk(str(out / "dataset"))
    assert len(ds) == len(set(ds["id"])) == 9


def test_on_error_skip_counts_failed_samples_and_a_rerun_retries_them(
    tmp_path, rg_target_dir, rg_tokenizer_dir
):
    m = RegenerationModule(
        str(rg_target_dir), tokenizer_path=str(rg_tokenizer_dir), max_new_tokens=4, on_error="skip"
    )
    real = m._generate

    def flaky(sample_ids, prompts):
        if "math-heldout-0-1" in sample_ids:
            raise RuntimeError("simulated failure")
        return real(sample_ids, prompts)

    m._generate = flaky
    out = tmp_path / "out"
    w = _run(tmp_path, m, PromptDataModule("toy:math:heldout:4", batch_size=4), out)
    assert w.summary["failed"] == 1 and w.summary["written"] == 3
    assert json.loads((out / "failed-r00000.jsonl").read_text())["id"] == "math-heldout-0-1"
    m._generate = real
    w = _run(tmp_path, m, PromptDataModule("toy:math:heldout:4", batch_size=4), out)
    assert w.summary["written"] == 1 and w.summary["dataset_rows"] == 4


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.parametrize(
    "name", ["toy.yaml", "local_checkpoint_ddp.yaml", "smollm2_chat.yaml", "gemma3_270m.yaml"]
)
def test_shipped_configs_parse(name, capsys):
    from jetflow_pl.cli import lightning_main

    with pytest.raises(SystemExit) as info:
        lightning_main(["predict", "--config", str(REPO / "configs" / "regenerate" / name), "--print_config"])
    assert info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "data_gen.regenerate.module.RegenerationModule" in printed
    assert "data_gen.regenerate.writer.RegenerationWriter" in printed


def test_toy_source_mixes_counts_per_domain():
    from data_gen.regenerate.prompts import PromptSourceError, load_rows

    rows = load_rows("toy:math+prose:train:5+2:3")
    assert [r["domain"] for r in rows] == ["math"] * 5 + ["prose"] * 2
    # one count for every listed domain, and the same rows as the single-domain source
    assert load_rows("toy:math+code:train:4:3")[:4] == load_rows("toy:math:train:4:3")
    with pytest.raises(PromptSourceError, match="2 domains but 3 counts"):
        load_rows("toy:math+code:train:1+2+3")
    with pytest.raises(PromptSourceError, match="toy domain must be one of"):
        load_rows("toy:math+poetry:train:1+2")


def test_multi_turn_regeneration_equals_hf_greedy_turn_by_turn(tmp_path, module):
    """Conversations answered turn by turn: each answer is HF greedy on the conversation so far (the
    target's own earlier answers in it, joined by the chat template), and the loss mask covers exactly the
    answers. One conversation is cut by `max_turns`, one by the context cap before its last turn."""
    import datasets

    from jetflow_pl.chat import chat_ids, continue_chat

    tok = module.tokenizer
    rows = [
        {"id": "c1", "domain": "chat", "turns": ["What is 2 + 3?", "And times 4?", "Say it in words.", "x"]},
        {"id": "c2", "domain": "chat", "system": "Be brief.", "turns": ["Name a fruit.", "Another one?"]},
        {"id": "c3", "domain": "chat", "turns": ["Hi.", "Hello again.", "word " * 40]},
    ]
    src = _write_jsonl(tmp_path / "conv.jsonl", rows)
    max_turns, cap = 3, 110
    dm = PromptDataModule(str(src), batch_size=2, max_turns=max_turns, max_context_len=cap)
    _run(tmp_path, module, dm, tmp_path / "out")
    got = {r["id"]: r for r in datasets.load_from_disk(str(tmp_path / "out" / "dataset"))}
    stops = list(module.stop_ids)
    turns_seen = {}
    for row in rows:
        system = row.get("system")
        first = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": row["turns"][0]}
        ]
        ids = chat_ids(tok, first)
        expect, mask = list(ids), [0] * len(ids)
        answer: list[int] = []
        for t in range(max_turns):
            if t > 0:
                if t >= len(row["turns"]):
                    break
                nxt = continue_chat(tok, ids, answer, row["turns"][t], stops, system)
                if len(nxt) + MAX_NEW > cap:
                    break
                mask += [0] * (len(nxt) - len(expect))
                expect, ids = list(nxt), nxt
            answer = _hf_alone(module.target.model, ids, MAX_NEW, stops)
            expect += answer
            mask += [1] * len(answer)
            turns_seen[row["id"]] = t + 1
        r = got[row["id"]]
        assert r["input_ids"] == expect, row["id"]
        assert r["loss_mask"] == mask, row["id"]
        assert r["prompt_len"] == len(chat_ids(tok, first))
    # c1 stops at max_turns (its 4th turn unused), c3 before a 3rd turn that would pass the context cap
    assert turns_seen == {"c1": 3, "c2": 2, "c3": 2}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["turns"] == 7 and summary["conversations_cut_by_context"] == 1
    # resume works per conversation: lose one shard, rerun, the lost conversations come back identical
    out = tmp_path / "out"
    victim = list_shards(out)[0]
    lost = shard_ids(victim)
    victim.unlink()
    dm2 = PromptDataModule(str(src), batch_size=2, max_turns=max_turns, max_context_len=cap)
    w2 = _run(tmp_path, module, dm2, out)
    assert w2.summary["written"] == len(lost) and w2.summary["skipped_already_done"] == 3 - len(lost)
    again = {r["id"]: r for r in datasets.load_from_disk(str(out / "dataset"))}
    assert again == got
