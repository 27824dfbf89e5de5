"""DraftHead / DraftHeadConfig / HeadCache: real tiny modules, seeded, CPU, fast."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from jetflow_pl.head import DraftHead, DraftHeadConfig, HeadCache, default_target_layer_ids, make_block

H = 64  # head hidden == target hidden
N_TAPS = 2
VOCAB = 128
TARGET_LAYERS = 8
MASK_ID = 127


def tiny_target_config(**kw) -> Qwen3Config:
    args = dict(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
    )
    args.update(kw)
    return Qwen3Config(**args)


def tiny_head_config(causal: bool = True, **kw) -> DraftHeadConfig:
    args = dict(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        block_size=8,
        num_target_layers=TARGET_LAYERS,
        dflash_config={
            "causal_head": causal,
            "target_layer_ids": [1, 5],
            "mask_token_id": MASK_ID,
            "target_hidden_size": H,
        },
    )
    args.update(kw)
    return DraftHeadConfig(**args)


def make_head(causal: bool = True, seed: int = 0, **kw) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(tiny_head_config(causal=causal, **kw)).eval()
    # perturb the norms so that they are not all ones (makes the checks sensitive to them)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return head


def rand_inputs(B: int = 2, Q: int = 6, T: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(B, Q, H, generator=g)
    taps = torch.randn(B, T, N_TAPS * H, generator=g)
    block_pos = torch.arange(T, T + Q).expand(B, Q)
    return embeds, taps, block_pos


# ---- config -------------------------------------------------------------------------------------------


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 2) == [1, 5]
    # tiny targets are clamped into [0, L-1]
    for L in (1, 2, 3):
        for n in (1, 2, 3, 5):
            ids = default_target_layer_ids(L, n)
            assert len(ids) == n and all(0 <= i < L for i in ids)
    with pytest.raises(ValueError):
        default_target_layer_ids(0, 1)


def test_config_defaults_and_for_target() -> None:
    cfg = DraftHeadConfig(hidden_size=H, num_hidden_layers=3, num_target_layers=28)
    assert cfg.model_type == "qwen3"
    assert cfg.architectures == ["DraftHead"]
    assert cfg.block_size == 16
    assert cfg.dflash_config == {
        "causal_head": True,
        "target_layer_ids": default_target_layer_ids(28, 3),
        "mask_token_id": None,
        "target_hidden_size": H,
    }

    target = tiny_target_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    hc = DraftHeadConfig.for_target(
        target, num_hidden_layers=2, block_size=8, causal=False, mask_token_id=MASK_ID
    )
    for field in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert getattr(hc, field) == getattr(target, field), field
    assert hc.rope_parameters["rope_theta"] == 5000.0
    assert hc.num_hidden_layers == 2 and hc.block_size == 8 and hc.num_target_layers == TARGET_LAYERS
    assert hc.dflash_config == {
        "causal_head": False,
        "target_layer_ids": [1, 5],
        "mask_token_id": MASK_ID,
        "target_hidden_size": H,
    }
    assert hc.causal_head is False and hc.num_taps == 2 and hc.mask_token_id == MASK_ID
    DraftHead(hc).check_compatible(target)
    with pytest.raises(ValueError, match="mask_token_id"):
        DraftHeadConfig.for_target(target)
    over = DraftHeadConfig.for_target(
        target, mask_token_id=MASK_ID, target_layer_ids=[7], intermediate_size=96
    )
    assert over.target_layer_ids == [7] and over.intermediate_size == 96


# ---- save / load --------------------------------------------------------------------------------------


def test_save_load_roundtrip(tmp_path) -> None:
    head = make_head()
    head.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3"
    assert saved["block_size"] == 8
    assert saved["num_target_layers"] == TARGET_LAYERS
    assert set(saved["dflash_config"]) == {
        "causal_head",
        "target_layer_ids",
        "mask_token_id",
        "target_hidden_size",
    }
    assert saved["dflash_config"]["target_layer_ids"] == [1, 5]
    assert saved["dflash_config"]["mask_token_id"] == MASK_ID

    loaded = DraftHead.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.config, DraftHeadConfig)
    assert loaded.config.dflash_config == head.config.dflash_config
    sd0, sd1 = head.state_dict(), loaded.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    embeds, taps, pos = rand_inputs()
    with torch.no_grad():
        assert torch.equal(head(embeds, pos, context=taps), loaded(embeds, pos, context=taps))


def test_parameter_inventory() -> None:
    head = make_head()
    names = [n for n, _ in head.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert not any(isinstance(m, torch.nn.Embedding) for m in head.modules())
    assert head.get_input_embeddings() is None and head.get_output_embeddings() is None
    assert head.fc.weight.shape == (H, N_TAPS * H)
    assert head.fc.bias is None
    expected_layer = {
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(2) for n in expected_layer
    }
    assert set(names) == expected
    # GQA shapes: 4 query heads, 2 kv heads of 16
    attn = head.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, H) and attn.k_proj.weight.shape == (32, H)


def test_init_weights() -> None:
    torch.manual_seed(0)
    head = DraftHead(tiny_head_config(num_hidden_layers=4, intermediate_size=512))
    assert torch.all(head.norm.weight == 1) and torch.all(head.layers[0].self_attn.q_norm.weight == 1)
    std = head.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - head.config.initializer_range) < 0.003


# ---- in-block attention modes -------------------------------------------------------------------------


def _perturb_row(embeds: torch.Tensor, row: int) -> torch.Tensor:
    out = embeds.clone()
    out[:, row] += torch.randn_like(out[:, row])
    return out


@torch.no_grad()
def test_causal_vs_bidirectional() -> None:
    head = make_head()
    embeds, taps, pos = rand_inputs(Q=6)
    changed = _perturb_row(embeds, 4)
    for mode in ("causal", "bidirectional"):
        a = head(embeds, pos, context=taps, in_block=mode)
        b = head(changed, pos, context=taps, in_block=mode)
        assert not torch.allclose(a[:, 4:], b[:, 4:])
        if mode == "causal":
            assert torch.equal(a[:, :4], b[:, :4])
        else:
            assert not torch.allclose(a[:, :4], b[:, :4], atol=1e-4)


@torch.no_grad()
def test_in_block_default_follows_config() -> None:
    embeds, taps, pos = rand_inputs()
    causal_head = make_head(causal=True)
    assert torch.equal(
        causal_head(embeds, pos, context=taps), causal_head(embeds, pos, context=taps, in_block="causal")
    )
    bidi_head = make_head(causal=False)
    assert torch.equal(
        bidi_head(embeds, pos, context=taps), bidi_head(embeds, pos, context=taps, in_block="bidirectional")
    )
    with pytest.raises(ValueError, match="in_block"):
        bidi_head(embeds, pos, context=taps, in_block="sideways")


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


@torch.no_grad()
def test_tree_mask() -> None:
    head = make_head()
    embeds, taps, _ = rand_inputs(Q=6)
    T = taps.shape[1]
    chain = ancestor_mask([-1, 0, 1, 2, 3, 4])
    pos = torch.arange(T, T + 6).expand(2, 6)
    causal = head(embeds, pos, context=taps, in_block="causal")
    assert torch.allclose(head(embeds, pos, context=taps, in_block=chain), causal, atol=1e-6)
    assert torch.allclose(head(embeds, pos, context=taps, in_block=chain.expand(2, 6, 6)), causal, atol=1e-6)

    # root 0; children 1, 2 of 0; 3 child of 1; 4 child of 2; 5 child of 3
    parents = [-1, 0, 0, 1, 2, 3]
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    tree = ancestor_mask(parents)
    tpos = (T + depth).expand(2, 6)
    base = head(embeds, tpos, context=taps, in_block=tree)
    # change node 2 (sibling of 1, not an ancestor of 1, 3, 5)
    out = head(_perturb_row(embeds, 2), tpos, context=taps, in_block=tree)
    for i in (0, 1, 3, 5):
        assert torch.equal(base[:, i], out[:, i]), i
    for i in (2, 4):
        assert not torch.allclose(base[:, i], out[:, i]), i
    # the same node as a path: a branch computed alone equals its rows in the tree
    path = [0, 2, 4]
    alone = head(embeds[:, path], tpos[:, path], context=taps, in_block="causal")
    assert torch.allclose(alone, base[:, path], atol=1e-5)


# ---- cache --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_incremental_cache_matches_full_context() -> None:
    head = make_head()
    embeds, taps, _ = rand_inputs(Q=5, T=10)
    cache = head.new_cache()
    assert isinstance(cache, HeadCache) and cache.length == 0

    pos1 = torch.arange(6, 11).expand(2, 5)
    out1 = head(embeds, pos1, context=taps[:, :6], cache=cache)
    assert cache.length == 6
    assert torch.allclose(out1, head(embeds, pos1, context=taps[:, :6]), atol=1e-5)

    pos2 = torch.arange(10, 15).expand(2, 5)
    out2 = head(embeds, pos2, context=taps[:, 6:], cache=cache)
    assert cache.length == 10
    assert all(k.shape == (2, 2, 10, 16) for k in cache.keys)
    full = head(embeds, pos2, context=taps)
    assert torch.allclose(out2, full, atol=1e-5)

    # no new context: attends to the cache only, block K/V are not stored
    out3 = head(embeds, pos2, cache=cache)
    assert cache.length == 10
    assert torch.allclose(out3, full, atol=1e-5)

    # crop back to 6 and re-append the same rows: same as before
    cache.crop(6)
    assert cache.length == 6
    assert torch.allclose(head(embeds, pos2, context=taps[:, 6:], cache=cache), full, atol=1e-5)
    cache.crop(-4)
    assert cache.length == 6
    cache.reset()
    assert cache.length == 0 and cache.keys == [None, None]


@torch.no_grad()
def test_context_positions_default() -> None:
    head = make_head()
    embeds, taps, pos = rand_inputs()
    T = taps.shape[1]
    a = head(embeds, pos, context=taps)
    b = head(embeds, pos[0], context=taps, context_positions=torch.arange(T))
    assert torch.equal(a, b)
    c = head(embeds, pos, context=taps, context_positions=torch.arange(T) + 3)
    assert not torch.allclose(a, c)


# ---- explicit masks and packing -----------------------------------------------------------------------


@torch.no_grad()
def test_explicit_attn_mask_matches_modes() -> None:
    head = make_head()
    embeds, taps, pos = rand_inputs(Q=6, T=9)
    for mode in ("causal", "bidirectional"):
        blk = torch.ones(6, 6, dtype=torch.bool)
        if mode == "causal":
            blk = blk.tril()
        mask = torch.cat([torch.ones(6, 9, dtype=torch.bool), blk], dim=-1)
        expected = head(embeds, pos, context=taps, in_block=mode)
        assert torch.allclose(head(embeds, pos, context=taps, attn_mask=mask), expected, atol=1e-6)
        assert torch.allclose(
            head(embeds, pos, context=taps, attn_mask=mask.expand(2, 6, 15)), expected, atol=1e-6
        )
    with pytest.raises(ValueError, match="attn_mask"):
        head(embeds, pos, context=taps, attn_mask=torch.ones(6, 6, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
@torch.no_grad()
def test_packed_blocks_equal_separate_calls(mode: str) -> None:
    head = make_head()
    Bk, T = 4, 12
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(1, T, N_TAPS * H, generator=g)
    anchors = [3, 8]
    embeds = torch.randn(1, 2 * Bk, H, generator=g)
    pos = torch.cat([torch.arange(p, p + Bk) for p in anchors]).unsqueeze(0)

    blk = torch.ones(Bk, Bk, dtype=torch.bool)
    if mode == "causal":
        blk = blk.tril()
    mask = torch.zeros(2 * Bk, T + 2 * Bk, dtype=torch.bool)
    for b, p in enumerate(anchors):
        rows = slice(b * Bk, (b + 1) * Bk)
        mask[rows, :p] = True  # context rows strictly before the anchor
        mask[rows, T + b * Bk : T + (b + 1) * Bk] = blk
    packed = head(embeds, pos, context=taps, attn_mask=mask)

    for b, p in enumerate(anchors):
        rows = slice(b * Bk, (b + 1) * Bk)
        alone = head(embeds[:, rows], pos[:, rows], context=taps[:, :p], in_block=mode)
        assert torch.allclose(packed[:, rows], alone, atol=1e-5)


# ---- the context path ---------------------------------------------------------------------------------


@torch.no_grad()
def test_context_enters_only_through_kv() -> None:
    head = make_head()
    embeds, taps, pos = rand_inputs(Q=5, T=7)
    none = head(embeds, pos)
    zero = head(embeds, pos, context=torch.zeros_like(taps))
    assert not torch.allclose(none, zero)

    # every module that sees a context-length (T=7) tensor: only the fusion and the K/V projections
    T = taps.shape[1]
    seen: set[str] = set()

    def hook(name):
        def fn(module, args, output):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.dim() >= 3 and t.shape[1] == T for t in tensors):
                seen.add(name)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in head.named_modules() if n]
    head(embeds, pos, context=taps)
    for h in handles:
        h.remove()
    param_modules = {n for n in seen if any(True for _ in head.get_submodule(n).parameters(recurse=False))}
    expected = {"fc", "hidden_norm"} | {
        f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj", "k_norm")
    }
    assert param_modules == expected
    assert not any(".mlp" in n or "layernorm" in n or "q_proj" in n or "o_proj" in n for n in seen)

    # fuse is fc + hidden_norm
    assert torch.equal(head.fuse(taps), head.hidden_norm(head.fc(taps)))


def test_gradients_and_checkpointing() -> None:
    embeds, taps, pos = rand_inputs()
    grads = []
    for ckpt in (False, True):
        head = make_head()
        head.train()
        if ckpt:
            head.activation_checkpointing_enable()
            assert head.gradient_checkpointing
        out = head(embeds, pos, context=taps)
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in head.named_parameters()})
    assert all(g is not None for g in grads[0].values())
    assert all(torch.count_nonzero(g) > 0 for g in grads[0].values())
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


# ---- compatibility ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head_kw", "target_kw", "field"),
    [
        (
            {
                "dflash_config": {
                    "target_layer_ids": [1, 5],
                    "mask_token_id": MASK_ID,
                    "target_hidden_size": 32,
                }
            },
            {},
            "target_hidden_size",
        ),
        (
            {
                "dflash_config": {
                    "target_layer_ids": [1, 5],
                    "mask_token_id": MASK_ID,
                    "target_hidden_size": 32,
                }
            },
            {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1},
            "hidden_size",
        ),
        ({}, {"vocab_size": 256}, "vocab_size"),
        ({"num_target_layers": None}, {"num_hidden_layers": 4}, "target_layer_ids"),
        ({}, {"num_hidden_layers": 6}, "num_target_layers"),
        (
            {"dflash_config": {"target_layer_ids": [1, 5], "mask_token_id": VOCAB, "target_hidden_size": H}},
            {},
            "mask_token_id",
        ),
        (
            {"dflash_config": {"target_layer_ids": [1, 5], "mask_token_id": None, "target_hidden_size": H}},
            {},
            "mask_token_id",
        ),
        (
            {"dflash_config": {"target_layer_ids": [1, 5], "mask_token_id": 1, "target_hidden_size": H}},
            {},
            "mask_token_id",
        ),
    ],
)
def test_check_compatible_names_field(head_kw, target_kw, field) -> None:
    head = DraftHead(tiny_head_config(**head_kw))
    target = tiny_target_config(**target_kw)
    with pytest.raises(ValueError) as err:
        head.check_compatible(target)
    msg = str(err.value)
    assert f"{field}:" in msg
    if field == "hidden_size":  # only the head/target hidden mismatch, not the tap width
        assert "target_hidden_size:" not in msg
    if field == "num_target_layers":  # ids 1, 5 are still inside 6 layers
        assert "target_layer_ids:" not in msg


def test_check_compatible_ok() -> None:
    make_head().check_compatible(tiny_target_config())


# ---- blocks -------------------------------------------------------------------------------------------


def test_make_block() -> None:
    anchors = torch.tensor([5, 9])
    blk = make_block(anchors, 4, MASK_ID)
    assert blk.tolist() == [[5, MASK_ID, MASK_ID, MASK_ID], [9, MASK_ID, MASK_ID, MASK_ID]]
    head = make_head()
    assert head.mask_token_id == MASK_ID and head.block_size == 8
    assert head.make_block(anchors).shape == (2, 8)
    assert torch.equal(head.block_ids(anchors, 4), blk)
    with pytest.raises(ValueError, match="mask_token_id"):
        make_block(anchors, 4, None)
