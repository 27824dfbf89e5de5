"""The shipped `small` toy target: loads, answers held-out math in the `#### <n>` format."""

from __future__ import annotations

import json
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSET = os.path.join(REPO, "data_gen", "toy", "assets", "small")
HAVE_ASSET = os.path.isfile(os.path.join(ASSET, "model.safetensors"))
needs_asset = pytest.mark.skipif(
    not HAVE_ASSET,
    reason=f"shipped toy target missing at {ASSET}; rebuild with "
    "`python -m data_gen.toy.build --preset small --out data_gen/toy/assets/small`",
)


@pytest.fixture(scope="module")
def small():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET)
    model = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    return model, tok


@needs_asset
def test_asset_files_and_size(small):
    model, tok = small
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert os.path.isfile(os.path.join(ASSET, name)), name
    assert os.path.getsize(os.path.join(ASSET, "model.safetensors")) <= 20 * 1024 * 1024
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert tok.mask_token == "<|mask|>" and tok.eos_token_id == model.config.eos_token_id
    with open(os.path.join(ASSET, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["heldout_response_nll"]["math"] < 0.7


@needs_asset
def test_greedy_heldout_math_format(small):
    from data_gen.toy.math_problems import parse_final_answer
    from data_gen.toy.splits import heldout_prompts
    from data_gen.toy.target_trainer import greedy_generate

    model, tok = small
    torch.manual_seed(0)
    recs = heldout_prompts("math", 32, seed=0)
    outs = greedy_generate(model, tok, [r["prompt"] for r in recs], max_new_tokens=80, batch_size=32)
    ok = [parse_final_answer(o) is not None for o in outs]
    rate = sum(ok) / len(ok)
    assert rate >= 0.8, (
        f"format rate {rate:.2f}; bad samples: {[o for o, k in zip(outs, ok, strict=True) if not k][:3]}"
    )


@needs_asset
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_lightning_cli_configs_parse(name, monkeypatch):
    """The configs instantiate the module/datamodule through LightningCLI (no training)."""
    from lightning.pytorch.cli import LightningCLI

    from data_gen.toy.target_trainer import ToyDataModule, ToyTargetModule

    monkeypatch.setattr("sys.argv", ["jetflow_pl"])
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        cli = LightningCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            args=["--config", f"configs/toy_target/{name}.yaml", "--trainer.logger=false"],
            save_config_callback=None,
        )
    finally:
        os.chdir(cwd)
    assert isinstance(cli.model, ToyTargetModule) and isinstance(cli.datamodule, ToyDataModule)
    assert cli.model.hparams.preset == name
