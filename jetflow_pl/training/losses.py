"""Teacher/student alignment and the chunked distillation losses.

Alignment ("in-place" convention): block offset `k` (1..bs-1) of the block anchored at `p` predicts the
token at `p + k`; its teacher is the target's next-token distribution at position `p + k - 1` (the target
hidden state there, through the lm_head), and its hard label is `input_ids[p + k]`.

Logits are only ever computed for the `N` gathered rows, `chunk_size` rows at a time; each chunk's loss is
recomputed in the backward pass (activation checkpointing), so neither the forward nor the autograd graph
ever holds more than `[chunk_size, V]` logits (never a `[B, S, V]` tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LOSS_KINDS = ("forward_kl", "reverse_kl", "ce")


def teacher_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[B, A]` anchors -> `[B, A, bs-1]` teacher rows `p + k - 1` for offsets `k = 1..bs-1`."""
    k = torch.arange(1, block_size, device=anchors.device, dtype=anchors.dtype)
    return anchors.unsqueeze(-1) + k - 1


def offset_weights(
    block_size: int,
    decay_gamma: float | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`[bs-1]` loss weight per offset `k = 1..bs-1`: ones, or `exp(-(k-1)/decay_gamma)`."""
    k = torch.arange(1, block_size, device=device, dtype=dtype)
    if decay_gamma is None:
        return torch.ones_like(k)
    if not decay_gamma > 0:
        raise ValueError(f"decay_gamma must be > 0 (or None for uniform weights), got {decay_gamma}")
    return torch.exp(-(k - 1) / float(decay_gamma))


def _logits(
    lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor
) -> torch.Tensor:
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor):
        hidden = hidden.to(weight.dtype)
    return lm_head(hidden).float()


def _chunk_loss(
    student: torch.Tensor,
    teacher: torch.Tensor | None,
    weights: torch.Tensor,
    targets: torch.Tensor | None,
    lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    kind: str,
    temperature: float,
    skip_nonfinite_teacher: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted loss sum, weight sum, student argmax, teacher argmax or labels, non-finite teacher rows)
    for one chunk of rows.

    A teacher row with a NaN/inf logit is counted; with `skip_nonfinite_teacher` its logits are replaced
    by zeros and its weight by 0 *before* the loss, so neither the loss nor the gradient sees a NaN (a
    `where` after the loss would not help: `0 * NaN` is NaN in the backward pass).
    """
    s_logits = _logits(lm_head, student)
    t_logits = None
    bad = torch.zeros((), dtype=torch.long, device=s_logits.device)
    if teacher is not None:
        with torch.no_grad():
            t_logits = _logits(lm_head, teacher.detach())
            finite = torch.isfinite(t_logits).all(-1)
            bad = (~finite).sum()
            if skip_nonfinite_teacher and kind != "ce":  # CE reads the teacher only for agreement
                t_logits = torch.where(finite.unsqueeze(-1), t_logits, torch.zeros_like(t_logits))
                weights = weights * finite.to(weights.dtype)
    T = float(temperature)
    if kind == "ce":
        # -1: a label outside a draft vocabulary (`step.py`), weight 0 there; never a real token id
        per_row = F.cross_entropy(s_logits, targets, reduction="none", ignore_index=-1)
    else:
        log_q = F.log_softmax(s_logits / T, dim=-1)
        log_p = F.log_softmax(t_logits / T, dim=-1)
        if kind == "forward_kl":  # KL(P_teacher || Q_student)
            per_row = (log_p.exp() * (log_p - log_q)).sum(-1)
        else:  # reverse_kl: KL(Q_student || P_teacher)
            per_row = (log_q.exp() * (log_q - log_p)).sum(-1)
        per_row = per_row * (T * T)
    loss_sum = (per_row * weights.to(per_row.dtype)).sum()
    s_top = s_logits.detach().argmax(-1)
    t_top = t_logits.argmax(-1) if t_logits is not None else targets
    return loss_sum, weights.sum(), s_top, t_top, bad


def chunked_kl_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    weights: torch.Tensor | None = None,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    targets: torch.Tensor | None = None,
    chunk_size: int = 1024,
    depth_index: torch.Tensor | None = None,
    num_depths: int | None = None,
    recompute: bool = True,
    skip_nonfinite_teacher: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Distillation loss over `N` gathered rows, logits computed `chunk_size` rows at a time.

    Args:
        student_hidden: `[N, H]` final-normed draft hidden states (gradients flow into these only).
        teacher_hidden: `[N, H]` final-normed target hidden states (used under no_grad); may be `None`
            for `kind="ce"` (agreement is then measured against `targets`).
        lm_head: the target's (frozen) lm_head, or any callable hidden -> logits.
        weights: `[N]` per-row weights (default ones); the loss is `sum(w * loss_row) / sum(w)`.
        kind: `"forward_kl"` KL(P_teacher || Q_student), `"reverse_kl"` KL(Q || P) (both at temperature
            `T` with a `T^2` factor), or `"ce"`: cross-entropy on the hard labels `targets` (temperature
            not applied).
        targets: `[N]` data tokens, required for `"ce"`.
        depth_index: `[N]` offset index `k-1` of every row; with `num_depths` it yields per-depth counts.
        recompute: checkpoint each chunk (recompute its logits in backward) so the autograd graph holds
            no `[N, V]` tensor. Only used when a gradient is needed.
        skip_nonfinite_teacher: drop (weight 0, finite placeholder logits) the rows whose teacher logits
            hold a NaN/inf, instead of letting them turn the loss into NaN. Either way they are counted.

    Returns:
        `(loss, stats)`. stats: `agree` `[N]` bool (student argmax == teacher argmax), `weight_sum`,
        `num_rows`, `teacher_nonfinite` (rows whose teacher logits hold a NaN/inf; a long tensor), and
        with `depth_index`: `agree_correct`, `agree_total` `[num_depths]` long.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss kind must be one of {LOSS_KINDS}, got {kind!r}")
    if student_hidden.dim() != 2:
        raise ValueError(f"student_hidden must be [N, H], got {tuple(student_hidden.shape)}")
    N = student_hidden.shape[0]
    if teacher_hidden is None and kind != "ce":
        raise ValueError(f"{kind} needs teacher_hidden")
    if teacher_hidden is not None and teacher_hidden.shape[0] != N:
        raise ValueError(f"teacher_hidden has {teacher_hidden.shape[0]} rows, student_hidden {N}")
    if kind == "ce" and targets is None:
        raise ValueError("kind='ce' needs targets (the data tokens)")
    if kind != "ce" and not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = student_hidden.device
    if weights is None:
        weights = torch.ones(N, device=device)
    weights = weights.to(device=device, dtype=torch.float32)
    if weights.shape != (N,):
        raise ValueError(f"weights must be [N={N}], got {tuple(weights.shape)}")

    use_ckpt = recompute and torch.is_grad_enabled() and student_hidden.requires_grad
    loss_sum = student_hidden.new_zeros((), dtype=torch.float32)
    weight_sum = torch.zeros((), dtype=torch.float32, device=device)
    nonfinite = torch.zeros((), dtype=torch.long, device=device)
    s_tops, t_tops = [], []
    for start in range(0, N, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (
            student_hidden[sl],
            None if teacher_hidden is None else teacher_hidden[sl],
            weights[sl],
            None if targets is None else targets[sl],
        )
        extra = (lm_head, kind, temperature, skip_nonfinite_teacher)
        if use_ckpt:
            part, w_part, s_top, t_top, bad = checkpoint(_chunk_loss, *args, *extra, use_reentrant=False)
        else:
            part, w_part, s_top, t_top, bad = _chunk_loss(*args, *extra)
        loss_sum = loss_sum + part
        weight_sum = weight_sum + w_part.detach()
        nonfinite = nonfinite + bad
        s_tops.append(s_top)
        t_tops.append(t_top)

    if N == 0 or weight_sum <= 0:
        # keep the graph connected (e.g. DDP) while contributing nothing
        loss = student_hidden.sum().float() * 0.0
    else:
        loss = loss_sum / weight_sum
    agree = torch.cat(s_tops) == torch.cat(t_tops) if N else torch.zeros(0, dtype=torch.bool, device=device)
    stats: dict[str, Any] = {
        "agree": agree,
        "weight_sum": weight_sum.detach(),
        "num_rows": N,
        "teacher_nonfinite": nonfinite,
    }
    if depth_index is not None:
        if num_depths is None:
            raise ValueError("depth_index needs num_depths")
        depth_index = depth_index.to(device=device, dtype=torch.long)
        stats["agree_correct"] = torch.zeros(num_depths, dtype=torch.long, device=device).index_add_(
            0, depth_index, agree.long()
        )
        stats["agree_total"] = torch.bincount(depth_index, minlength=num_depths)[:num_depths]
    return loss, stats
