"""Distillation core (jetflow_pl.training): anchors, training mask, teacher alignment, losses, metrics, step.

Real tiny modules (the toy `tiny` target, vocab 96, and a one-layer head), CPU, seeded, fast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB
from tiny_heads import perturbed_head
from transformers import AutoModelForCausalLM

from jetflow_pl.head import DraftHead
from jetflow_pl.target import TargetModel
from jetflow_pl.training import (
    DepthAgreement,
    SimulatedAcceptanceLength,
    block_positions,
    build_training_mask,
    chunked_kl_loss,
    distill_step,
    offset_weights,
    prepare_blocks,
    sample_anchors,
    simulated_acceptance_length,
    target_packing_mask,
    teacher_positions,
)
from jetflow_pl.training.anchors import segment_ids

MASK_ID = TINY_VOCAB - 1


# ---- fixtures -----------------------------------------------------------------------------------------


def make_head(target: TargetModel, block_size: int = 4, causal: bool = True, seed: int = 0) -> DraftHead:
    return perturbed_head(target, MASK_ID, block_size, causal, seed)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    head = make_head(target)
    target.set_taps(head.target_layer_ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    return target, head, hf


def rand_batch(B: int, S: int, seed: int, prompt_len: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MASK_ID, (B, S), generator=g)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    return ids, loss_mask


def brute_eligible(loss_mask, doc_ids, bs):
    B, S = loss_mask.shape
    out = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        for p in range(S):
            if not loss_mask[b, p] or p + bs > S:
                continue
            if doc_ids is not None and not bool((doc_ids[b, p : p + bs] == doc_ids[b, p]).all()):
                continue
            out[b, p] = True
    return out


# ---- anchors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_anchors", [1, 3, 8, 40])
@pytest.mark.parametrize("packed", [False, True])
def test_anchors_are_eligible_distinct_sorted_and_counted(num_anchors, packed):
    g = torch.Generator().manual_seed(5)
    B, S, bs = 4, 24, 4
    for trial in range(10):
        loss_mask = torch.rand(B, S, generator=g) < 0.6
        doc_ids = torch.randint(0, 3, (B, S), generator=g).sort(dim=1).values if packed else None
        if packed and trial % 2:
            doc_ids = torch.tensor([0] * 6 + [1] * 10 + [0] * 8).expand(B, S)  # a reused id is a new document
        anchors, valid = sample_anchors(loss_mask, doc_ids, bs, num_anchors, g)
        assert anchors.shape == valid.shape == (B, num_anchors)
        seg = segment_ids(doc_ids) if packed else None
        ok = brute_eligible(loss_mask, seg, bs)
        for b in range(B):
            chosen = anchors[b][valid[b]].tolist()
            assert len(chosen) == min(num_anchors, int(ok[b].sum()))
            assert chosen == sorted(set(chosen))  # distinct, ascending
            assert all(ok[b, p] for p in chosen)
            n = len(chosen)
            assert valid[b, :n].all() and not valid[b, n:].any()  # valid slots first
            assert (anchors[b, n:] == 0).all()


def test_anchors_resampled_per_call_and_reproducible():
    loss_mask = torch.ones(2, 64, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    a1, _ = sample_anchors(loss_mask, None, 4, 6, g)
    a2, _ = sample_anchors(loss_mask, None, 4, 6, g)
    assert not torch.equal(a1, a2)  # the generator advanced: a new draw
    b1, _ = sample_anchors(loss_mask, None, 4, 6, torch.Generator().manual_seed(0))
    assert torch.equal(a1, b1)
    # over many draws every eligible position is used (uniform without replacement)
    seen = torch.zeros(64, dtype=torch.bool)
    for _ in range(60):
        a, v = sample_anchors(loss_mask[:1], None, 4, 6, g)
        seen[a[v]] = True
    assert seen[: 64 - 3].all() and not seen[64 - 3 :].any()


def test_anchors_none_eligible():
    anchors, valid = sample_anchors(torch.ones(1, 3, dtype=torch.bool), None, 4, 2, None)
    assert not valid.any() and anchors.shape == (1, 2)


# ---- training mask -------------------------------------------------------------------------------------


def test_training_mask_hand_worked():
    """S=6, block_size=3, anchors at 1 and 3, causal in-block, one document."""
    m = build_training_mask(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), 3, 6, None, "causal")
    expected = torch.tensor(
        [
            # context 0..5    | block 0 (p=1) | block 1 (p=3)
            [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m[0], expected)
    # bidirectional in-block: full 3x3 blocks
    mb = build_training_mask(
        torch.tensor([[1, 3]]), torch.tensor([[True, True]]), 3, 6, None, "bidirectional"
    )
    assert torch.equal(mb[0, :, :6], expected[:, :6])
    assert (
        mb[0, :3, 6:9].all() and mb[0, 3:, 9:].all() and not mb[0, :3, 9:].any() and not mb[0, 3:, 6:9].any()
    )
    # documents [0 0 1 1 1 1]: the block at 3 sees only row 2 of its own document
    md = build_training_mask(
        torch.tensor([[1, 3]]),
        torch.tensor([[True, True]]),
        3,
        6,
        torch.tensor([[0, 0, 1, 1, 1, 1]]),
        "causal",
    )
    exp_d = expected.clone()
    exp_d[3:, :2] = False
    assert torch.equal(md[0], exp_d)
    # an invalid block sees only its own diagonal (finite rows), no context
    mi = build_training_mask(torch.tensor([[1, 0]]), torch.tensor([[True, False]]), 3, 6, None, "causal")
    exp_i = expected.clone()
    exp_i[3:] = False
    exp_i[3, 9] = exp_i[4, 10] = exp_i[5, 11] = True
    assert torch.equal(mi[0], exp_i)
    assert torch.equal(block_positions(torch.tensor([[1, 3]]), 3), torch.tensor([[1, 2, 3, 3, 4, 5]]))


def test_training_mask_properties_random():
    g = torch.Generator().manual_seed(1)
    B, S, bs, A = 3, 30, 5, 6
    doc_ids = torch.randint(0, 4, (B, S), generator=g).sort(dim=1).values
    loss_mask = torch.rand(B, S, generator=g) < 0.7
    anchors, valid = sample_anchors(loss_mask, doc_ids, bs, A, g)
    m = build_training_mask(anchors, valid, bs, S, doc_ids, "causal")
    assert m.shape == (B, A * bs, S + A * bs)
    for b in range(B):
        for a in range(A):
            rows = m[b, a * bs : (a + 1) * bs]
            blocks = rows[:, S:].view(bs, A, bs)
            others = [x for x in range(A) if x != a]
            assert not blocks[:, others].any()  # never another block
            assert rows.any(-1).all()  # every row sees at least one key (no NaN)
            if not valid[b, a]:
                assert not rows[:, :S].any() and torch.equal(blocks[:, a], torch.eye(bs, dtype=torch.bool))
                continue
            p = int(anchors[b, a])
            want = (torch.arange(S) < p) & (doc_ids[b] == doc_ids[b, p])
            assert torch.equal(rows[:, :S], want.expand(bs, S))  # strictly before p, same document
            assert torch.equal(blocks[:, a], torch.ones(bs, bs, dtype=torch.bool).tril())


# ---- KEY: packed training forward == per-block inference forward ----------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_training_forward_equals_inference_per_block(tiny, packed, causal):
    target, _, _ = tiny
    head = make_head(target, block_size=4, causal=causal, seed=1).eval()
    B, S, bs = 2, 20, 4
    ids, _ = rand_batch(B, S, seed=2)
    doc_ids = torch.tensor([[0] * 9 + [1] * 11, [0] * 20]) if packed else None
    # explicit anchors: one at 0 (empty context), a document start (9), arbitrary ones, an invalid slot
    anchors = torch.tensor([[0, 5, 9, 13, 0], [2, 7, 11, 16, 0]])
    valid = torch.tensor([[True, True, True, True, False], [True, True, True, True, False]])
    bb = prepare_blocks(
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        doc_ids,
        block_size=bs,
        num_anchors=5,
        mask_token_id=MASK_ID,
        in_block="causal" if causal else "bidirectional",
        anchors=(anchors, valid),
    )
    with torch.no_grad():
        t_mask = target_packing_mask(doc_ids, target.dtype) if packed else None
        out = target(
            ids,
            position_ids=bb.context_positions if packed else None,
            attention_mask=t_mask,
            logits_positions=None,
            return_hidden=True,
            use_cache=False,
        )
        taps = out.taps
        packed_h = head(
            target.embed_tokens(bb.block_ids),
            bb.block_positions,
            context=taps,
            context_positions=bb.context_positions,
            attn_mask=bb.attn_mask,
        )
        assert torch.isfinite(packed_h).all()  # invalid blocks included
        for b in range(B):
            for a in range(4):
                p = int(anchors[b, a])
                d0 = 0
                if packed:
                    d0 = int((doc_ids[b] == doc_ids[b, p]).nonzero()[0])
                blk = head.make_block(ids[b, p : p + 1])
                pos = torch.arange(p - d0, p - d0 + bs).unsqueeze(0)
                ctx = taps[b : b + 1, d0:p] if p > d0 else None
                ctx_pos = torch.arange(p - d0).unsqueeze(0) if p > d0 else None
                ref = head(
                    target.embed_tokens(blk),
                    pos,
                    context=ctx,
                    context_positions=ctx_pos,
                    in_block="causal" if causal else "bidirectional",
                )
                got = packed_h[b : b + 1, a * bs : (a + 1) * bs]
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ---- teacher alignment ----------------------------------------------------------------------------------


def test_teacher_positions_and_weights():
    tp = teacher_positions(torch.tensor([[2, 7]]), 4)
    assert tp.tolist() == [[[2, 3, 4], [7, 8, 9]]]
    assert offset_weights(4).tolist() == [1.0, 1.0, 1.0]
    w = offset_weights(5, decay_gamma=2.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 2.0))
    with pytest.raises(ValueError):
        offset_weights(4, decay_gamma=0.0)


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_teacher_is_target_next_token_distribution_at_p_plus_k_minus_1(tiny, packed):
    """Offset k of the block at p: teacher logits == HF(ids[:p+k]).logits[-1], label == ids[p+k]."""
    target, head, hf = tiny
    B, S = 2, 16
    ids, loss_mask = rand_batch(B, S, seed=4)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 16]) if packed else None
    with torch.no_grad():
        res = distill_step(
            target,
            head,
            ids,
            loss_mask,
            doc_ids,
            num_anchors=3,
            chunk_size=5,
            generator=torch.Generator().manual_seed(0),
            return_hidden=True,
        )
        assert res["num_blocks"] > 0
        t_logits = target.lm_logits(res["teacher_hidden"])
        for i, (b, p, k) in enumerate(res["row_index"].tolist()):
            d0 = int((doc_ids[b] == doc_ids[b, p]).nonzero()[0]) if packed else 0
            ref = hf(ids[b : b + 1, d0 : p + k]).logits[0, -1]
            torch.testing.assert_close(t_logits[i], ref, rtol=1e-4, atol=1e-4)
            assert int(res["labels"][i]) == int(ids[b, p + k])


# ---- losses ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loss_setup():
    g = torch.Generator().manual_seed(7)
    N, H, V = 23, 16, 40
    lm_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(V, H, generator=g))
    lm_head.requires_grad_(False)
    student = torch.randn(N, H, generator=g)
    teacher = torch.randn(N, H, generator=g)
    weights = torch.rand(N, generator=g) + 0.1
    targets = torch.randint(0, V, (N,), generator=g)
    depth = torch.randint(0, 5, (N,), generator=g)
    return lm_head, student, teacher, weights, targets, depth


def naive_loss(kind, s, t, lm_head, w, T, targets):
    sl, tl = lm_head(s), lm_head(t)
    if kind == "ce":
        per = F.cross_entropy(sl, targets, reduction="none")
    else:
        logq, logp = F.log_softmax(sl / T, -1), F.log_softmax(tl / T, -1)
        if kind == "forward_kl":
            per = T * T * (logp.exp() * (logp - logq)).sum(-1)
        else:
            per = T * T * (logq.exp() * (logq - logp)).sum(-1)
    return (per * w).sum() / w.sum()


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "ce"])
@pytest.mark.parametrize("T", [1.0, 2.5])
def test_chunked_loss_matches_naive_for_every_chunk_size(loss_setup, kind, T):
    lm_head, student, teacher, weights, targets, depth = loss_setup
    N = student.shape[0]
    s_ref = student.clone().requires_grad_(True)
    ref = naive_loss(kind, s_ref, teacher, lm_head, weights, T, targets)
    ref.backward()
    for chunk in (1, 7, N):
        s = student.clone().requires_grad_(True)
        t = teacher.clone().requires_grad_(True)
        loss, stats = chunked_kl_loss(
            s,
            t,
            lm_head,
            weights,
            kind=kind,
            temperature=T,
            targets=targets,
            chunk_size=chunk,
            depth_index=depth,
            num_depths=5,
        )
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        loss.backward()
        torch.testing.assert_close(s.grad, s_ref.grad, rtol=1e-5, atol=1e-6)
        assert t.grad is None  # the teacher gets no gradient
        assert lm_head.weight.grad is None
        agree = lm_head(student).argmax(-1) == lm_head(teacher).argmax(-1)
        assert torch.equal(stats["agree"], agree)
        for d in range(5):
            assert int(stats["agree_total"][d]) == int((depth == d).sum())
            assert int(stats["agree_correct"][d]) == int(agree[depth == d].sum())


def test_forward_kl_zero_when_equal_nonnegative_and_T2_scaling(loss_setup):
    lm_head, student, teacher, weights, _, _ = loss_setup
    zero, stats = chunked_kl_loss(teacher.clone(), teacher, lm_head, weights, temperature=2.0, chunk_size=4)
    assert abs(float(zero)) < 1e-6 and bool(stats["agree"].all())
    for T in (0.5, 1.0, 3.0):
        loss, _ = chunked_kl_loss(student, teacher, lm_head, weights, temperature=T, chunk_size=4)
        assert float(loss) >= 0
        logq = F.log_softmax(lm_head(student) / T, -1)
        logp = F.log_softmax(lm_head(teacher) / T, -1)
        kl_T = ((logp.exp() * (logp - logq)).sum(-1) * weights).sum() / weights.sum()
        torch.testing.assert_close(loss, T * T * kl_T, rtol=1e-5, atol=1e-6)
    # uniform weights (default) == plain mean
    loss_u, _ = chunked_kl_loss(student, teacher, lm_head, None, chunk_size=3)
    torch.testing.assert_close(
        loss_u, naive_loss("forward_kl", student, teacher, lm_head, torch.ones(23), 1.0, None)
    )


def test_loss_argument_errors(loss_setup):
    lm_head, student, teacher, _, _, _ = loss_setup
    with pytest.raises(ValueError, match="loss kind"):
        chunked_kl_loss(student, teacher, lm_head, kind="js")
    with pytest.raises(ValueError, match="targets"):
        chunked_kl_loss(student, teacher, lm_head, kind="ce")
    with pytest.raises(ValueError, match="temperature"):
        chunked_kl_loss(student, teacher, lm_head, temperature=0.0)
    empty, _ = chunked_kl_loss(student[:0].requires_grad_(True), teacher[:0], lm_head)
    assert float(empty.detach()) == 0.0 and empty.requires_grad


# ---- metrics --------------------------------------------------------------------------------------------


def test_simulated_acceptance_length_hand_cases():
    assert float(simulated_acceptance_length(torch.tensor([1.0, 1.0, 0.5]))) == 3.5
    assert float(simulated_acceptance_length(torch.tensor([0.0, 1.0, 1.0]))) == 1.0
    assert float(simulated_acceptance_length(torch.tensor([1.0, 0.0, 1.0]))) == 2.0
    torch.testing.assert_close(
        simulated_acceptance_length(torch.tensor([0.5, 0.5])), torch.tensor(1 + 0.5 + 0.25)
    )
    m = SimulatedAcceptanceLength(3)
    m.update(torch.tensor([4, 4, 2]), torch.tensor([4, 4, 4]))
    assert float(m.compute()) == 3.5
    m.update(torch.tensor([0, 0, 0]), torch.tensor([4, 4, 0]))  # pooled rates [0.5, 0.5, 0.5]
    torch.testing.assert_close(m.compute(), torch.tensor(1.875))
    m.reset()
    assert float(simulated_acceptance_length(m.rates())) == 1.0  # nothing seen: rates 0


def test_depth_agreement_accumulates():
    m = DepthAgreement(3)
    m.update(torch.tensor([1, 2, 0]), torch.tensor([2, 2, 0]))
    m.update(torch.tensor([1, 0, 1]), torch.tensor([2, 2, 4]))
    torch.testing.assert_close(m.compute(), torch.tensor([0.5, 0.5, 0.25]))
    with pytest.raises(ValueError):
        m.update(torch.tensor([3, 0, 0]), torch.tensor([2, 2, 2]))


# ---- the step -------------------------------------------------------------------------------------------


def test_distill_step_gradients_reach_only_the_head(tiny):
    target, _, _ = tiny
    head = make_head(target, seed=3).train()
    ids, loss_mask = rand_batch(2, 16, seed=5)
    res = distill_step(
        target, head, ids, loss_mask, num_anchors=4, chunk_size=7, generator=torch.Generator().manual_seed(1)
    )
    res["loss"].backward()
    assert res["agree_total"].sum() == res["num_blocks"] * (head.block_size - 1)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    assert any(float(p.grad.abs().sum()) > 0 for p in head.layers.parameters())
    assert all(not p.requires_grad and p.grad is None for p in target.parameters())
    bad = make_head(target, seed=3)
    bad.config.target_layer_ids = [0]
    with pytest.raises(ValueError, match="taps"):
        distill_step(target, bad, ids, loss_mask, num_anchors=4)


@pytest.mark.parametrize("loss_kind", ["forward_kl", "ce"])
def test_smoke_training_reduces_loss(tiny, loss_kind):
    target, _, _ = tiny
    head = make_head(target, seed=4).train()
    ids, loss_mask = rand_batch(2, 24, seed=6)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        res = distill_step(
            target,
            head,
            ids,
            loss_mask,
            num_anchors=32,
            loss_kind=loss_kind,
            temperature=1.0,
            chunk_size=16,
            generator=g,
        )
        opt.zero_grad()
        res["loss"].backward()
        opt.step()
        losses.append(float(res["loss"].detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    if loss_kind == "ce":
        # random data tokens through the tiny target's frozen, near-zero lm_head: the CE floor is close
        # to log(V), so only a clear decrease is asked for (measured 4.58 -> 3.28)
        assert losses[-1] < 0.85 * losses[0]
    else:
        assert losses[-1] < 0.5 * losses[0]  # measured forward KL 0.044 -> 0.0069
