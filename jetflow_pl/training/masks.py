"""The training attention mask: every block of a row in ONE head forward.

Query rows are the blocks of a row concatenated (block `a` owns rows `a*bs .. a*bs+bs-1`); key columns
are the `S` context rows (raw target taps of the whole row) followed by the same block rows. A block
anchored at `p` sees

- context rows `t < p` (strictly: at inference the anchor's own target hidden state does not exist yet)
  of the same document as `p` (packing), and
- its own rows under the in-block mode (`causal`: offset i sees offsets <= i; `bidirectional`: all;
  or a bool `[bs, bs]` ancestor mask, diagonal always allowed);

never another block. An invalid (padding) block sees only its own diagonal entry, so its rows are finite
(no NaN) but meaningless; the loss ignores them.

Restricted this way, the packed forward computes for every block exactly what an inference forward on
that block alone with context `taps[:p]` computes (tested in `tests/test_training_core.py`).
"""

from __future__ import annotations

import torch

from .anchors import segment_ids


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[B, A]` anchors -> `[B, A*block_size]` positions `p + k` (block `a`, offset `k` at `a*bs + k`)."""
    k = torch.arange(block_size, device=anchors.device, dtype=anchors.dtype)
    return (anchors.unsqueeze(-1) + k).reshape(anchors.shape[0], -1)


def document_positions(doc_ids: torch.Tensor | None, batch: int, seq_len: int, device=None) -> torch.Tensor:
    """`[B, S]` position of every row inside its document (`arange(S)` per row without packing)."""
    if doc_ids is None:
        return torch.arange(seq_len, device=device).expand(batch, seq_len)
    seg = segment_ids(doc_ids)
    idx = torch.arange(seq_len, device=doc_ids.device).expand_as(seg)
    starts = torch.zeros_like(seg)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    starts[:, 0] = 1
    start_idx = torch.where(starts.bool(), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


def _in_block(in_block: str | torch.Tensor, block_size: int, device: torch.device) -> torch.Tensor:
    if isinstance(in_block, str):
        if in_block == "causal":
            return torch.ones(block_size, block_size, dtype=torch.bool, device=device).tril()
        if in_block == "bidirectional":
            return torch.ones(block_size, block_size, dtype=torch.bool, device=device)
        raise ValueError(f"in_block must be 'causal', 'bidirectional' or a bool mask, got {in_block!r}")
    m = torch.as_tensor(in_block, device=device)
    if m.dtype != torch.bool or m.shape != (block_size, block_size):
        raise ValueError(
            f"in_block mask must be bool [{block_size}, {block_size}], got {m.dtype} {tuple(m.shape)}"
        )
    return m | torch.eye(block_size, dtype=torch.bool, device=device)


def path_block_masks(
    block_size: int, in_block: str | torch.Tensor = "causal"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two in-block masks of a block of `2*bs - 2` rows (training for the tree-causal pass).

    Rows `0..bs-1` are the usual block (anchor at offset 0, MASK queries at offsets 1..bs-1); rows
    `bs..2bs-3` carry the path tokens `x[p+1] .. x[p+bs-2]` at positions `p+1 .. p+bs-2`. Returns
    `(first_pass, path)`, bool `[2bs-2, 2bs-2]`:

    - `first_pass`: the usual in-block mode on rows `0..bs-1`; the token rows see only themselves and
      nobody sees them (the block computes exactly what a `bs`-row block does).
    - `path`: what `TorchBackend.refine` runs at inference on one root-to-leaf path: the query at offset
      d sees the anchor, the path tokens at offsets 1..d-1 and itself (not the other queries); a token
      row sees the anchor and the path tokens up to itself (ancestors-or-self on a chain). So the query
      at offset d learns q(x[p+d] | context, path x[p+1..p+d-1]), the method's factorisation.
    """
    bs = int(block_size)
    if bs < 3:
        raise ValueError(f"path-conditioned blocks need block_size >= 3 (a path token), got {bs}")
    n = 2 * bs - 2
    first = torch.eye(n, dtype=torch.bool)
    first[:bs, :bs] = _in_block(in_block, bs, torch.device("cpu"))
    path = torch.eye(n, dtype=torch.bool)
    tok = bs - 1  # row of path token x[p+j] is tok + j, j = 1..bs-2
    path[:, 0] = True  # every row sees the anchor (the root)
    for d in range(2, bs):  # query at offset d: path tokens x[p+1 .. p+d-1]
        path[d, tok + 1 : tok + d] = True
    for j in range(1, bs - 1):  # token x[p+j]: path tokens x[p+1 .. p+j]
        path[tok + j, tok + 1 : tok + j + 1] = True
    return first, path


def build_training_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    seq_len: int,
    doc_ids: torch.Tensor | None = None,
    in_block: str | torch.Tensor = "causal",
    block_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool `[B, A*L, S + A*L]` mask (True = may attend) for the packed multi-block head forward.

    `L = block_size`, each block under `in_block`; or `block_masks` `[B, A, L, L]` gives every block its
    own in-block mask of `L` rows (`path_block_masks`), diagonal always allowed.
    """
    if anchors.shape != valid.shape or anchors.dim() != 2:
        raise ValueError(f"anchors {tuple(anchors.shape)} and valid {tuple(valid.shape)} must be [B, A]")
    B, A = anchors.shape
    bs, S = int(block_size), int(seq_len)
    device = anchors.device
    if block_masks is not None:
        if (
            block_masks.dim() != 4
            or block_masks.shape[:2] != (B, A)
            or block_masks.shape[2] != block_masks.shape[3]
        ):
            raise ValueError(
                f"block_masks must be [B, A, L, L] = [{B}, {A}, L, L], got {tuple(block_masks.shape)}"
            )
        bs = int(block_masks.shape[2])
    valid = valid.bool()
    t = torch.arange(S, device=device)
    # context part [B, A, S]: strictly before the anchor, same document, valid blocks only
    ctx = (t.view(1, 1, S) < anchors.unsqueeze(-1)) & valid.unsqueeze(-1)
    if doc_ids is not None:
        if doc_ids.shape != (B, S):
            raise ValueError(f"doc_ids must be [B, S] = [{B}, {S}], got {tuple(doc_ids.shape)}")
        seg = segment_ids(doc_ids)
        anchor_seg = torch.gather(seg, 1, anchors.clamp(0, S - 1))
        ctx &= seg.unsqueeze(1) == anchor_seg.unsqueeze(-1)
    ctx = ctx.unsqueeze(2).expand(B, A, bs, S).reshape(B, A * bs, S)
    # block part [B, A*bs, A*bs]: block diagonal; in-block mode for valid blocks, eye for invalid ones
    eye = torch.eye(bs, dtype=torch.bool, device=device)
    modes = _in_block(in_block, bs, device) if block_masks is None else block_masks.to(device).bool() | eye
    inner = torch.where(valid.view(B, A, 1, 1), modes, eye)  # [B, A, bs, bs]
    same_block = torch.eye(A, dtype=torch.bool, device=device)  # [A, A]
    blk = same_block.view(1, A, 1, A, 1) & inner.unsqueeze(3)  # [B, A, bs, A, bs]
    blk = blk.reshape(B, A * bs, A * bs)
    return torch.cat([ctx, blk], dim=-1)
