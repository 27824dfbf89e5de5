"""Training for the tree-causal pass (`path_fraction`): path-conditioned blocks in the packed forward.

The key check: a path-conditioned block of the packed training forward computes, for every query row,
exactly what the inference side (`TorchBackend.refine` on the chain tree of the same path) computes, so
the head is trained on the rows that `refine_factor` decoding runs. Tiny random target, CPU, seeded.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB
from tiny_heads import perturbed_head

from jetflow_pl.head import DraftHead
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.training import distill_step, prepare_blocks
from jetflow_pl.training.masks import path_block_masks
from jetflow_pl.training.module import DistillationModule
from jetflow_pl.training.step import target_features
from jetflow_pl.tree import DraftTree

MASK_ID = TINY_VOCAB - 1


def make_head(target: TargetModel, block_size: int, causal: bool = True, seed: int = 0) -> DraftHead:
    return perturbed_head(target, MASK_ID, block_size, causal, seed, layers=2).eval()


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return TargetModel.from_pretrained(tiny_target_dir)


def random_ids(B: int, S: int, seed: int) -> torch.Tensor:
    return torch.randint(3, MASK_ID, (B, S), generator=torch.Generator().manual_seed(seed))


def test_path_block_masks_hand_worked():
    first, path = path_block_masks(4, "causal")
    # rows: 0 anchor, 1..3 MASK queries at offsets 1..3, 4..5 path tokens x[p+1], x[p+2]
    want_path = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # anchor: itself
            [1, 1, 0, 0, 0, 0],  # query 1: anchor (= the MASK-only block's offset 1)
            [1, 0, 1, 0, 1, 0],  # query 2: anchor, x[p+1]; not query 1
            [1, 0, 0, 1, 1, 1],  # query 3: anchor, x[p+1], x[p+2]
            [1, 0, 0, 0, 1, 0],  # x[p+1]: anchor, itself
            [1, 0, 0, 0, 1, 1],  # x[p+2]: anchor, x[p+1], itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(path, want_path)
    want_first = torch.eye(6, dtype=torch.bool)
    want_first[:4, :4] = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(first, want_first)
    bidir_first, bidir_path = path_block_masks(4, "bidirectional")
    assert bidir_first[:4, :4].all() and torch.equal(bidir_path, want_path)  # the pass is tree-causal
    with pytest.raises(ValueError, match="block_size >= 3"):
        path_block_masks(2)


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_path_blocks_equal_the_refine_pass_on_the_true_path(target, packed):
    """Every query row of a path-conditioned block == `TorchBackend.refine`'s row for the same node of
    the chain tree [x[p], x[p+1], ..., x[p+bs-2]] after prefilling x[doc start : p]."""
    bs, B, S = 5, 2, 24
    head = make_head(target, bs, seed=1)
    target.set_taps(head.target_layer_ids)
    ids = random_ids(B, S, seed=2)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24]) if packed else None
    anchors = torch.tensor([[3, 10, 15], [1, 8, 19]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    bb = prepare_blocks(
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        doc_ids,
        block_size=bs,
        num_anchors=3,
        mask_token_id=MASK_ID,
        anchors=(anchors, valid),
        path_fraction=1.0,
    )
    assert bb.block_len == 2 * bs - 2 and bool(bb.is_path.all())
    taps, _ = target_features(target, ids, doc_ids, bb.context_positions)  # the training step's own
    with torch.no_grad():
        hidden = head(
            target.embed_tokens(bb.block_ids),
            bb.block_positions,
            context=taps,
            context_positions=bb.context_positions,
            attn_mask=bb.attn_mask,
        )
        L = bb.block_len
        for b in range(B):
            for a in range(3):
                p = int(anchors[b, a])
                d0 = int((doc_ids[b] == doc_ids[b, p]).nonzero()[0]) if packed else 0
                if p == d0:
                    continue  # refine needs a prefilled context (the backend has no empty prompt)
                backend = TorchBackend(target, head)
                backend.prefill(ids[b, d0:p])
                backend.draft(int(ids[b, p]))
                tree = DraftTree.chain(ids[b, p : p + bs - 1].tolist())
                want = backend.refine(tree)  # [bs-1, V]: children of the path nodes at depths 0..bs-2
                rows = hidden[b, a * L + 1 : a * L + bs]  # the query rows, offsets 1..bs-1
                got = torch.log_softmax(target.lm_head(rows).float(), dim=-1)
                # the same function in fp32 with another reduction order (packed masked attention vs a
                # KV cache): rounding is ~1e-6; a query seeing one row too many or too few moves
                # log-probs by O(0.1)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_mask_only_blocks_ignore_the_path_rows(target):
    """With path rows present but no block path-conditioned, the query rows are those of the plain
    layout: the token rows are invisible to MASK-only blocks, and the anchors are the same draw."""
    bs = 6
    head = make_head(target, bs, seed=3)
    target.set_taps(head.target_layer_ids)
    ids = random_ids(2, 40, seed=4)
    lm = torch.ones_like(ids, dtype=torch.bool)

    def query_rows(fraction: float):
        gen = torch.Generator().manual_seed(7)
        bb = prepare_blocks(
            ids, lm, None, block_size=bs, num_anchors=4, mask_token_id=MASK_ID, generator=gen,
            path_fraction=fraction,
        )  # fmt: skip
        with torch.no_grad():
            taps = target(ids, logits_positions=None, return_hidden=True, use_cache=False).taps
            h = head(target.embed_tokens(bb.block_ids), bb.block_positions, context=taps,
                     context_positions=bb.context_positions, attn_mask=bb.attn_mask)  # fmt: skip
        return bb, h.view(2, 4, bb.block_len, -1)[:, :, :bs]

    plain_bb, plain = query_rows(0.0)
    path_bb, with_rows = query_rows(1e-12)  # path rows built, (almost surely) no block conditioned
    assert not path_bb.is_path.any()
    assert torch.equal(plain_bb.anchors, path_bb.anchors)
    torch.testing.assert_close(with_rows, plain, rtol=1e-5, atol=1e-5)


def test_distill_step_counts_each_pass(target):
    bs = 5
    head = make_head(target, bs, seed=5).train()
    target.set_taps(head.target_layer_ids)
    ids = random_ids(4, 48, seed=6)
    lm = torch.ones_like(ids, dtype=torch.bool)
    common = dict(num_anchors=6, generator=None)
    half = distill_step(target, head, ids, lm, path_fraction=0.5, **common)
    n_rows = half["num_rows"]
    first_rows, path_rows = int(half["agree_total"].sum()), int(half["path_agree_total"].sum())
    assert first_rows + path_rows == n_rows == 4 * 6 * (bs - 1)
    assert path_rows == half["num_path_blocks"] * (bs - 1)
    assert 0 < half["num_path_blocks"] < 24  # 24 blocks at 0.5: all or none has probability 2^-23
    half["loss"].backward()
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)
    only = distill_step(target, head, ids, lm, path_fraction=1.0, **common)
    assert int(only["agree_total"].sum()) == 0 and only["num_path_blocks"] == 24
    plain = distill_step(target, head, ids, lm, **common)
    assert "path_agree_total" not in plain and int(plain["agree_total"].sum()) == 4 * 6 * (bs - 1)


def test_module_validates_path_fraction(tiny_target_dir):
    with pytest.raises(Exception, match="path_fraction must be in"):
        DistillationModule(str(tiny_target_dir), block_size=4, mask_token_id=MASK_ID, path_fraction=1.5)
    with pytest.raises(Exception, match="block_size >= 3"):
        DistillationModule(str(tiny_target_dir), block_size=2, mask_token_id=MASK_ID, path_fraction=0.5)
