"""Draft trees: the one tree implementation shared by every backend (torch, ONNX Runtime, TensorRT).

Conventions (see ``docs/ARCHITECTURE.md`` and ``docs/DESIGN.md`` section 4):

* A :class:`DraftTree` holds ``N = budget + 1`` nodes. Node 0 is the root: the anchor token, already
  chosen by the target but not yet in the target KV cache. Nodes are stored parent-before-child
  (``parents[i] < i``), the root has parent ``-1`` and depth 0.
* Verification places node ``i`` at position ``past_len + depth(i)``; it sees the whole KV prefix plus
  its ancestors and itself (:meth:`DraftTree.ancestor_mask`, :meth:`DraftTree.packed_mask`,
  :meth:`DraftTree.additive_mask`).
* :func:`build_tree` grows the tree best-first on cumulative draft log-probability from per-depth
  logits; :func:`accept_greedy` / :func:`accept_sampling` walk it against the target's outputs.
* The packed mask layout lives in :mod:`jetflow_pl.masks` (``pack_mask`` / ``unpack_mask`` are re-exported
  here); a batch of trees for one verify is :func:`jetflow_pl.masks.pack_tree_batch`.

Trees are small (N <= ~1024) and built on the host: the tensors of a tree live on the CPU unless moved
with :meth:`DraftTree.to`. Treat a tree as immutable once built (derived lists are cached).
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from jetflow_pl.masks import pack_mask, unpack_mask  # re-exported: the packed layout lives in masks.py

__all__ = [
    "DraftTree",
    "FanoutPolicy",
    "FixedWidth",
    "Top2GapCap",
    "accept_greedy",
    "accept_sampling",
    "build_tree",
    "pack_mask",
    "stable_topk",
    "unpack_mask",
]

#: default rounding of draft log-probs in :func:`build_tree` (1/64 nat: a 1.6% probability ratio)
SCORE_QUANTUM = 2.0**-6


# --------------------------------------------------------------------------------------------------
# DraftTree
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class DraftTree:
    """A token tree stored parent-before-child; node 0 is the root (the anchor token).

    Attributes:
        tokens: ``LongTensor[N]`` token id of each node.
        parents: ``LongTensor[N]`` parent node id; ``-1`` for the root; ``parents[i] < i``.
        depths: ``LongTensor[N]`` root 0, ``depths[i] = depths[parents[i]] + 1``.
        scores: ``FloatTensor[N]`` cumulative draft log-probability of the path; root 0.0.
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor
    _parent_list: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tokens = _as_long_1d(self.tokens, "tokens")
        self.parents = _as_long_1d(self.parents, "parents")
        self.depths = _as_long_1d(self.depths, "depths")
        scores = torch.as_tensor(self.scores)
        if not scores.is_floating_point():
            scores = scores.to(torch.float32)
        self.scores = scores
        self.validate()
        self._parent_list = self.parents.tolist()

    def validate(self) -> None:
        """Raise ``ValueError`` unless the tree is well formed (shapes, root, parent-before-child, depths)."""
        n = self.tokens.shape[0]
        if n < 1:
            raise ValueError("a DraftTree needs at least the root node")
        for name in ("parents", "depths", "scores"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"{name} must have shape [{n}], got {list(t.shape)}")
        if int(self.parents[0]) != -1:
            raise ValueError(f"the root (node 0) must have parent -1, got {int(self.parents[0])}")
        if int(self.depths[0]) != 0:
            raise ValueError(f"the root (node 0) must have depth 0, got {int(self.depths[0])}")
        if n > 1:
            idx = torch.arange(1, n, device=self.parents.device)
            par = self.parents[1:]
            bad = (par < 0) | (par >= idx)
            if bool(bad.any()):
                i = int(idx[bad][0])
                raise ValueError(
                    f"nodes must be stored parent-before-child: node {i} has parent {int(self.parents[i])}"
                )
            bad = self.depths[1:] != self.depths[par] + 1
            if bool(bad.any()):
                i = int(idx[bad][0])
                raise ValueError(
                    f"depth of node {i} is {int(self.depths[i])}, expected depth(parent) + 1 = "
                    f"{int(self.depths[self.parents[i]]) + 1}"
                )

    # ---- constructors ----------------------------------------------------------------------------

    @classmethod
    def from_parents(cls, tokens, parents, scores=None) -> DraftTree:
        """Build a tree from tokens and parent ids (parent-before-child, root parent -1); depths derived."""
        tokens = _as_long_1d(tokens, "tokens")
        parents = _as_long_1d(parents, "parents")
        if parents.shape != tokens.shape:
            raise ValueError(f"parents shape {list(parents.shape)} != tokens shape {list(tokens.shape)}")
        plist = parents.tolist()
        depth_list: list[int] = []
        for i, p in enumerate(plist):
            if i == 0:
                depth_list.append(0)  # root checks happen in validate()
            elif 0 <= p < i:
                depth_list.append(depth_list[p] + 1)
            else:
                raise ValueError(f"nodes must be stored parent-before-child: node {i} has parent {p}")
        depths = torch.tensor(depth_list, dtype=torch.long, device=tokens.device)
        if scores is None:
            scores = torch.zeros(tokens.shape[0], dtype=torch.float32, device=tokens.device)
        return cls(tokens=tokens, parents=parents, depths=depths, scores=torch.as_tensor(scores))

    @classmethod
    def chain(cls, tokens, scores=None) -> DraftTree:
        """A linear tree: node ``i`` is the child of node ``i - 1``; ``tokens[0]`` is the root."""
        tokens = _as_long_1d(tokens, "tokens")
        n = tokens.shape[0]
        ar = torch.arange(n, dtype=torch.long, device=tokens.device)
        if scores is None:
            scores = torch.zeros(n, dtype=torch.float32, device=tokens.device)
        return cls(tokens=tokens, parents=ar - 1, depths=ar.clone(), scores=torch.as_tensor(scores))

    def to(self, device: torch.device | str) -> DraftTree:
        return DraftTree(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            depths=self.depths.to(device),
            scores=self.scores.to(device),
        )

    # ---- structure -------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def __len__(self) -> int:
        return self.num_nodes

    @property
    def budget(self) -> int:
        """Number of draft tokens (the root is not counted)."""
        return self.num_nodes - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @cached_property
    def _children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self._parent_list):
            if i:
                ch[p].append(i)  # increasing node order
        return ch

    @cached_property
    def _child_by_token(self) -> list[dict[int, int]]:
        """Per node: token -> first child (in node order) carrying that token."""
        toks = self.tokens.tolist()
        out: list[dict[int, int]] = [{} for _ in range(self.num_nodes)]
        for i, p in enumerate(self._parent_list):
            if i:
                out[p].setdefault(toks[i], i)
        return out

    def children(self, i: int) -> list[int]:
        """Child node ids of node ``i``, in increasing node order."""
        return list(self._children[self._check_node(i)])

    def path(self, i: int) -> list[int]:
        """Node ids from the root to node ``i`` inclusive."""
        i = self._check_node(i)
        out = []
        while i >= 0:
            out.append(i)
            i = self._parent_list[i]
        out.reverse()
        return out

    def _check_node(self, i: int) -> int:
        i = operator.index(i)
        if not 0 <= i < self.num_nodes:
            raise IndexError(f"node {i} out of range for a tree of {self.num_nodes} nodes")
        return i

    # ---- masks and positions ---------------------------------------------------------------------

    def ancestor_mask(self) -> Tensor:
        """``BoolTensor[N, N]``: ``[i, j]`` True iff ``j`` is an ancestor-or-self of ``i``.

        Built level by level: a node's row is its parent's row plus itself (``max_depth`` tensor ops).
        """
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        for d in range(1, self.max_depth + 1):
            idx = torch.nonzero(self.depths == d, as_tuple=True)[0]
            mask[idx] |= mask[self.parents[idx]]
        return mask

    def position_ids(self, past_len: int) -> Tensor:
        """``LongTensor[N]``: ``past_len + depth(i)``."""
        return self.depths + operator.index(past_len)

    def packed_mask(self) -> Tensor:
        """``IntTensor[N, ceil(N / 32)]`` (int32): the ancestor mask in the TensorRT-LLM packed layout."""
        return pack_mask(self.ancestor_mask())

    def additive_mask(self, past_len: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """HF-style 4D additive mask ``[1, 1, N, past_len + N]``.

        0 where visible (the whole KV prefix, and the node's ancestors-or-self), ``finfo(dtype).min``
        elsewhere.
        """
        past_len = operator.index(past_len)
        if past_len < 0:
            raise ValueError(f"past_len must be >= 0, got {past_len}")
        n = self.num_nodes
        visible = torch.cat(
            [torch.ones(n, past_len, dtype=torch.bool, device=self.tokens.device), self.ancestor_mask()],
            dim=1,
        )
        out = torch.full((n, past_len + n), torch.finfo(dtype).min, dtype=dtype, device=self.tokens.device)
        out.masked_fill_(visible, 0.0)
        return out[None, None]


def _as_long_1d(x, name: str) -> Tensor:
    t = torch.as_tensor(x)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(t.shape)}")
    return t.to(torch.long)


# --------------------------------------------------------------------------------------------------
# Fan-out policies
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class FanoutPolicy(Protocol):
    """How many children every node at a depth gets.

    ``depth`` is the depth of the children being created (1-based: row ``depth - 1`` of the per-depth
    log-probs); ``topk_logprobs`` holds that depth's top-``min(width, V)`` log-probs, descending. The
    result is clamped to ``[0, min(width, V)]`` by :func:`build_tree`. Called once per depth.
    """

    def num_children(self, depth: int, topk_logprobs: Tensor, width: int) -> int: ...


@dataclass(frozen=True)
class FixedWidth:
    """Every expanded node gets ``width`` children."""

    def num_children(self, depth: int, topk_logprobs: Tensor, width: int) -> int:
        return width


@dataclass(frozen=True)
class Top2GapCap:
    """One child when the draft is confident at that depth (``top1 - top2 > max_gap``), else ``width``."""

    max_gap: float

    def num_children(self, depth: int, topk_logprobs: Tensor, width: int) -> int:
        if topk_logprobs.numel() < 2:
            return width
        gap = float(topk_logprobs[0]) - float(topk_logprobs[1])
        return 1 if gap > self.max_gap else width


# --------------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------------


def stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-``k`` along the last dim of a 2-D tensor, descending; equal values ordered by lower index.

    ``torch.topk`` does not specify an order among ties, so the values at or above the k-th largest are
    re-sorted with a stable sort (candidates come in increasing index order).
    """
    if x.dim() != 2:
        raise ValueError(f"stable_topk expects a 2-D tensor, got shape {list(x.shape)}")
    rows, v = x.shape
    k = operator.index(k)
    if not 0 <= k <= v:
        raise ValueError(f"k must be in [0, {v}], got {k}")
    if k == 0 or rows == 0:
        empty = x.new_empty(rows, k)
        return empty, torch.empty(rows, k, dtype=torch.long, device=x.device)
    kth = torch.topk(x, k, dim=-1, largest=True, sorted=True).values[:, -1:]
    vals, idxs = [], []
    for r in range(rows):
        cand = torch.nonzero(x[r] >= kth[r], as_tuple=True)[0]  # ascending token ids
        order = torch.sort(x[r, cand], descending=True, stable=True).indices[:k]
        idxs.append(cand[order])
        vals.append(x[r, cand[order]])
    return torch.stack(vals), torch.stack(idxs)


def build_tree(
    depth_logprobs: Tensor,
    root_token: int,
    budget: int,
    width: int,
    policy: FanoutPolicy | None = None,
    score_quantum: float = 0.0,
) -> DraftTree:
    """Best-first draft tree from per-depth log-probs.

    Args:
        depth_logprobs: ``[D, V]``; row ``d - 1`` holds the log-probs of the depth-``d`` token, shared by
            every parent at depth ``d - 1`` (D = block_size - 1).
        root_token: the anchor token (node 0).
        budget: number of draft tokens (root excluded). The tree has ``budget + 1`` nodes unless every
            expandable node is exhausted first (then it is smaller).
        width: children per expanded node (the top-``width`` tokens of the child depth), unless ``policy``
            says fewer.
        policy: optional :class:`FanoutPolicy`; default :class:`FixedWidth`.
        score_quantum: log-probs are rounded to multiples of this (a power of two, so cumulative
            scores stay exact) before building; 0 (the default here) disables it; the decode loop
            passes :data:`SCORE_QUANTUM`. Backends whose numerics differ by ~1e-5
            (torch vs ONNX Runtime vs TensorRT) then build the same tree from near-certain drafts, whose
            cumulative scores otherwise differ only by noise; near-ties go to the earlier node.

    Expansion: a max-heap of nodes awaiting expansion keyed on cumulative score (root 0.0); ties go to
    the earlier-inserted (lower-index) node. The popped node, if shallower than ``D``, gets its children
    in descending log-prob order (equal log-probs: lower token id first), each scored parent + log-prob
    and appended immediately; building stops the moment ``budget`` draft tokens are placed, so the last
    expansion may add only its first few children.
    """
    if not isinstance(depth_logprobs, Tensor):
        raise ValueError("depth_logprobs must be a torch.Tensor of shape [D, V]")
    if depth_logprobs.dim() != 2:
        raise ValueError(f"depth_logprobs must have shape [D, V], got {list(depth_logprobs.shape)}")
    if depth_logprobs.numel() == 0:
        raise ValueError(f"depth_logprobs is empty (shape {list(depth_logprobs.shape)})")
    root_token = operator.index(root_token)
    budget = operator.index(budget)
    width = operator.index(width)
    if root_token < 0:
        raise ValueError(f"root_token must be >= 0, got {root_token}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if policy is None:
        policy = FixedWidth()

    num_depths, vocab = depth_logprobs.shape
    depth_limit = min(num_depths, budget)  # a tree of `budget` draft tokens is never deeper than that
    kmax = min(width, vocab)

    # One top-k per depth (not per node), moved to the host once.
    lp = depth_logprobs[:depth_limit].detach().float()
    if score_quantum:
        lp = torch.round(lp / score_quantum) * score_quantum
    if depth_limit and bool(torch.isnan(lp).any()):
        raise ValueError("depth_logprobs contains NaN")
    top_vals, top_ids = stable_topk(lp, kmax)
    fanout = []
    for d in range(depth_limit):
        k = operator.index(policy.num_children(d + 1, top_vals[d], width))
        fanout.append(max(0, min(k, kmax)))
    vals_list = top_vals.cpu().tolist()
    ids_list = top_ids.cpu().tolist()

    tokens = [root_token]
    parents = [-1]
    depths = [0]
    scores = [0.0]
    heap: list[tuple[float, int]] = [(-0.0, 0)]
    while heap and len(tokens) - 1 < budget:
        _, node = heapq.heappop(heap)
        d = depths[node]
        if d >= depth_limit:
            continue
        for j in range(fanout[d]):
            if len(tokens) - 1 >= budget:
                break
            child = len(tokens)
            score = scores[node] + vals_list[d][j]
            tokens.append(ids_list[d][j])
            parents.append(node)
            depths.append(d + 1)
            scores.append(score)
            heapq.heappush(heap, (-score, child))

    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        scores=torch.tensor(scores, dtype=torch.float32),
    )


# --------------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------------


def rescore_and_select(tree: DraftTree, child_logprobs: Tensor, budget: int) -> DraftTree:
    """Branch-conditioned refinement: re-score every node on its own path, keep the best ``budget``.

    Args:
        tree: a candidate tree (usually built with a larger budget than will be verified).
        child_logprobs: ``[N, V]``; row ``u`` is the draft distribution of ``u``'s children given the
            actual path root..u (from one head forward under the tree-causal mask).
        budget: draft tokens to keep (root excluded).

    A node's new score is its parent's new score plus ``child_logprobs[parent, token]``. Log-probs are
    <= 0, so a child never outscores its parent, and taking the top ``budget`` nodes by (score desc,
    node index asc) always keeps every kept node's parent: the result is a valid tree, still stored
    parent-before-child in the candidate's order.
    """
    n = tree.num_nodes
    if child_logprobs.dim() != 2 or child_logprobs.shape[0] != n:
        raise ValueError(f"child_logprobs must have shape [{n}, V], got {list(child_logprobs.shape)}")
    budget = operator.index(budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    lp = child_logprobs.detach().float().cpu()
    parents = tree.parents.tolist()
    step = lp[tree.parents[1:].clamp(min=0), tree.tokens[1:]].tolist()
    scores = [0.0] * n
    for i in range(1, n):
        scores[i] = scores[parents[i]] + min(step[i - 1], 0.0)
    ranked = sorted(range(1, n), key=lambda i: (-scores[i], i))[:budget]
    keep = [0, *sorted(ranked)]
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree.from_parents(
        tree.tokens[keep],
        [-1, *(new_index[parents[i]] for i in keep[1:])],
        torch.tensor([scores[i] for i in keep], dtype=torch.float32),
    )


def accept_greedy(tree: DraftTree, target_argmax: Tensor) -> tuple[list[int], int]:
    """Greedy acceptance walk.

    From the root, repeatedly move to the first child (in node order) whose token equals the target's
    argmax at the current node; stop when there is none.

    Args:
        tree: the verified tree.
        target_argmax: ``LongTensor[N]``, the target's argmax next token at every node.

    Returns:
        ``(accepted, bonus)``: accepted node ids from the root (so ``len >= 1``), and the bonus token
        ``target_argmax[accepted[-1]]``.
    """
    am = torch.as_tensor(target_argmax)
    if am.dim() != 1 or am.shape[0] != tree.num_nodes:
        raise ValueError(f"target_argmax must have shape [{tree.num_nodes}], got {list(am.shape)}")
    am_list = am.tolist()  # one host sync
    child_by_token = tree._child_by_token
    accepted = [0]
    node = 0
    while True:
        nxt = child_by_token[node].get(am_list[node])
        if nxt is None:
            return accepted, int(am_list[node])
        accepted.append(nxt)
        node = nxt


def accept_sampling(
    tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Sampling acceptance walk (T > 0); exact with respect to the target distribution.

    At the current node ``c`` draw ``t ~ target_probs[c]`` (the target's processed next-token
    distribution given the path root..c). If a child of ``c`` carries ``t`` (first in node order), move
    there and repeat; otherwise ``t`` is the final committed token.

    Why this is lossless: every committed token is drawn from the target's own distribution given the
    exact prefix committed so far (the path root..c *is* that prefix, and ``target_probs[c]`` was
    computed under the tree-causal mask that shows node ``c`` exactly that prefix). The draft never
    changes which token is drawn, only whether the target's distribution for the following position is
    already available (the drawn token is in the tree) or the round ends. The output is therefore
    distributed exactly as ancestral sampling from the target; the draft only affects speed.

    Args:
        tree: the verified tree.
        target_probs: ``[N, V]`` target probabilities per node (rows need not be normalised;
            ``torch.multinomial`` semantics).
        generator: RNG for ``torch.multinomial`` (on ``target_probs``' device).

    Returns:
        ``(accepted, next_token)``: accepted node ids from the root, and the final drawn token.
    """
    if target_probs.dim() != 2 or target_probs.shape[0] != tree.num_nodes:
        raise ValueError(
            f"target_probs must have shape [{tree.num_nodes}, V], got {list(target_probs.shape)}"
        )
    child_by_token = tree._child_by_token
    accepted = [0]
    node = 0
    while True:
        tok = int(torch.multinomial(target_probs[node], 1, generator=generator))
        nxt = child_by_token[node].get(tok)
        if nxt is None:
            return accepted, tok
        accepted.append(nxt)
        node = nxt
