"""Head layers initialised from target layers (`jetflow_pl/head/init.py`, `init_from_target_layers`)."""

from __future__ import annotations

import pytest
import torch

from jetflow_pl.errors import UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.head.init import init_head_from_target_layers
from jetflow_pl.target import TargetModel

MASK_ID = 2


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetModel:
    return TargetModel.from_pretrained(tiny_target_dir)


def _head(target, n: int) -> DraftHead:
    return DraftHead(DraftHeadConfig.for_target(target.config, num_hidden_layers=n, mask_token_id=MASK_ID))


def test_copied_layers_equal_the_target_layers_and_the_rest_keeps_its_init(target):
    head = _head(target, 2)
    fc_before = head.fc.weight.clone()
    last = [target.num_layers - 2, target.num_layers - 1]
    copied = init_head_from_target_layers(head, target, last)
    for h, t in enumerate(last):
        hp, tp = dict(head.layers[h].named_parameters()), dict(target.layers[t].named_parameters())
        for name, value in tp.items():  # every target layer parameter (qwen3: q/k norms too) is copied
            assert torch.equal(hp[name], value), name
    assert torch.equal(head.norm.weight, target.final_norm.weight)
    assert torch.equal(head.fc.weight, fc_before)  # the fusion has no counterpart in the target
    assert "norm.weight" in copied and len(copied) == 2 * len(dict(target.layers[0].named_parameters())) + 1


def test_a_head_from_the_target_last_layers_computes_the_target_layers(target):
    """With its layers copied, the head's layer 0 on a hidden state equals the target's layer on it when
    the context prefix is empty: the copy is a real slice of the target (RoPE and GQA included)."""
    head = _head(target, 1).eval()
    t_idx = target.num_layers - 1
    init_head_from_target_layers(head, target, [t_idx])
    x = torch.randn(1, 5, target.hidden_size)
    pos = torch.arange(5)[None]
    emb = head.rotary_emb(x, pos)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    ours = head.layers[0](x, emb, causal)
    ref_emb = target.model.model.rotary_emb(x, pos)
    mask = torch.zeros(1, 1, 5, 5).masked_fill(~causal, float("-inf"))
    theirs = target.layers[t_idx](x, attention_mask=mask, position_embeddings=ref_emb, position_ids=pos)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    # same weights and the same math in another implementation: fp32 rounding only
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_wrong_layer_count_or_range_is_one_error(target):
    head = _head(target, 2)
    with pytest.raises(UserInputError, match="one target layer per head layer"):
        init_head_from_target_layers(head, target, [0])
    with pytest.raises(UserInputError, match="outside the target's layers"):
        init_head_from_target_layers(head, target, [0, target.num_layers])


def test_one_tap_below_the_slice_makes_the_fusion_the_copied_layer_input_norm(target):
    t_idx = target.num_layers - 1
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=1, mask_token_id=MASK_ID, target_layer_ids=[t_idx - 1]
    )
    head = DraftHead(cfg)
    copied = init_head_from_target_layers(head, target, [t_idx])
    assert "fc.weight" in copied
    x = torch.randn(3, target.hidden_size) * 5
    # the head's fused context is exactly what the target layer's attention projects: its input norm of x
    torch.testing.assert_close(head.fuse(x), target.layers[t_idx].input_layernorm(x))
