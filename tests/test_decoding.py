"""The decode loop is lossless: greedy speculative output equals HF greedy generate() token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB
from transformers import AutoModelForCausalLM

from jetflow_pl.decoding import ARGenerator, SamplingConfig, SpeculativeGenerator
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree, Top2GapCap

BUDGETS = (1, 4, 16, 64, 256)
MASK_ID = TINY_VOCAB - 1
EOS = 1  # the toy convention (pad 0, eos 1, mask 2); HF generate() stops on it too


def make_head(target: TargetModel, causal: bool, seed: int = 0, block_size: int = 16) -> DraftHead:
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=1, block_size=block_size, causal=causal, mask_token_id=MASK_ID
    )
    return DraftHead(cfg).eval()


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts that avoid the toy special ids 0-2 (HF generate() reads 0 as padding)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, MASK_ID, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    x = torch.tensor([prompt])
    out = model.generate(
        x, do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, min_new_tokens=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    hf.generation_config.eos_token_id = None  # stop only where a test asks for it
    prompts = random_prompts(20, seed=3)
    refs = [hf_greedy(hf, p, 24, eos=EOS) for p in prompts]
    return target, hf, prompts, refs


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_greedy_lossless_tiny_random(tiny, causal):
    target, _, prompts, refs = tiny
    backend = TorchBackend(target, make_head(target, causal))
    mismatches = []
    for budget in BUDGETS:
        gen = SpeculativeGenerator(backend, budget=budget, width=4, eos_token_id=EOS)
        for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
            res = gen.generate(prompt, max_new_tokens=24)
            if res.tokens != ref:
                mismatches.append((budget, i))
            assert sum(res.accept_lengths) + 1 >= len(res.tokens)
    assert mismatches == []


def test_ar_generator_matches_hf(tiny):
    target, _, prompts, refs = tiny
    gen = ARGenerator(TorchBackend(target), eos_token_id=EOS)
    for prompt, ref in zip(prompts[:5], refs[:5], strict=True):
        res = gen.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        assert set(res.accept_lengths) == {1}  # one token per target forward


def test_chain_and_gap_policy_are_lossless(tiny):
    target, _, prompts, refs = tiny
    backend = TorchBackend(target, make_head(target, True, seed=1))
    for gen in (
        SpeculativeGenerator(backend, budget=15, width=1, eos_token_id=EOS),
        SpeculativeGenerator(backend, budget=32, width=4, policy=Top2GapCap(0.5), eos_token_id=EOS),
    ):
        assert [gen.generate(p, 24).tokens for p in prompts[:6]] == refs[:6]


def test_eos_stops_and_is_kept(tiny):
    target, hf, prompts, refs = tiny
    i = max(range(len(refs)), key=lambda j: len(refs[j]))
    assert len(refs[i]) > 6
    eos = refs[i][5]  # a token the target emits mid-sequence for prompt i
    gen = SpeculativeGenerator(
        TorchBackend(target, make_head(target, True)), budget=16, width=2, eos_token_id=eos
    )
    res = gen.generate(prompts[i], 24)
    assert res.tokens == hf_greedy(hf, prompts[i], 24, eos=eos)
    assert len(res.tokens) <= 6
    assert res.tokens[-1] == eos and res.finish_reason == "eos"


def test_max_new_tokens_edges(tiny):
    target, _, prompts, refs = tiny
    gen = SpeculativeGenerator(TorchBackend(target, make_head(target, True)), budget=16, eos_token_id=EOS)
    assert gen.generate(prompts[0], 0).tokens == []
    assert gen.generate(prompts[0], 1).tokens == refs[0][:1]
    assert gen.generate(prompts[0], 1).num_rounds == 0
    with pytest.raises(ValueError, match="prompt is empty"):
        gen.generate([], 4)
    with pytest.raises(ValueError, match="context limit"):
        gen.generate(prompts[0], target.config.max_position_embeddings)


class OracleBackend(TorchBackend):
    """Drafts the target's own greedy continuation (known in advance) as one-hot log-probs."""

    def __init__(self, target, head, prompt_len: int, continuation: list[int]):
        super().__init__(target, head)
        self.seq = continuation
        self.prompt_len = prompt_len

    def draft_batch(self, slots, anchors, depths: int | None = None) -> list[torch.Tensor]:
        super().draft_batch(slots, anchors, depths)  # keep the head's context bookkeeping exercised
        (slot,) = slots  # one sequence: the oracle knows one continuation
        d = self.block_size - 1
        start = self.past_length(slot) - self.prompt_len + 1  # index of the token after the anchor
        lp = torch.full((d, TINY_VOCAB), -1e4)
        for k in range(d):
            j = start + k
            lp[k, self.seq[j] if j < len(self.seq) else 0] = 0.0
        return [torch.log_softmax(lp, dim=-1)]


def test_oracle_drafter_reaches_block_size(tiny):
    target, hf, prompts, _ = tiny
    block = 8
    prompt = prompts[1]
    max_new = 1 + 5 * block + 3
    ref = hf_greedy(hf, prompt, max_new + block)
    backend = OracleBackend(target, make_head(target, True, block_size=block), len(prompt), ref)
    res = SpeculativeGenerator(backend, budget=block - 1, width=1).generate(prompt, max_new)
    assert res.tokens == ref[:max_new]
    full_rounds = res.accept_lengths[:-1]
    assert len(full_rounds) >= 5 and all(a == block for a in full_rounds)
    assert res.tau > block - 1


def test_sampling_same_seed_reproduces(tiny):
    target, _, prompts, _ = tiny
    gen = SpeculativeGenerator(TorchBackend(target, make_head(target, True)), budget=16, width=3)
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.95, seed=123)
    a = gen.generate(prompts[2], 20, cfg).tokens
    b = gen.generate(prompts[2], 20, cfg).tokens
    c = gen.generate(prompts[2], 20, SamplingConfig(temperature=1.0, top_k=20, top_p=0.95, seed=124)).tokens
    assert a == b
    assert a != c


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: significance 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


def test_speculative_sampling_matches_ar_distribution(tiny):
    """Chi-square homogeneity test of (token 2, token 3) samples: speculative vs AR, independent seeds."""
    target, _, prompts, _ = tiny
    prompt = prompts[4]
    spec = SpeculativeGenerator(TorchBackend(target, make_head(target, True)), budget=8, width=3)
    ar = ARGenerator(TorchBackend(target))
    n = 1000
    counts_spec: dict[tuple[int, ...], int] = {}
    counts_ar: dict[tuple[int, ...], int] = {}
    for s in range(n):
        for gen, counts, seed in ((spec, counts_spec, s), (ar, counts_ar, n + s)):
            key = tuple(
                gen.generate(prompt, 3, SamplingConfig(temperature=1.0, top_k=4, seed=seed)).tokens[1:3]
            )
            counts[key] = counts.get(key, 0) + 1
    keys = sorted(set(counts_spec) | set(counts_ar))
    assert len(keys) > 4  # a real distribution, not a near-deterministic one
    stat = sum(
        (counts_spec.get(k, 0) - counts_ar.get(k, 0)) ** 2 / (counts_spec.get(k, 0) + counts_ar.get(k, 0))
        for k in keys
    )
    assert stat < chi2_critical(len(keys) - 1), (stat, counts_spec, counts_ar)


def test_mismatched_head_fails_before_decoding(tiny):
    target, _, _, _ = tiny
    cfg = DraftHeadConfig.for_target(target.config, num_hidden_layers=1, mask_token_id=MASK_ID)
    cfg.dflash_config = {**cfg.dflash_config, "target_layer_ids": [0, 99]}
    with pytest.raises(ValueError, match="target_layer_ids"):
        TorchBackend(target, DraftHead(cfg))


def test_refinement_root_row_equals_draft_and_is_path_conditioned(tiny):
    target, _, prompts, _ = tiny
    backend = TorchBackend(target, make_head(target, True, seed=2))
    backend.prefill(torch.tensor(prompts[0]))
    anchor = 5
    depth_lp = backend.draft(anchor)
    # root -> a(10), root -> b(11), a -> c(12)
    tree = DraftTree.from_parents([anchor, 10, 11, 12], [-1, 0, 0, 1])
    lp = backend.refine(tree)
    torch.testing.assert_close(lp[0], depth_lp[0], rtol=1e-4, atol=1e-5)  # offset 1 of the block
    # changing sibling b's token leaves a's and c's children distributions unchanged
    other = backend.refine(DraftTree.from_parents([anchor, 10, 40, 12], [-1, 0, 0, 1]))
    torch.testing.assert_close(other[[0, 1, 3]], lp[[0, 1, 3]], rtol=1e-5, atol=1e-6)
    # ... but changing a's token changes c's (its descendant's) distribution
    moved = backend.refine(DraftTree.from_parents([anchor, 41, 11, 12], [-1, 0, 0, 1]))
    assert not torch.allclose(moved[3], lp[3])


def test_refinement_is_lossless(tiny):
    target, _, prompts, refs = tiny
    backend = TorchBackend(target, make_head(target, True, seed=3))
    gen = SpeculativeGenerator(backend, budget=16, width=4, eos_token_id=EOS, refine_factor=2)
    assert [gen.generate(p, 24).tokens for p in prompts[:8]] == refs[:8]
    with pytest.raises(ValueError, match="refine_factor"):
        SpeculativeGenerator(backend, budget=16, refine_factor=1)


def test_tree_never_leaves_the_context_window(tiny):
    """Near the context limit the drafted depths shrink so every node position stays < max positions."""
    target, hf, prompts, _ = tiny
    limit = target.config.max_position_embeddings
    prompt = (prompts[5] * limit)[: limit - 6]
    backend = TorchBackend(target, make_head(target, True))
    seen: list[int] = []
    verify_batch = backend.verify_batch

    def spy(slots, trees):
        seen.extend(backend.past_length(s) + int(t.depths.max()) for s, t in zip(slots, trees, strict=True))
        return verify_batch(slots, trees)

    backend.verify_batch = spy
    res = SpeculativeGenerator(backend, budget=64, width=4).generate(prompt, 6)
    assert res.tokens == hf_greedy(hf, prompt, 6)
    assert seen and max(seen) <= limit - 1


def test_reused_backend_gives_the_same_result_as_a_fresh_one(tiny):
    """A backend reused across prompts must not carry the previous sequence's queued head context."""
    target = tiny[0]
    head = make_head(target, causal=True, seed=3)
    first, second = random_prompts(2, seed=11)
    reused = TorchBackend(target, head)
    # the head's context rows when a request finishes (a finished request's KV is freed right after)
    at_release: list[int] = []
    release = reused.release
    reused.release = lambda slot: (at_release.append(reused.head_kv.length(slot)), release(slot))[-1]
    SpeculativeGenerator(reused, budget=16, width=2).generate(first, 12)  # leaves taps queued
    got = SpeculativeGenerator(reused, budget=16, width=2).generate(second, 12)
    want = SpeculativeGenerator(TorchBackend(target, head), budget=16, width=2).generate(second, 12)
    assert got.tokens == want.tokens
    assert got.accept_lengths == want.accept_lengths
    # head context rows: the prompt plus every committed row except the last round's (still queued);
    # a stale queue from the first prompt would add rows here
    assert at_release[-1] == len(second) + sum(got.accept_lengths[:-1])
    assert reused.head_kv.length() == 0 and len(reused.taps) == 0  # and the finished request was freed
