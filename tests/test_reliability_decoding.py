"""Decoding robustness and numerical faults (issue 9): every edge has one defined behaviour.

The real tiny target (tests/conftest.py) and a seeded random head on the torch backend; the expected
tokens always come from HF `generate()` of the target alone, so "defined" also means "still lossless".
Behaviours and messages are listed in docs/FAILURES.md.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB
from transformers import AutoModelForCausalLM

from jetflow_pl.decoding import ARGenerator, SamplingConfig, SpeculativeGenerator
from jetflow_pl.errors import NumericalError, UserInputError, check_finite
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.backend import DEFAULT_MAX_BUDGET
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

MASK_ID = TINY_VOCAB - 1  # the mask token is the last id of the vocabulary
PROMPT = [5, 17, 33, 8, 61, 12, 40]

pytestmark = pytest.mark.usefixtures("one_thread")


def make_head(target: TargetModel, seed: int = 0, mask_token_id: int = MASK_ID) -> DraftHead:
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=1, block_size=8, mask_token_id=mask_token_id
    )
    return DraftHead(cfg).to(target.dtype).eval()


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=0,
        min_new_tokens=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    hf.generation_config.eos_token_id = None
    return target, hf


@pytest.fixture(scope="module")
def gen(tiny) -> SpeculativeGenerator:
    target, _ = tiny
    return SpeculativeGenerator(TorchBackend(target, make_head(target)), budget=16, width=4)


# ------------------------------------------------------------------------------------------ prompts
def test_empty_prompt_is_a_user_error_on_every_generator(tiny, gen):
    target, _ = tiny
    for g in (gen, ARGenerator(TorchBackend(target))):
        for empty in ([], torch.empty(0, dtype=torch.long)):
            with pytest.raises(UserInputError, match="prompt is empty: at least one token"):
                g.generate(empty, 4)
    # the generator still works afterwards (no half-reset state)
    assert len(gen.generate(PROMPT, 3).tokens) == 3


def test_prompt_at_the_context_limit(tiny, gen):
    """prompt + max_new_tokens == limit runs (last positions included); one more is refused up front."""
    target, hf = tiny
    limit = target.config.max_position_embeddings
    long_prompt = (PROMPT * limit)[: limit - 2]
    res = gen.generate(long_prompt, 2)  # the tree is capped to depth 1 for the last round
    assert res.tokens == hf_greedy(hf, long_prompt, 2)
    full = (PROMPT * limit)[:limit]
    assert gen.generate(full, 0).tokens == []  # a full window with nothing to generate is fine
    with pytest.raises(UserInputError, match=f"exceeds the target's context limit of {limit} positions"):
        gen.generate(full, 1)
    with pytest.raises(UserInputError, match=rf"prompt \({limit - 2} tokens\) \+ max_new_tokens \(3\)"):
        gen.generate(long_prompt, 3)


def test_prompt_ids_outside_the_vocabulary_or_batched_are_refused(tiny, gen):
    """Out-of-range ids would be a device-side assert on CUDA; a [2, T] batch would be glued into one."""
    with pytest.raises(
        UserInputError,
        match=rf"prompt token id {TINY_VOCAB} is outside the target's vocabulary \[0, {TINY_VOCAB - 1}\]",
    ):
        gen.generate([5, TINY_VOCAB], 2)
    with pytest.raises(UserInputError, match="prompt token id -1 is outside"):
        gen.generate([-1, 5], 2)
    with pytest.raises(UserInputError, match=r"one sequence \(\[T\] or \[1, T\]\), got shape \[2, 3\]"):
        gen.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), 2)
    assert gen.generate(torch.tensor([PROMPT]), 3).tokens == gen.generate(PROMPT, 3).tokens  # [1, T] is fine


# ------------------------------------------------------------------------------------------ lengths
def test_max_new_tokens_zero_and_one_greedy_and_sampled(tiny, gen):
    _, hf = tiny
    ref = hf_greedy(hf, PROMPT, 1)
    for sampling in (None, SamplingConfig(temperature=0.8, seed=3)):
        zero = gen.generate(PROMPT, 0, sampling)
        assert zero.tokens == [] and zero.num_rounds == 0 and zero.finish_reason == "length"
        one = gen.generate(PROMPT, 1, sampling)
        assert len(one.tokens) == 1 and one.num_rounds == 0 and one.finish_reason == "length"
    assert gen.generate(PROMPT, 1).tokens == ref  # the single token comes from the prefill logits
    with pytest.raises(UserInputError, match="max_new_tokens must be >= 0, got -1"):
        gen.generate(PROMPT, -1)


def test_eos_as_the_first_token_stops_before_any_round(tiny):
    target, hf = tiny
    first = hf_greedy(hf, PROMPT, 1)[0]
    for g in (
        SpeculativeGenerator(TorchBackend(target, make_head(target)), budget=16, eos_token_id=first),
        ARGenerator(TorchBackend(target), eos_token_id=[first, 1]),
    ):
        res = g.generate(PROMPT, 10)
        assert res.tokens == [first] and res.finish_reason == "eos" and res.num_rounds == 0
        assert res.tau == 0.0 and res.decode_tokens_per_s == 0.0  # no round: no division by zero


# ------------------------------------------------------------------------------------------ budgets
def test_budget_zero_is_autoregressive_and_lossless(tiny):
    target, hf = tiny
    res = SpeculativeGenerator(TorchBackend(target, make_head(target)), budget=0).generate(PROMPT, 8)
    assert res.tokens == hf_greedy(hf, PROMPT, 8)
    assert set(res.accept_lengths) == {1}  # one token per target forward: no drafting at all


class LimitedBackend(TorchBackend):
    """A backend that states a tree-size limit, as an engine built for a fixed profile does."""

    max_tree_nodes = 17


def test_budget_above_the_backend_limit_is_refused_before_decoding(tiny):
    target, hf = tiny
    head = make_head(target)
    with pytest.raises(UserInputError, match=f"budget {DEFAULT_MAX_BUDGET + 1} exceeds this backend's limit"):
        SpeculativeGenerator(TorchBackend(target, head), budget=DEFAULT_MAX_BUDGET + 1)
    SpeculativeGenerator(TorchBackend(target, head), budget=DEFAULT_MAX_BUDGET)  # the limit itself is fine
    with pytest.raises(UserInputError, match="refine_factor 4 exceeds"):
        SpeculativeGenerator(TorchBackend(target, head), budget=300, refine_factor=4)
    with pytest.raises(UserInputError, match=r"limit of 16 draft tokens per tree \(LimitedBackend\)"):
        SpeculativeGenerator(LimitedBackend(target, head), budget=17)
    res = SpeculativeGenerator(LimitedBackend(target, head), budget=16).generate(PROMPT, 8)
    assert res.tokens == hf_greedy(hf, PROMPT, 8)
    with pytest.raises(UserInputError, match="budget must be >= 0, got -1"):
        SpeculativeGenerator(TorchBackend(target, head), budget=-1)


# ------------------------------------------------------------------------------------------ mask token
def test_mask_token_at_the_end_of_the_vocabulary(tiny):
    """mask id = vocab - 1 works, a draft that proposes the mask token itself is still lossless, and
    mask id = vocab (one past the end, e.g. a tokenizer-added token the model lacks) fails up front."""
    target, hf = tiny
    backend = TorchBackend(target, make_head(target, mask_token_id=TINY_VOCAB - 1))
    real_draft = backend.draft_batch

    def mask_heavy(slots, anchors, depths: int | None = None) -> list[torch.Tensor]:
        lps = [lp.clone() for lp in real_draft(slots, anchors, depths)]
        for lp in lps:
            lp[:, MASK_ID] = 0.0  # the mask token becomes every depth's favourite draft token
        return lps

    backend.draft_batch = mask_heavy
    drafted: list[int] = []
    real_verify = backend.verify_batch

    def spy(slots, trees):
        for tree in trees:
            drafted.extend(tree.tokens[1:].tolist())
        return real_verify(slots, trees)

    backend.verify_batch = spy
    res = SpeculativeGenerator(backend, budget=16, width=2).generate(PROMPT, 12)
    assert MASK_ID in drafted  # the tree really carried the mask token
    assert res.tokens == hf_greedy(hf, PROMPT, 12)
    with pytest.raises(
        ValueError, match=rf"mask_token_id: {TINY_VOCAB} is not a token id in \[0, {TINY_VOCAB - 1}\]"
    ):
        TorchBackend(target, make_head(target, mask_token_id=TINY_VOCAB))


# ------------------------------------------------------------------------------------------ numerics
def _blow_up(head: DraftHead, scale: float) -> DraftHead:
    with torch.no_grad():
        for layer in head.layers:
            layer.mlp.up_proj.weight.mul_(scale)
            layer.mlp.gate_proj.weight.mul_(scale)
    return head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_finite_flags_nan_and_plus_inf_anywhere_and_passes_minus_inf(dtype):
    """The one-reduction check (the maximum) against the element-wise definition, at every position of
    a `[5, 64]` block: NaN or +inf anywhere is refused; -inf (masked log-probs, a draft vocabulary's
    ids outside it) is not, even where a whole row or the whole tensor is -inf; an empty tensor passes."""
    base = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    check_finite(base, "m", "here", "advice")
    for value in (float("nan"), float("inf")):
        for i in range(base.numel()):
            x = base.clone().view(-1)
            x[i] = value
            with pytest.raises(NumericalError, match="m produced NaN/inf here: advice"):
                check_finite(x.view(5, 64), "m", "here", "advice")
    masked = base.clone()
    masked[2] = float("-inf")
    masked[:, 7] = float("-inf")
    check_finite(masked, "m", "here", "advice")
    check_finite(torch.full((3, 4), float("-inf"), dtype=dtype), "m", "here", "advice")
    check_finite(torch.empty(0, 64, dtype=dtype), "m", "here", "advice")


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float16, 1e3), (torch.bfloat16, 1e25)])
def test_head_overflow_in_half_precision_is_detected(tiny_target_dir, tiny, dtype, scale):
    """Weights that fp32 handles overflow in fp16/bf16: the decode loop stops with one clear error
    instead of building a tree from NaN (and, for bf16, a scale that overflows even its range)."""
    target32, hf = tiny
    big = _blow_up(make_head(target32), scale if dtype == torch.float16 else 1.0)
    ok = SpeculativeGenerator(TorchBackend(target32, big), budget=8).generate(PROMPT, 6)
    assert ok.tokens == hf_greedy(hf, PROMPT, 6)  # same weights in fp32: finite, lossless
    target = TargetModel.from_pretrained(tiny_target_dir, dtype=dtype)
    head = _blow_up(make_head(target), scale)
    gen = SpeculativeGenerator(TorchBackend(target, head), budget=8)
    with pytest.raises(
        NumericalError, match=f"the draft head produced NaN/inf log-probs at position {len(PROMPT)}"
    ):
        gen.generate(PROMPT, 6)


def test_target_overflow_is_detected_not_decoded(tiny_target_dir):
    """NaN/inf target logits would make argmax pick garbage silently: refused at prefill and verify."""
    target = TargetModel.from_pretrained(tiny_target_dir, dtype=torch.float16)
    with torch.no_grad():
        target.final_norm.weight.mul_(1e5)  # lm_head input beyond the fp16 range
    gen = SpeculativeGenerator(TorchBackend(target, make_head(target)), budget=8)
    with pytest.raises(NumericalError, match="the target produced NaN/inf logits at the end of the prompt"):
        gen.generate(PROMPT, 4)
