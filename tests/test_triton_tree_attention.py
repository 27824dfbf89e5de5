"""The Triton tree-attention kernel against `tree_attention_reference`.

The CPU tests run the kernel under the Triton interpreter (`TRITON_INTERPRET=1`, set per test by a
fixture and read by the kernel wrapper at call time), so the indexing, GQA packing, packed-mask bit
tests and online softmax are checked on machines without a GPU. The interpreter's cost is per Triton op,
so the large-N cases use small head dims and few heads. The `gpu` test runs the compiled kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional: pip install triton)")

from jetflow_pl.masks import pack_tree_batch  # noqa: E402
from jetflow_pl.ops import triton_tree_attention as tta  # noqa: E402
from jetflow_pl.ops.tree_attention import tree_attention_reference  # noqa: E402
from jetflow_pl.tree import DraftTree, build_tree, pack_mask  # noqa: E402

FP32_TOL = 1e-5


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernel under the Triton interpreter for this test only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    """A random tree of `n` nodes stored parent-before-child (each node's parent drawn uniformly)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents))


def make_inputs(
    b: int, hq: int, hkv: int, n: int, p: int, d: int, gen: torch.Generator, dtype=torch.float32
) -> tuple[torch.Tensor, ...]:
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return rnd(b, hq, n, d), rnd(b, hkv, p, d), rnd(b, hkv, p, d), rnd(b, hkv, n, d), rnd(b, hkv, n, d)


def check(q, pk, pv, k, v, mask, scale, past_lengths=None, tol=FP32_TOL, **kw) -> None:
    out = tta.tree_attention_triton(q, pk, pv, k, v, mask, scale, past_lengths, **kw)
    ref = tree_attention_reference(q, pk, pv, k, v, mask, scale, past_lengths)
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


# (B, Hq, Hkv, N, P, d, block_m, block_n): default tiles and forced small tiles (many tile boundaries)
CASES = [
    (1, 2, 1, 1, 0, 16, None, None),  # a lone root, no prefix
    (1, 2, 2, 7, 0, 16, None, None),  # P = 0, MHA
    (2, 4, 2, 20, 13, 16, 16, 16),  # GQA 2, ragged prefix, B = 2, small tiles
    (1, 4, 1, 33, 5, 16, 16, 16),  # GQA 4, N just over one word
    (1, 2, 1, 64, 70, 64, None, None),  # d 64, two words
    (1, 2, 1, 45, 17, 128, 32, 32),  # d 128, prefix and tree split across tiles
    (1, 1, 1, 100, 0, 16, 32, 32),  # four words, P = 0
    (1, 2, 1, 256, 40, 16, None, None),  # N = 256 (eight words), GQA packing across rows
]


@pytest.mark.parametrize(("b", "hq", "hkv", "n", "p", "d", "bm", "bn"), CASES)
def test_random_trees_match_reference(interpret, b, hq, hkv, n, p, d, bm, bn) -> None:
    gen = torch.Generator().manual_seed(1000 * n + 10 * p + d)
    tree = random_tree(n, gen)
    q, pk, pv, k, v = make_inputs(b, hq, hkv, n, p, d, gen)
    check(q, pk, pv, k, v, tree.packed_mask(), d**-0.5, block_m=bm, block_n=bn)


@pytest.mark.parametrize(
    ("n", "p", "splits", "bn"),
    [(5, 100, 2, 16), (40, 300, 3, 32), (33, 64, 4, 16), (9, 37, 8, 16), (70, 1000, 5, 64)],
)
def test_kv_splits_match_reference(interpret, n, p, splits, bn) -> None:
    """Flash-decoding splits of the prefix (ragged last split, more splits than tiles) + the combine."""
    gen = torch.Generator().manual_seed(n * p + splits)
    tree = random_tree(n, gen)
    q, pk, pv, k, v = make_inputs(1, 4, 2, n, p, 16, gen)
    check(q, pk, pv, k, v, tree.packed_mask(), 0.25, num_splits=splits, block_n=bn)


def batched_inputs(sizes, past_lengths, hq, hkv, d, gen, pad_past=5):
    """A batch of random trees of different sizes ([B, N, W] masks) with NaN in every padding prefix row."""
    masks = pack_tree_batch([random_tree(n, gen) for n in sizes])
    b, n = masks.batch_size, masks.num_nodes
    q, pk, pv, k, v = make_inputs(b, hq, hkv, n, max(past_lengths) + pad_past, d, gen)
    for i, length in enumerate(past_lengths):
        pk[i, :, length:] = float("nan")
        pv[i, :, length:] = float("nan")
    return q, pk, pv, k, v, masks.packed_mask, torch.tensor(past_lengths, dtype=torch.int32)


# (tree sizes, past lengths, Hq, Hkv, d, block_m, block_n, num_splits)
BATCHED = [
    ([5, 1, 12], [4, 0, 9], 4, 2, 16, None, None, None),  # a request with no prefix, a lone root
    ([40, 7], [0, 33], 2, 1, 16, 16, 16, None),  # multi-word request next to a one-word one
    ([256, 70, 3], [11, 0, 40], 2, 1, 16, None, None, None),  # N = 256, bit 31 in most rows
    ([20, 9, 14], [300, 17, 130], 4, 2, 16, None, 32, 4),  # KV splits: some splits only padding
]


@pytest.mark.parametrize(("sizes", "past", "hq", "hkv", "d", "bm", "bn", "splits"), BATCHED)
def test_batched_masks_and_past_lengths_match_reference(interpret, sizes, past, hq, hkv, d, bm, bn, splits):
    """Per-request masks and prefix lengths; padding prefix rows hold NaN and must never be loaded."""
    gen = torch.Generator().manual_seed(sum(sizes) + sum(past))
    q, pk, pv, k, v, mask, lengths = batched_inputs(sizes, past, hq, hkv, d, gen)
    out = tta.tree_attention_triton(
        q, pk, pv, k, v, mask, d**-0.5, lengths, block_m=bm, block_n=bn, num_splits=splits
    )
    ref = tree_attention_reference(q, pk, pv, k, v, mask, d**-0.5, lengths)
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    assert err <= FP32_TOL, f"max abs error {err:.3g} > {FP32_TOL}"
    # rows past a request's tree that have no prefix either see nothing: exactly 0
    empty = out[1, :, sizes[1] :] if past[1] == 0 else None
    if empty is not None:
        assert torch.equal(empty, torch.zeros_like(empty))


def test_shared_mask_with_past_lengths_and_clamping(interpret) -> None:
    """A shared [N, W] mask with per-request lengths (negative -> 0, > P -> P), as the reference does."""
    gen = torch.Generator().manual_seed(21)
    n, p = 24, 50
    tree = random_tree(n, gen)
    q, pk, pv, k, v = make_inputs(4, 2, 1, n, p, 16, gen)
    lengths = torch.tensor([50, 0, -3, 999], dtype=torch.int32)
    check(q, pk, pv, k, v, tree.packed_mask(), 0.25, lengths, block_n=16)


def test_build_tree_masks_match_reference(interpret) -> None:
    """Trees grown by `build_tree` (the decode loop's shape: wide near the root, N = budget + 1)."""
    gen = torch.Generator().manual_seed(7)
    for budget, width, p in ((15, 4, 0), (63, 3, 300)):
        logprobs = torch.log_softmax(torch.randn(6, 50, generator=gen), dim=-1)
        tree = build_tree(logprobs, root_token=1, budget=budget, width=width)
        n = tree.num_nodes
        q, pk, pv, k, v = make_inputs(1, 4, 2, n, p, 16, gen)
        check(q, pk, pv, k, v, tree.packed_mask(), 0.25)


def test_arbitrary_masks_including_bit31_and_empty_rows(interpret) -> None:
    """Any mask, not only ancestor masks: negative words (bit 31), rows that see later rows, empty rows.

    With P = 0 an empty row sees nothing; the reference returns zeros there and so must the kernel.
    """
    gen = torch.Generator().manual_seed(3)
    n = 70
    dense = torch.rand(n, n, generator=gen) < 0.4
    dense[:, 31] = True  # every row has bit 31 of word 0 set -> negative int32 words
    dense[5] = False
    dense[64] = False
    mask = pack_mask(dense)
    assert (mask < 0).any()
    for p in (0, 9):
        q, pk, pv, k, v = make_inputs(1, 2, 1, n, p, 16, gen)
        check(q, pk, pv, k, v, mask, 0.3, block_m=32, block_n=32)
    q, pk, pv, k, v = make_inputs(1, 2, 1, n, 0, 16, gen)
    out = tta.tree_attention_triton(q, pk, pv, k, v, mask, 0.3)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))


def test_mask_with_extra_words_and_strided_views(interpret) -> None:
    """Non-contiguous inputs (K/V slices of a bigger cache, transposed query) and a wider mask."""
    gen = torch.Generator().manual_seed(11)
    n, p, d = 40, 24, 16
    tree = random_tree(n, gen)
    mask = torch.cat([tree.packed_mask(), torch.full((n, 2), -1, dtype=torch.int32)], dim=1)[:, :3]
    cache_k = torch.randn(1, 2, p + 50, d, generator=gen)
    cache_v = torch.randn(1, 2, p + 50, d, generator=gen)
    q = torch.randn(1, n, 4, d, generator=gen).transpose(1, 2)  # [1, 4, N, d], non-contiguous
    k = torch.randn(1, 2, n, 2 * d, generator=gen)[..., ::2]  # strided head dim
    v = torch.randn(1, 2, n, d, generator=gen)
    check(q, cache_k[:, :, :p], cache_v[:, :, :p], k, v, mask, d**-0.5, block_m=16, block_n=16)


def test_half_precision_inputs(interpret) -> None:
    """fp16 inputs: fp32 accumulation, output in fp16 (tolerance of fp16 rounding of P and the output)."""
    gen = torch.Generator().manual_seed(5)
    n, p, d = 48, 20, 16
    tree = random_tree(n, gen)
    q, pk, pv, k, v = make_inputs(1, 2, 1, n, p, d, gen, dtype=torch.float16)
    out = tta.tree_attention_triton(q, pk, pv, k, v, tree.packed_mask(), d**-0.5)
    ref = tree_attention_reference(
        q.float(), pk.float(), pv.float(), k.float(), v.float(), tree.packed_mask(), d**-0.5
    )
    assert out.dtype == torch.float16
    assert (out.float() - ref).abs().max().item() < 5e-3


def test_bad_arguments_are_rejected(interpret) -> None:
    gen = torch.Generator().manual_seed(0)
    q, pk, pv, k, v = make_inputs(1, 2, 1, 8, 0, 16, gen)
    good = random_tree(8, gen).packed_mask()
    with pytest.raises(ValueError, match="int32"):
        tta.tree_attention_triton(q, pk, pv, k, v, good.to(torch.int64), 0.25)
    with pytest.raises(ValueError, match="packed_mask"):
        tta.tree_attention_triton(q, pk, pv, k, v, good[:4], 0.25)
    with pytest.raises(ValueError, match="GQA"):
        k2, v2, pk2 = k.expand(1, 2, 8, 16), v.expand(1, 2, 8, 16), pk.expand(1, 2, 0, 16)
        tta.tree_attention_triton(q[:, :1].expand(1, 3, 8, 16), pk2, pk2, k2, v2, good, 0.25)


def test_missing_triton_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without triton the wrapper raises ImportError naming the package and the reference fallback."""
    monkeypatch.setattr(tta, "tl", None)
    monkeypatch.setattr(tta, "triton", None)
    monkeypatch.setattr(tta, "_KERNELS", {})
    monkeypatch.setitem(__import__("sys").modules, "triton", None)
    monkeypatch.setitem(__import__("sys").modules, "triton.language", None)
    gen = torch.Generator().manual_seed(0)
    q, pk, pv, k, v = make_inputs(1, 1, 1, 4, 0, 16, gen)
    with pytest.raises(ImportError, match="pip install triton.*tree_attention_reference"):
        tta.tree_attention_triton(q, pk, pv, k, v, random_tree(4, gen).packed_mask(), 0.25)
    assert not tta.is_triton_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_kernel_on_gpu(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The compiled kernel on a GPU (fp32 exact to 1e-5 with ieee dots; half types to their rounding)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert os.environ.get("TRITON_INTERPRET") is None
    gen = torch.Generator().manual_seed(2)
    tol = {torch.float32: FP32_TOL, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for hq, hkv, n, p, d in ((8, 2, 16, 0, 64), (8, 8, 64, 500, 128), (32, 8, 256, 2048, 128)):
        tree = random_tree(n, gen)
        ins = [t.cuda() for t in make_inputs(1, hq, hkv, n, p, d, gen, dtype=dtype)]
        mask = tree.packed_mask().cuda()
        out = tta.tree_attention_triton(*ins, mask, d**-0.5)
        ref = tree_attention_reference(*[t.double() for t in ins], mask, d**-0.5)
        err = (out.double() - ref).abs().max().item()
        assert err <= tol, f"{dtype} N={n} P={p} d={d}: max abs error {err:.3g} > {tol}"
    # a batch: per-request masks and prefix lengths, NaN in the padding prefix rows (auto KV splits)
    q, pk, pv, k, v, mask, lengths = batched_inputs([256, 31, 90], [2000, 0, 700], 8, 2, 128, gen)
    ins = [t.to(dtype).cuda() for t in (q, pk, pv, k, v)]
    out = tta.tree_attention_triton(*ins, mask.cuda(), 128**-0.5, lengths.cuda())
    ref = tree_attention_reference(*[t.double() for t in ins], mask.cuda(), 128**-0.5, lengths.cuda())
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"{dtype} batched: max abs error {err:.3g} > {tol}"
