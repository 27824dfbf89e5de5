"""A saved head carries its RoPE in both dialects (issue 14, item 6).

transformers 5 writes RoPE only as `rope_parameters`; loaders built on transformers 4.x (the public
DFlash/JetSpec code) read a top-level `rope_theta` (and `rope_scaling`), and without them silently use base
1e4. A head for SmolLM2 (rope_theta 1e5) or Qwen3 (1e6) would then draft with the wrong positions.
"""

from __future__ import annotations

import json
import math

import torch
from transformers import Qwen3Config

from jetflow_pl.head import DraftHead, DraftHeadConfig

MASK_ID = 95


def target_config(rope_parameters: dict) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters=rope_parameters,
    )


def expected_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def test_saved_head_writes_top_level_rope_theta(tmp_path):
    head = DraftHead(
        DraftHeadConfig.for_target(
            target_config({"rope_type": "default", "rope_theta": 1e5}), mask_token_id=MASK_ID
        )
    )
    head.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    # what a transformers 4.x loader reads
    assert saved["rope_theta"] == 1e5
    assert "rope_scaling" not in saved  # plain RoPE: 4.x reads a missing rope_scaling as "none"
    # what transformers 5 reads, unchanged
    assert saved["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}
    loaded = DraftHead.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters["rope_theta"] == 1e5


def test_default_base_is_written_too(tmp_path):
    # a 4.x loader's own default may differ from this version's: never leave it to the default
    DraftHeadConfig.for_target(
        target_config({"rope_type": "default", "rope_theta": 10000.0}), mask_token_id=MASK_ID
    ).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_theta"] == 10000.0


def test_scaled_rope_writes_rope_scaling(tmp_path):
    rope = {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}
    DraftHeadConfig.for_target(target_config(rope), mask_token_id=MASK_ID).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 5e5
    assert saved["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    reloaded = DraftHeadConfig.from_pretrained(tmp_path)
    assert reloaded.rope_parameters == rope


def test_transformers4_style_config_loads_with_its_base(tmp_path):
    """A head config as a 4.x-based trainer writes it: top-level rope_theta, no rope_parameters."""
    cfg = DraftHeadConfig.for_target(
        target_config({"rope_type": "default", "rope_theta": 1e6}), mask_token_id=MASK_ID
    )
    d = cfg.to_dict()
    del d["rope_parameters"]
    d["rope_theta"] = 1e6
    d["rope_scaling"] = None
    (tmp_path / "config.json").write_text(json.dumps(d))
    loaded = DraftHeadConfig.from_pretrained(tmp_path)
    assert loaded.rope_parameters["rope_theta"] == 1e6
    head = DraftHead(loaded)
    inv = head.rotary_emb.inv_freq.double()
    torch.testing.assert_close(inv, expected_inv_freq(1e6, 16), rtol=1e-6, atol=0)
    assert not math.isclose(inv[1].item(), expected_inv_freq(1e4, 16)[1].item(), rel_tol=1e-3)


def test_a_head_stored_in_bfloat16_runs_in_the_targets_dtype(tmp_path):
    """Heads ship in bfloat16 (half the bytes); paired with a float32 target they must run in float32 and
    stay lossless. Without the cast the head's bf16 output would meet the target's fp32 lm_head and fail."""
    from transformers import AutoTokenizer

    from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR, heldout_prompts
    from data_gen.toy.tokenizer import prompt_ids
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    load_draft_head(SMALL_HEAD_DIR).to(torch.bfloat16).save_pretrained(tmp_path)
    head = load_draft_head(tmp_path)
    assert next(head.parameters()).dtype == torch.bfloat16  # stored and loaded as bf16
    target = TargetModel.from_pretrained(SMALL_TARGET_DIR, head.config.target_layer_ids)
    ids = prompt_ids(AutoTokenizer.from_pretrained(SMALL_TARGET_DIR), heldout_prompts("math", 1)[0]["prompt"])
    spec = SpeculativeGenerator(TorchBackend(target, head), budget=16, width=4, eos_token_id=1)
    assert next(head.parameters()).dtype == target.dtype == torch.float32
    out = spec.generate(ids, 32)
    assert out.tokens == ARGenerator(TorchBackend(target), eos_token_id=1).generate(ids, 32).tokens
    assert out.tau > 1.5  # the bf16-rounded weights still draft (the toy head's tau is ~3 at budget 16)
