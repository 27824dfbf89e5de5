"""The PyTorch backend: the target wrapper and the draft head, run eagerly on any torch device."""

from __future__ import annotations

import torch

from jetflow_pl.head import DraftHead, HeadCache
from jetflow_pl.runtime.hf_cache import cache_length, compact_cache, new_cache
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree


class TorchBackend:
    """Target + optional head on one device. Batch size 1; state lives between `prefill` calls.

    Head context bookkeeping: the head needs the target's tapped features of every committed position.
    After `prefill` those are the prompt's taps; after each `commit` the taps of the accepted nodes (the
    root included, which was the previous anchor). They wait in `_pending` until the next `draft`, which
    projects them into the head's own K/V cache once, so each position is projected exactly once.
    """

    def __init__(self, target: TargetModel, head: DraftHead | None = None) -> None:
        self.target = target
        self.head = head
        if head is not None:
            head.check_compatible(target.config)
            layer_ids = list(head.config.dflash_config["target_layer_ids"])
            if list(target.tap_layer_ids) != layer_ids:
                target.set_taps(layer_ids)
            self._mask_token_id = int(head.config.dflash_config["mask_token_id"])
            head.eval()
        self._cache = None
        self._head_cache: HeadCache | None = None
        self._pending_taps: torch.Tensor | None = None
        self._pending_pos: torch.Tensor | None = None
        self._tree_taps: torch.Tensor | None = None
        self._past_len = 0

    # ------------------------------------------------------------------ properties
    @property
    def block_size(self) -> int:
        return int(self.head.config.block_size) if self.head is not None else 1

    @property
    def past_len(self) -> int:
        return self._past_len

    @property
    def max_positions(self) -> int:
        return int(self.target.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return self.target.device

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        ids = prompt_ids.to(self.device, torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("prompt is empty: at least one token is needed to start decoding")
        self._cache = new_cache(self.target.config)
        # a previous sequence's last commit leaves taps queued for a draft that never came: drop them
        self._pending_taps = self._pending_pos = self._tree_taps = None
        out = self.target(ids, cache=self._cache, logits_positions="last")
        self._past_len = ids.shape[1]
        self._head_cache = self.head.new_cache() if self.head is not None else None
        self._queue_context(out.taps, torch.arange(self._past_len, device=self.device))
        return out.logits[0, -1]

    @torch.no_grad()
    def draft(self, anchor_token: int) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("this backend has no draft head: only autoregressive decoding is possible")
        b = self.block_size
        block = torch.full((1, b), self._mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor_token
        positions = (self._past_len + torch.arange(b, device=self.device)).unsqueeze(0)
        hidden = self.head(
            self.target.embed_tokens(block),
            positions,
            context=self._pending_taps,
            context_positions=None if self._pending_pos is None else self._pending_pos.unsqueeze(0),
            cache=self._head_cache,
        )
        self._pending_taps = self._pending_pos = None
        logits = self.target.lm_logits(hidden[0, 1:])
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def refine(self, tree: DraftTree) -> torch.Tensor:
        """Path-conditioned children log-probs for every node, in one head forward of `2N` rows.

        Rows `0..N-1` carry the tree's tokens at `past_len + depth` and see their ancestors-or-self;
        row `N + u` is a MASK query at `past_len + depth(u) + 1` that sees the token rows of root..u, so
        under the in-place convention it predicts u's children. For u = root this is exactly offset 1 of
        the draft block. Call after `draft` (the head cache then holds all committed context).
        """
        if self.head is None:
            raise RuntimeError("this backend has no draft head")
        n = tree.num_nodes
        anc = tree.ancestor_mask().to(self.device)
        mask = torch.zeros(2 * n, 2 * n, dtype=torch.bool, device=self.device)
        mask[:n, :n] = anc
        mask[n:, :n] = anc
        mask[n:, n:] = torch.eye(n, dtype=torch.bool, device=self.device)
        tokens = tree.tokens.to(self.device)
        ids = torch.cat([tokens, torch.full_like(tokens, self._mask_token_id)]).unsqueeze(0)
        depths = tree.depths.to(self.device)
        positions = (self._past_len + torch.cat([depths, depths + 1])).unsqueeze(0)
        hidden = self.head(self.target.embed_tokens(ids), positions, cache=self._head_cache, in_block=mask)
        return torch.log_softmax(self.target.lm_logits(hidden[0, n:]).float(), dim=-1)

    @torch.no_grad()
    def verify(self, tree: DraftTree) -> torch.Tensor:
        ids = tree.tokens.to(self.device).unsqueeze(0)
        positions = tree.position_ids(self._past_len).to(self.device).unsqueeze(0)
        mask = tree.additive_mask(self._past_len, self.target.dtype).to(self.device)
        out = self.target(ids, position_ids=positions, attention_mask=mask, cache=self._cache)
        self._tree_taps = out.taps
        return out.logits[0]

    @torch.no_grad()
    def commit(self, accepted: list[int]) -> None:
        keep = torch.tensor(accepted, dtype=torch.long, device=self.device)
        compact_cache(self._cache, self._past_len, keep)
        if self._tree_taps is not None:
            positions = self._past_len + torch.arange(len(accepted), device=self.device)
            self._queue_context(self._tree_taps[:, keep], positions)
        self._tree_taps = None
        self._past_len += len(accepted)
        assert cache_length(self._cache) == self._past_len

    # ------------------------------------------------------------------ helpers
    def _queue_context(self, taps: torch.Tensor | None, positions: torch.Tensor) -> None:
        if self.head is None or taps is None:
            return
        if self._pending_taps is None:
            self._pending_taps, self._pending_pos = taps, positions
        else:
            self._pending_taps = torch.cat([self._pending_taps, taps], dim=1)
            self._pending_pos = torch.cat([self._pending_pos, positions])
