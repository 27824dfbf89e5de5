"""The frozen-target wrapper: taps, logits and cache must match plain HF exactly; bad inputs fail clearly."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, LlamaConfig, LlamaForCausalLM

from jetflow_pl.runtime.hf_cache import cache_length, compact_cache
from jetflow_pl.target import TargetModel


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(1))


def test_taps_equal_hf_hidden_states(tiny_target_dir, ids):
    target = TargetModel.from_pretrained(tiny_target_dir, tap_layer_ids=[1, 0])
    hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    ref = hf(ids, output_hidden_states=True)
    out = target(ids)
    h = target.hidden_size
    assert out.taps.shape == (2, 11, 2 * h)
    # order follows tap_layer_ids: layer 1 first, then layer 0
    assert torch.equal(out.taps[..., :h], ref.hidden_states[2])
    assert torch.equal(out.taps[..., h:], ref.hidden_states[1])
    assert torch.equal(out.logits, ref.logits)


def test_logits_at_positions_and_incremental_cache(tiny_target_dir, ids):
    target = TargetModel.from_pretrained(tiny_target_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    ref = hf(ids).logits
    picked = target(ids, logits_positions=torch.tensor([0, 5, 10])).logits
    torch.testing.assert_close(picked, ref[:, [0, 5, 10]], rtol=0, atol=0)
    per_row = target(ids, logits_positions=torch.tensor([[1, 2], [3, 4]])).logits
    torch.testing.assert_close(per_row[0], ref[0, [1, 2]], rtol=0, atol=0)
    torch.testing.assert_close(per_row[1], ref[1, [3, 4]], rtol=0, atol=0)
    assert target(ids, logits_positions=None).logits is None
    # prefix then one step with the cache equals the full forward at the last position
    first = target(ids[:, :7], logits_positions="last")
    assert cache_length(first.cache) == 7
    step = target(ids[:, 7:], cache=first.cache, logits_positions="last")
    torch.testing.assert_close(step.logits, ref[:, -1:], rtol=1e-5, atol=1e-5)


def test_tree_rows_then_compaction_matches_linear_prefix(tiny_target_dir, ids):
    """Append 3 rows, keep rows 0 and 2: the next step sees exactly the linear prefix ids[:5] + [r0, r2]."""
    target = TargetModel.from_pretrained(tiny_target_dir)
    row = ids[:1]
    out = target(row[:, :5], logits_positions=None)
    extra = torch.tensor([[7, 8, 9]])
    # a tree: 7 is the root, 8 and 9 are siblings (9 must not see 8)
    visible = torch.ones(3, 8, dtype=torch.bool)
    visible[:, 5:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(1, 1, 3, 8).masked_fill(~visible, torch.finfo(torch.float32).min)
    target(
        extra,
        cache=out.cache,
        position_ids=torch.tensor([[5, 6, 6]]),
        attention_mask=mask,
        logits_positions=None,
    )
    compact_cache(out.cache, 5, torch.tensor([0, 2]))
    assert cache_length(out.cache) == 7
    nxt = target(torch.tensor([[3]]), cache=out.cache, logits_positions="last").logits
    ref = target(torch.cat([row[:, :5], torch.tensor([[7, 9, 3]])], 1), logits_positions="last").logits
    torch.testing.assert_close(nxt, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (1, 15), (2, 15), (4, 15), (40,)])
def test_few_row_logits_is_the_lm_head(tiny_target_dir, shape):
    """The draft's lm_head form (`few_row_logits`, transposed for some row counts) computes the same
    product as `lm_logits`, in every batch shape the draft and refine passes use."""
    target = TargetModel.from_pretrained(tiny_target_dir)
    hidden = torch.randn(*shape, target.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = target.lm_logits(hidden)
    got = target.few_row_logits(hidden)
    assert got.shape == ref.shape
    # the two forms sum the same H products in possibly different orders: each differs from the exact
    # sum by at most H * 2^-24 * sum_k |w_k h_k| (fp32 dot-product bound), so they differ by twice that
    scale = torch.abs(hidden) @ torch.abs(target.lm_head.weight).T
    bound = 2 * target.hidden_size * 2.0**-24 * scale
    assert bool((torch.abs(got - ref) <= bound).all())
    # a wrong operand order or reshape would put logits under the wrong rows: argmax per row must agree
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_frozen(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    assert not any(p.requires_grad for p in target.parameters())
    target.train()
    assert not target.model.training


def test_llama_family_supported(tmp_path, ids):
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(tmp_path, tap_layer_ids=[2])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids, output_hidden_states=True)
    assert torch.equal(target(ids).taps, ref.hidden_states[3])


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TargetModel.from_pretrained(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        TargetModel.from_pretrained(tmp_path)


def test_non_causal_lm_directory(tmp_path):
    BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="unsupported target architecture 'bert'"):
        TargetModel.from_pretrained(tmp_path)


def test_garbled_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the model config"):
        TargetModel.from_pretrained(tmp_path)


def test_layer_id_out_of_range(tiny_target_dir):
    n = json.loads((tiny_target_dir / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ValueError, match=f"target layer id {n} is out of range"):
        TargetModel.from_pretrained(tiny_target_dir, tap_layer_ids=[0, n])


def test_tokenizer_vocab_must_fit(tiny_target_dir):
    class FakeTokenizer:
        def __len__(self) -> int:
            return 4096

    target = TargetModel.from_pretrained(tiny_target_dir)
    with pytest.raises(ValueError, match="tokenizer has 4096 tokens"):
        target.check_tokenizer(FakeTokenizer())
