"""The PyTorch backend: the target wrapper and the draft head, run eagerly on any torch device.

Bookkeeping (KV staging and compaction, queued taps, the order of the calls) is `SequenceBackend`'s; the
KV stores are the ones these models append to themselves: the target's transformers cache
(`HFCacheStore`) and the head's context cache (`HeadCacheStore`). What is torch-specific is the two
forwards (an additive 4D tree mask for the HF target, the head's own in-block mask) and `refine`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow_pl.head import DraftHead
from jetflow_pl.runtime.kv_store import HeadCacheStore, HFCacheStore
from jetflow_pl.runtime.sequence import SequenceBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree


class TorchBackend(SequenceBackend):
    """Target + optional head on one device. Batch size 1; state lives between `prefill` calls.

    Head context bookkeeping: the head needs the target's tapped features of every committed position.
    After `prefill` those are the prompt's taps; after each `commit` the taps of the accepted nodes (the
    root included, which was the previous anchor). They wait in `taps` until the next `draft`, which
    projects them into the head's own K/V cache once, so each position is projected exactly once.
    """

    def __init__(self, target: TargetModel, head: DraftHead | None = None) -> None:
        self.target = target
        self.head = head
        head_kv = None
        if head is not None:
            head.check_compatible(target.config)
            layer_ids = list(head.config.dflash_config["target_layer_ids"])
            if list(target.tap_layer_ids) != layer_ids:
                target.set_taps(layer_ids)
            self._mask_token_id = int(head.config.dflash_config["mask_token_id"])
            head.eval()
            head_kv = HeadCacheStore(head)
        super().__init__(HFCacheStore(target.config), head_kv, device=target.device)

    # ------------------------------------------------------------------ what the runtime states
    @property
    def block_size(self) -> int:
        return int(self.head.config.block_size) if self.head is not None else 1

    @property
    def mask_token_id(self) -> int:
        return self._mask_token_id

    @property
    def max_positions(self) -> int:
        return int(self.target.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.target.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.target.device

    # ------------------------------------------------------------------ the two forwards
    def _forward_target(self, ids: Tensor, positions: Tensor, tree: DraftTree | None, last_only: bool):
        cache = self.kv.cache()
        ids = ids.to(self.device, torch.long).reshape(1, -1)
        if tree is None:  # a chain after the cache: the model's own causal mask and positions
            out = self.target(ids, cache=cache, logits_positions="last" if last_only else "all")
        else:
            out = self.target(
                ids,
                position_ids=positions.to(self.device).unsqueeze(0),
                attention_mask=tree.additive_mask(self.past_len, self.target.dtype).to(self.device),
                cache=cache,
            )
        return out.logits[0], out.taps, None

    def _forward_head(self, block_ids: Tensor, block_positions: Tensor, context: tuple[Tensor, Tensor]):
        taps, positions = context
        hidden = self.head(
            self.target.embed_tokens(block_ids),
            block_positions,
            context=taps,
            context_positions=positions,
            cache=self.head_kv.cache(),
        )
        logits = self.target.lm_logits(hidden[0, 1:])
        return torch.log_softmax(logits.float(), dim=-1), None

    # ------------------------------------------------------------------ torch only
    @torch.no_grad()
    def refine(self, tree: DraftTree) -> Tensor:
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
        positions = (self.past_len + torch.cat([depths, depths + 1])).unsqueeze(0)
        hidden = self.head(
            self.target.embed_tokens(ids), positions, cache=self.head_kv.cache(), in_block=mask
        )
        return torch.log_softmax(self.target.lm_logits(hidden[0, n:]).float(), dim=-1)
