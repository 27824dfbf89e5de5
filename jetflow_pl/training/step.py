"""One distillation step: target forward (no grad) -> sample anchors -> ONE packed head forward -> loss.

`prepare_blocks` builds everything that depends only on the data (anchors, block ids and positions, the
training mask, teacher rows, labels); `distill_step` runs the two models and the loss. The Lightning
`DistillationModule` calls `distill_step` from its `training_step` / `validation_step`.

Two sources of the target's features, one step: `target_features` runs the frozen target over the packed
batch (online); a teacher cache (`teacher_cache.py`) supplies the same tensors from disk (`taps=`,
`teacher_hidden=`). Anchors, masks, gathering and the loss are the same code either way; the target is
then only used for its frozen embedding and lm_head.

Training for the tree-causal pass (`path_fraction` > 0): every block gets `bs - 2` extra rows carrying
the true continuation `x[p+1..p+bs-2]` (`masks.path_block_masks`), and a `path_fraction` share of the
blocks (drawn per block) attends under the path mask, where the query at offset d sees the true path
tokens before it instead of MASKs: the draft rows of `TorchBackend.refine`, conditioned on the actual
path, with the same teacher rows and labels as the MASK-only pass. The others stay MASK-only blocks
(their token rows are invisible), so one forward mixes both passes. Agreement is counted per pass.

Positions: without packing, row `t` is at position `t` and block offset `k` at `p + k` (docs/DESIGN.md).
With packing (`doc_ids`), positions restart at 0 in every document, for the target and the head alike,
which is what each document sees at inference; since a block only attends inside its own document and
RoPE is relative, this differs from plain `arange(S)` positions only by float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetflow_pl.head import DraftHead
from jetflow_pl.head.draft_vocab import draft_columns, restricted_lm_head
from jetflow_pl.target import TargetModel

from .anchors import sample_anchors, segment_ids
from .losses import chunked_kl_loss, offset_weights, teacher_positions
from .masks import build_training_mask, document_positions, path_block_masks


@dataclass
class BlockBatch:
    """The data-side inputs of one packed head forward (B rows, A blocks per row, bs rows per block)."""

    anchors: torch.Tensor  # [B, A] long, anchor positions p (0 in invalid slots)
    valid: torch.Tensor  # [B, A] bool
    block_ids: torch.Tensor  # [B, A*bs] `[input_ids[p], MASK...]` per block
    block_positions: torch.Tensor  # [B, A*bs] position of p + k
    context_positions: torch.Tensor  # [B, S] positions of the context rows
    attn_mask: torch.Tensor  # [B, A*bs, S + A*bs] bool
    teacher_pos: torch.Tensor  # [B, A, bs-1] rows p + k - 1 (clamped into the sequence)
    labels: torch.Tensor  # [B, A, bs-1] input_ids[p + k] (clamped)
    row_valid: torch.Tensor  # [B, A, bs-1] bool: rows that enter the loss
    #: [B, A] bool: blocks under the path mask (all False without path-conditioned training)
    is_path: torch.Tensor | None = None

    @property
    def block_len(self) -> int:
        """Rows per block in the packed forward: bs, or 2bs - 2 with path-conditioned blocks."""
        return self.block_ids.shape[1] // max(self.anchors.shape[1], 1)


def target_packing_mask(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, S, S]` additive mask for the target: causal and within one document."""
    seg = segment_ids(doc_ids)
    S = seg.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=seg.device).tril()
    visible = causal & (seg.unsqueeze(2) == seg.unsqueeze(1))
    mask = torch.zeros(visible.shape, dtype=dtype, device=seg.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min).unsqueeze(1)


def target_features(
    target: TargetModel,
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor | None,
    context_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online path: `(taps [B, S, n*H], final hidden [B, S, H])` of one no-grad target forward over
    the packed batch (per-document positions and a within-document causal mask when packed)."""
    with torch.no_grad():
        if doc_ids is not None:
            t_mask = target_packing_mask(doc_ids, target.dtype)
            t_pos = context_positions
        else:
            t_mask = t_pos = None
        out = target(
            input_ids,
            position_ids=t_pos,
            attention_mask=t_mask,
            logits_positions=None,
            return_hidden=True,
            use_cache=False,
        )
    return out.taps, out.hidden


def prepare_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    block_size: int,
    num_anchors: int,
    mask_token_id: int,
    in_block: str | torch.Tensor = "causal",
    generator: torch.Generator | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    path_fraction: float = 0.0,
) -> BlockBatch:
    """Sample anchors (or use the given `(anchors, valid)`) and build the packed block inputs; with
    `path_fraction` > 0, blocks of `2bs - 2` rows, that share of them path-conditioned (module doc)."""
    if not 0.0 <= path_fraction <= 1.0:
        raise ValueError(f"path_fraction must be in [0, 1], got {path_fraction}")
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and loss_mask must both be [B, S], got {tuple(input_ids.shape)} and {tuple(loss_mask.shape)}"
        )
    B, S = input_ids.shape
    bs = int(block_size)
    if bs < 2:
        raise ValueError(f"block_size must be >= 2 (offset 0 predicts nothing), got {bs}")
    if anchors is None:
        anc, valid = sample_anchors(loss_mask, doc_ids, bs, num_anchors, generator)
    else:
        anc, valid = anchors
        anc, valid = anc.to(input_ids.device, torch.long), valid.to(input_ids.device, torch.bool)
    A = anc.shape[1]
    anchor_tok = torch.gather(input_ids, 1, anc.clamp(0, S - 1))
    block_ids = torch.full((B, A, bs), int(mask_token_id), dtype=input_ids.dtype, device=input_ids.device)
    block_ids[:, :, 0] = anchor_tok
    ctx_pos = document_positions(doc_ids, B, S, device=input_ids.device)
    anchor_pos = torch.gather(ctx_pos, 1, anc.clamp(0, S - 1))
    k = torch.arange(bs, device=input_ids.device)
    blk_pos = (anchor_pos.unsqueeze(-1) + k).reshape(B, A * bs)
    tpos = teacher_positions(anc, bs).clamp(0, S - 1)
    labels = torch.gather(input_ids, 1, (tpos + 1).clamp(0, S - 1).reshape(B, -1)).reshape(B, A, bs - 1)
    row_valid = valid.unsqueeze(-1).expand(B, A, bs - 1)
    is_path = None
    if path_fraction > 0:
        # drawn after the anchors, so the anchors are those of the same generator without paths
        draw = torch.rand(B, A, generator=generator, device=input_ids.device)
        is_path = (draw < path_fraction) & valid
        first, path = (m.to(input_ids.device) for m in path_block_masks(bs, in_block))
        block_masks = torch.where(is_path.view(B, A, 1, 1), path, first)
        # the path tokens x[p+1 .. p+bs-2] (inside the document: the whole block fits, see anchors.py)
        j = torch.arange(1, bs - 1, device=input_ids.device)
        tok_idx = (anc.unsqueeze(-1) + j).clamp(0, S - 1)
        tok_ids = torch.gather(input_ids, 1, tok_idx.reshape(B, -1)).reshape(B, A, bs - 2)
        tok_pos = anchor_pos.unsqueeze(-1) + j
        block_ids = torch.cat([block_ids, tok_ids.to(block_ids.dtype)], dim=-1)
        blk_pos = torch.cat([blk_pos.view(B, A, bs), tok_pos], dim=-1).reshape(B, -1)
        mask = build_training_mask(anc, valid, bs, S, doc_ids, block_masks=block_masks)
    else:
        mask = build_training_mask(anc, valid, bs, S, doc_ids, in_block)
    return BlockBatch(
        anchors=anc,
        valid=valid,
        block_ids=block_ids.reshape(B, -1),
        block_positions=blk_pos,
        context_positions=ctx_pos,
        attn_mask=mask,
        teacher_pos=tpos,
        labels=labels,
        row_valid=row_valid,
        is_path=is_path,
    )


def distill_step(
    target: TargetModel,
    head: DraftHead,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    *,
    num_anchors: int,
    loss_kind: str = "forward_kl",
    temperature: float = 1.0,
    decay_gamma: float | None = None,
    chunk_size: int = 1024,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    in_block: str | torch.Tensor | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_hidden: bool = False,
    skip_nonfinite_teacher: bool = False,
    taps: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    path_fraction: float = 0.0,
    draft_vocab: torch.Tensor | None = None,
) -> dict:
    """One distillation step on a batch `[B, S]`; returns the loss (with grad into the head) and metrics.

    The target must tap the head's layers (`target.tap_layer_ids == head.target_layer_ids`), unless the
    features come from a teacher cache: `taps` `[B, S, n*H]` (the head's layers, in its order) and
    `teacher_hidden` `[B, S, H]` (the final hidden state) for the same batch; then the target is not run
    and only its embedding and lm_head are used.
    `block_size` defaults to the head's, `in_block` to its config (`causal` for a JetFlow head).
    `anchors=(anchors, valid)` overrides sampling (tests, evaluation on fixed anchors).
    `skip_nonfinite_teacher` drops loss rows whose teacher logits hold a NaN/inf (see `chunked_kl_loss`).
    `path_fraction`: the share of blocks trained path-conditioned, for the tree-causal pass (module doc).
    `draft_vocab` (sorted target ids, `head.draft_vocab`): the loss is computed over those ids only, the
    teacher's distribution renormalized over them: what the head drafts from at inference
    (`head/draft_vocab.py`), at `Vd / V` of the vocabulary projection's cost. With `ce`, rows whose label
    lies outside the set get weight 0; agreement is the teacher's argmax inside the set.

    Returns a dict: `loss` (scalar), `agree_correct` / `agree_total` (`[bs-1]` long per depth),
    `num_blocks` (valid blocks), `num_rows` (loss rows), `teacher_nonfinite` (loss rows whose teacher
    logits hold a NaN/inf, a long tensor), `anchors`, `valid`; with `path_fraction` > 0 the agreement
    counts cover the MASK-only blocks and `path_agree_correct` / `path_agree_total` the path-conditioned
    ones, `num_path_blocks` counts those; with `return_hidden` also `student_hidden`,
    `teacher_hidden` (`[N, H]`), `labels` `[N]` (draft columns under `draft_vocab`), `depth_index` `[N]` (k-1) and `row_index` `[N, 3]`
    (batch row, anchor p, offset k) of the `N` loss rows.
    """
    if (taps is None) != (teacher_hidden is None):
        raise ValueError("cached features need both taps and teacher_hidden (or neither: the online path)")
    B, S = input_ids.shape
    if taps is not None:
        H = target.hidden_size
        want_taps, want_hidden = (B, S, len(head.target_layer_ids) * H), (B, S, H)
        if tuple(taps.shape) != want_taps or tuple(teacher_hidden.shape) != want_hidden:
            raise ValueError(
                f"cached taps {tuple(taps.shape)} / teacher_hidden {tuple(teacher_hidden.shape)} must be "
                f"{want_taps} / {want_hidden} (batch, sequence, the head's {len(head.target_layer_ids)} taps)"
            )
    elif tuple(target.tap_layer_ids) != tuple(head.target_layer_ids):
        raise ValueError(
            f"target taps {list(target.tap_layer_ids)} != head target_layer_ids {head.target_layer_ids}: "
            "call target.set_taps(head.target_layer_ids)"
        )
    bs = int(block_size or head.block_size)
    if in_block is None:
        in_block = "causal" if head.config.causal_head else "bidirectional"
    mask_id = head.mask_token_id
    if mask_id is None:
        raise ValueError("the head has no mask_token_id (dflash_config.mask_token_id)")
    bb = prepare_blocks(
        input_ids,
        loss_mask,
        doc_ids,
        block_size=bs,
        num_anchors=num_anchors,
        mask_token_id=mask_id,
        in_block=in_block,
        generator=generator,
        anchors=anchors,
        path_fraction=path_fraction,
    )
    A = bb.anchors.shape[1]

    if taps is None:
        taps, teacher_hidden = target_features(target, input_ids, doc_ids, bb.context_positions)
    else:
        taps = taps.to(device=target.device, dtype=target.dtype)
        teacher_hidden = teacher_hidden.to(device=target.device, dtype=target.dtype)
    with torch.no_grad():
        block_embeds = target.embed_tokens(bb.block_ids)

    hidden = head(
        block_embeds,
        bb.block_positions,
        context=taps,
        context_positions=bb.context_positions,
        attn_mask=bb.attn_mask,
    )
    H = hidden.shape[-1]
    hidden = hidden.view(B, A, bb.block_len, H)[:, :, 1:bs]  # offsets 1..bs-1 (the query rows)
    sel = bb.row_valid
    student = hidden[sel]
    t_hidden = torch.gather(
        teacher_hidden, 1, bb.teacher_pos.reshape(B, -1, 1).expand(-1, -1, teacher_hidden.shape[-1])
    ).view(B, A, bs - 1, -1)
    teacher = t_hidden[sel]
    labels = bb.labels[sel]
    depth = torch.arange(bs - 1, device=input_ids.device).expand(B, A, bs - 1)[sel]
    weights = offset_weights(bs, decay_gamma, device=input_ids.device)[depth]
    lm_head = target.lm_head
    if draft_vocab is not None:
        # teacher and student over the draft vocabulary's rows of the frozen lm_head (one 19 MB copy per
        # step for SmolLM2's 8,192 rows: noise next to the projection it saves)
        lm_head = restricted_lm_head(target.lm_head, draft_vocab)
        labels = draft_columns(labels, draft_vocab.to(labels.device))
        if loss_kind == "ce":
            weights = weights * (labels >= 0).to(weights.dtype)
    # agreement per pass: path-conditioned rows count at depth index (bs - 1) + k - 1
    passes = 1 if bb.is_path is None else 2
    pass_depth = depth
    if bb.is_path is not None:
        pass_depth = depth + (bs - 1) * bb.is_path.unsqueeze(-1).expand(B, A, bs - 1)[sel].long()

    loss, stats = chunked_kl_loss(
        student,
        teacher,
        lm_head,
        weights,
        kind=loss_kind,
        temperature=temperature,
        targets=labels,
        chunk_size=chunk_size,
        depth_index=pass_depth,
        num_depths=passes * (bs - 1),
        skip_nonfinite_teacher=skip_nonfinite_teacher,
    )
    result = {
        "loss": loss,
        "agree_correct": stats["agree_correct"][: bs - 1],
        "agree_total": stats["agree_total"][: bs - 1],
        "num_blocks": int(bb.valid.sum()),
        "num_rows": int(stats["num_rows"]),
        "teacher_nonfinite": stats["teacher_nonfinite"],
        "anchors": bb.anchors,
        "valid": bb.valid,
    }
    if bb.is_path is not None:
        result.update(
            path_agree_correct=stats["agree_correct"][bs - 1 :],
            path_agree_total=stats["agree_total"][bs - 1 :],
            num_path_blocks=int(bb.is_path.sum()),
        )
    if return_hidden:
        b_idx = torch.arange(B, device=input_ids.device).view(B, 1, 1).expand(B, A, bs - 1)
        p_idx = bb.anchors.unsqueeze(-1).expand(B, A, bs - 1)
        result.update(
            student_hidden=student,
            teacher_hidden=teacher,
            labels=labels,
            depth_index=depth,
            row_index=torch.stack([b_idx[sel], p_idx[sel], depth + 1], dim=-1),
        )
    return result
