"""A draft vocabulary: the head drafts from the most frequent target tokens only (FR-Spec's idea).

Why: the draft's cost on a small target is mostly the target's lm_head applied to every draft depth.
SmolLM2-135M's lm_head is 49,152 x 576; over 15 depths it costs about 0.4 target steps per round at batch
1 on a CPU, and at batch 16 (240 rows) more than one whole AR step. A head that scores only the `Vd` most
frequent tokens of its training responses pays `Vd / V` of that. Tokens outside the set are never
drafted, which costs acceptance only where the target would emit a rare token; the target still verifies
every node over its full vocabulary, so decoding stays exactly the target's (lossless, greedy and
sampled: the draft distribution simply has zero mass outside the set).

The set is stored with the head: `config.draft_vocab_size` and a persistent `int64` buffer
`draft_vocab` (sorted target ids) in `model.safetensors`. A head without it drafts over the full vocab.
Every backend applies it through `DraftLMHead` (torch) or the same rows baked into the exported head
graph (`runtime.graphs.DraftHeadGraph`), so there is one definition of what the draft scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

#: name of the head's buffer holding the draft vocabulary (sorted target token ids)
BUFFER = "draft_vocab"


def _bincount(ids: Tensor, vocab_size: int) -> Tensor:
    """`int64 [vocab_size]` counts of the int64 vector `ids`; ids outside the vocabulary are refused."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token id out of range for a vocabulary of {vocab_size}")
    return torch.bincount(ids, minlength=int(vocab_size))


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> Tensor:
    """`int64 [vocab_size]`: how often each id occurs in `sequences` (ids outside the vocab are refused)."""
    counts = torch.zeros(int(vocab_size), dtype=torch.int64)
    for seq in sequences:
        counts += _bincount(torch.as_tensor(list(seq), dtype=torch.int64), vocab_size)
    return counts


def select_draft_vocab(counts: Tensor, size: int, keep: Iterable[int] = ()) -> Tensor:
    """The `size` most frequent ids (ties: lower id first), always including `keep` (e.g. EOS), sorted.

    Deterministic: the same counts give the same set on every machine.
    """
    counts = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    v = int(counts.numel())
    keep_ids = sorted({int(k) for k in keep})
    if any(k < 0 or k >= v for k in keep_ids):
        raise ValueError(f"keep ids must lie in [0, {v})")
    if not len(keep_ids) <= size <= v:
        raise ValueError(f"draft vocab size must be in [{max(1, len(keep_ids))}, {v}], got {size}")
    # stable sort by descending count: equal counts keep ascending id order
    order = torch.sort(-counts, stable=True).indices
    chosen = set(keep_ids)
    for i in order.tolist():
        if len(chosen) >= size:
            break
        chosen.add(int(i))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def keep_ids(config) -> list[int]:
    """The ids a draft vocabulary always keeps: the head config's EOS, pad and BOS ids (when in range)."""
    ids: list[int] = []
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and 0 <= int(v) < int(config.vocab_size):
                ids.append(int(v))
    return ids


def response_counts(input_ids: Tensor, loss_mask: Tensor, vocab_size: int) -> Tensor:
    """`int64 [vocab_size]`: how often each id occurs at the `loss_mask` (response) positions of packed
    rows: the tokens a head is trained to draft (`count_tokens` for rows already in memory)."""
    return _bincount(input_ids[loss_mask.bool()].to(torch.int64), vocab_size)


def coverage(counts: Tensor, vocab: Tensor) -> float:
    """Share of the counted tokens that lie in `vocab` (how often the draft *could* name the target's token)."""
    total = int(counts.sum())
    return float(counts[vocab].sum()) / total if total else 0.0


def validate_draft_vocab(vocab: Tensor, vocab_size: int) -> Tensor:
    """`vocab` as a sorted, unique int64 vector of ids in `[0, vocab_size)`; else a clear error."""
    ids = torch.as_tensor(vocab).reshape(-1)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"a draft vocabulary holds integer token ids, got {ids.dtype}")
    ids = ids.to(torch.int64)
    if ids.numel() == 0:
        raise ValueError("a draft vocabulary needs at least one token id")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be sorted and unique")
    return ids


def set_draft_vocab(head: nn.Module, vocab: Tensor | None) -> nn.Module:
    """Give `head` (a `DraftHead`) the draft vocabulary `vocab` (None: the full vocabulary). In place."""
    config = head.config  # type: ignore[attr-defined]
    if vocab is None:
        if BUFFER in head._buffers:
            del head._buffers[BUFFER]
        config.draft_vocab_size = 0
        return head
    ids = validate_draft_vocab(vocab, int(config.vocab_size))
    device = next(head.parameters()).device
    head.register_buffer(BUFFER, ids.to(device), persistent=True)
    config.draft_vocab_size = int(ids.numel())
    return head


def draft_vocab_of(head: nn.Module | None) -> Tensor | None:
    """The head's draft vocabulary (sorted ids), or None when it drafts over the full vocabulary."""
    if head is None or not int(getattr(head.config, "draft_vocab_size", 0) or 0):  # type: ignore[union-attr]
        return None
    vocab = head._buffers.get(BUFFER)
    if vocab is None or int(vocab.numel()) != int(head.config.draft_vocab_size):  # type: ignore[union-attr]
        raise ValueError(
            f"the head's config says draft_vocab_size={head.config.draft_vocab_size} "  # type: ignore[union-attr]
            f"but its weights hold {0 if vocab is None else int(vocab.numel())} draft vocabulary ids"
        )
    return vocab


def load_draft_vocab(head_dir: str | Path, vocab_size: int) -> Tensor:
    """The draft vocabulary saved with the head in `head_dir` (its `draft_vocab` buffer in
    `model.safetensors`), read without building the head; a clear error when it has none or it does not
    fit a vocabulary of `vocab_size` ids."""
    from safetensors import safe_open

    weights = Path(head_dir) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"no model.safetensors in {str(head_dir)!r} (a head folder with a draft vocabulary)"
        )
    with safe_open(str(weights), framework="pt") as f:
        if BUFFER not in set(f.keys()):
            raise ValueError(
                f"{str(weights)!r} holds no {BUFFER!r}: that head drafts over the full vocabulary "
                "(give it one with `python -m jetflow_pl draft-vocab`)"
            )
        ids = f.get_tensor(BUFFER)
    return validate_draft_vocab(ids, int(vocab_size))


def draft_columns(token_ids: Tensor, vocab: Tensor) -> Tensor:
    """Target token ids -> their column in the draft vocabulary `vocab` (sorted ids), -1 outside it."""
    col = torch.searchsorted(vocab, token_ids.clamp(min=0))
    col = col.clamp(max=int(vocab.numel()) - 1)
    return torch.where(vocab[col] == token_ids, col, torch.full_like(col, -1))


def restricted_lm_head(lm_head: nn.Linear, vocab: Tensor) -> nn.Linear:
    """A frozen copy of `lm_head`'s rows `vocab` (its outputs are in `vocab` order): what the draft scores
    with under a draft vocabulary, eagerly (`DraftLMHead`) and in the exported head graph."""
    ids = validate_draft_vocab(vocab, int(lm_head.out_features)).to(lm_head.weight.device)
    sub = nn.Linear(lm_head.in_features, int(ids.numel()), bias=lm_head.bias is not None)
    sub.to(lm_head.weight.device, lm_head.weight.dtype)
    with torch.no_grad():
        sub.weight.copy_(lm_head.weight.index_select(0, ids))
        if lm_head.bias is not None:
            sub.bias.copy_(lm_head.bias.index_select(0, ids))
    return sub.requires_grad_(False)


class DraftLMHead:
    """The lm_head the draft scores with: the target's, restricted to the head's draft vocabulary.

    `dense_logprobs(h)` is float32 `[..., V]` log-probs over the draft vocabulary, `-inf` elsewhere:
    what the tree builder and the acceptance rules read. Built once per backend: the rows are copied out
    of the frozen target's lm_head at construction (Vd x H, e.g. 19 MB for 8,192 rows of SmolLM2's).
    Without a draft vocabulary it is the target's own `few_row_logits` over the full vocabulary.
    """

    def __init__(self, target: nn.Module, head: nn.Module | None) -> None:
        lm_head: nn.Linear = target.lm_head  # type: ignore[assignment]
        self.vocab_size = int(lm_head.out_features)
        self._target = target  # looked up per call: benches swap its product form
        vocab = draft_vocab_of(head)
        self.vocab = None if vocab is None else vocab.to(lm_head.weight.device)
        self.lm_head = None if vocab is None else restricted_lm_head(lm_head, vocab)

    def dense_logprobs(self, hidden: Tensor) -> Tensor:
        """float32 `[..., V]` log-probs of the draft over the draft vocabulary (`-inf` outside it)."""
        if self.lm_head is None:
            return torch.log_softmax(self._target.few_row_logits(hidden).float(), dim=-1)  # type: ignore[attr-defined]
        sub = torch.log_softmax(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float(), dim=-1)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab, sub)


def load_token_sequences(path: str | Path) -> list[list[int]]:
    """Response token ids of a regenerated dataset (`datasets.load_from_disk` folder, or a folder of
    parquet shards) with `input_ids` / `loss_mask` columns, one list per row: the tokens the head
    learns to draft."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset at {path}")
    if (path / "dataset_info.json").exists() or (path / "state.json").exists():
        ds = datasets.load_from_disk(str(path))
    else:
        files = sorted(str(p) for p in path.rglob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{path} holds neither a saved dataset nor parquet shards")
        ds = datasets.load_dataset("parquet", data_files=files, split="train")
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{path}: the dataset lacks column(s) {sorted(missing)} (regenerated-data schema)")
    seqs = []
    for row in ds.select_columns(["input_ids", "loss_mask"]):
        seqs.append([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    return seqs
