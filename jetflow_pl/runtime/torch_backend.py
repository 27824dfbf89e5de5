"""The PyTorch backend: the target wrapper and the draft head, run eagerly on any torch device.

Bookkeeping (KV staging and compaction, queued taps, the order of the calls, batching) is
`SequenceBackend`'s; the KV stores are the ones these models append to themselves: the target's
transformers cache (`HFCacheStore`) and the head's context cache (`HeadCacheStore`), a batch of requests
being one cache of batch `R`. What is torch-specific is the two forwards and `refine`: the HF target runs a
batch under an additive 4D mask `[R, 1, N, P + N]` that encodes, per request, its valid KV prefix (its
own length; the padding up to the longest request is hidden), its tree (ancestors-or-self) and its
padding rows; the head under a boolean mask over its cache, its new context rows and the draft block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow_pl.head import DraftHead
from jetflow_pl.head.draft_vocab import DraftLMHead
from jetflow_pl.runtime.backend import DEFAULT_MAX_BATCH
from jetflow_pl.runtime.kv_store import HeadCacheStore, HFCacheStore, KVGroup
from jetflow_pl.runtime.sequence import HeadStep, SequenceBackend, TargetStep
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree


def tree_batch_visibility(step: TargetStep, padded: int) -> Tensor:
    """bool `[R, N, P + N]`: what each new row of each request sees (prefix rows `[0, past_lengths[r])`,
    its tree's ancestors-or-self). A padding row (past a request's tree) sees itself only, so no row is
    fully masked."""
    n = step.num_rows
    prefix = torch.arange(padded).unsqueeze(0) < step.past_lengths.to(torch.long).unsqueeze(1)  # [R, P]
    trees = step.trees if step.trees is not None else [DraftTree.chain(step.ids[0].cpu())]
    tree = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for r, t in enumerate(trees):
        tree[r, : t.num_nodes, : t.num_nodes] = t.ancestor_mask()
    return torch.cat([prefix.unsqueeze(1).expand(-1, n, -1), tree], dim=-1)


class TorchBackend(SequenceBackend):
    """Target + optional head on one device. Batch size 1; state lives between `prefill` calls.

    Head context bookkeeping: the head needs the target's tapped features of every committed position.
    After `prefill` those are the prompt's taps; after each `commit` the taps of the accepted nodes (the
    root included, which was the previous anchor). They wait in `taps` until the next `draft`, which
    projects them into the head's own K/V cache once, so each position is projected exactly once.
    """

    def __init__(
        self, target: TargetModel, head: DraftHead | None = None, max_batch: int = DEFAULT_MAX_BATCH
    ) -> None:
        self.target = target
        self.head = head
        head_kv = None
        if head is not None:
            head.check_compatible(target.config)
            head.match_dtype(target.dtype)
            layer_ids = list(head.config.dflash_config["target_layer_ids"])
            if list(target.tap_layer_ids) != layer_ids:
                target.set_taps(layer_ids)
            self._mask_token_id = int(head.config.dflash_config["mask_token_id"])
            head.eval()
            head_kv = HeadCacheStore(head, num_slots=max_batch)
            self.draft_lm = DraftLMHead(target, head)
        super().__init__(HFCacheStore(num_slots=max_batch), head_kv, device=target.device)

    # ------------------------------------------------------------------ what the runtime states
    @property
    def block_size(self) -> int:
        return int(self.head.config.block_size) if self.head is not None else 1

    @property
    def causal_head(self) -> bool:
        return self.head is not None and bool(self.head.config.causal_head)

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
    def _forward_target(self, step: TargetStep, group: KVGroup):
        cache = group.cache()  # type: ignore[attr-defined]
        ids = step.ids.to(self.device, torch.long)
        logits_at = "last" if step.last_only else "all"
        if step.chain and group.size == 1:  # a chain after the cache: the model's own causal mask
            out = self.target(ids, cache=cache, logits_positions=logits_at)
        else:
            windowed = any(w is not None for w in self.target.windows)
            if group.size == 1 and step.trees is not None and not windowed:  # one tree, its prefix whole
                mask = step.trees[0].additive_mask(group.padded, self.target.dtype).to(self.device)
            else:
                visible = tree_batch_visibility(step, group.padded).to(self.device)
                positions = step.positions.to(self.device, torch.long)
                prefix = torch.arange(group.padded, device=self.device).expand(positions.shape[0], -1)
                # cache row p of every request holds position p (compaction keeps the committed rows in
                # order), the new rows sit at their tree positions
                mask = self.target.verify_mask(visible, positions, torch.cat([prefix, positions], dim=1))
            out = self.target(
                ids,
                position_ids=step.positions.to(self.device),
                attention_mask=mask,
                cache=cache,
                logits_positions=logits_at,
            )
        return out.logits, out.taps, None

    def _forward_head(self, step: HeadStep, group: KVGroup):
        cache = group.cache()  # type: ignore[attr-defined]
        mask = None if step.dense else self._head_mask(step, group.padded)
        hidden = self.head(
            self.target.embed_tokens(step.block_ids),
            step.block_positions,
            context=step.context_taps,
            context_positions=step.context_positions,
            cache=cache,
            attn_mask=mask,
        )
        return self.draft_lm.dense_logprobs(hidden[:, 1:]), None

    def _head_mask(self, step: HeadStep, padded: int) -> Tensor:
        """bool `[R, Q, P + T + Q]`: a request's cache rows and new context rows (not the padding of
        either), then the draft block under the head's in-block mode."""
        r, q = step.block_ids.shape
        t = int(step.context_taps.shape[1])
        cache = torch.arange(padded).unsqueeze(0) < step.past_lengths.to(torch.long).unsqueeze(1)
        context = torch.arange(t).unsqueeze(0) < step.context_lengths.to(torch.long).unsqueeze(1)
        block = torch.ones(q, q, dtype=torch.bool)
        if self.head.config.causal_head:
            block = block.tril()
        rows = torch.cat([cache, context], dim=1).unsqueeze(1).expand(r, q, padded + t)
        return torch.cat([rows, block.expand(r, q, q)], dim=-1).to(self.device)

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
        return self.draft_lm.dense_logprobs(hidden[0, n:])
