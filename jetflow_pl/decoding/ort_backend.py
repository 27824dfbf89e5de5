"""The ONNX Runtime backend: the exported head and verify graphs of an engine directory, on CPU.

Same protocol and bookkeeping as `TorchBackend` (see its docstring): the target KV cache and the head's
context KV cache are explicit arrays that this backend appends (the graphs return `present_*`) and
compacts (root + accepted rows) after each round; the taps of committed rows wait until the next
`draft`. The prompt is prefilled through the verify graph as a chain (`P = 0`, causal packed mask).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export.engine_config import load_engine_config
from jetflow_pl.decoding.ort_session import make_session
from jetflow_pl.tree import DraftTree, pack_mask


def _chain_mask(n: int) -> np.ndarray:
    return pack_mask(torch.ones(n, n, dtype=torch.bool).tril()).numpy()


class OnnxRuntimeBackend:
    """Speculative (or, without a head graph call, autoregressive) decoding on an exported engine dir.

    `topk` bounds the tree width: the head graph returns only its `topk` best tokens per depth, so
    `SpeculativeGenerator(width=...)` must not exceed it (checked by `check_width`).
    """

    def __init__(self, engine_dir: str | Path, intra_op_threads: int | None = None) -> None:
        self.engine_dir = Path(engine_dir)
        self.config = load_engine_config(self.engine_dir)
        graphs = self.config["graphs"]
        self._target = make_session(self.engine_dir / graphs["target"]["file"], intra_op_threads)
        self._head = make_session(self.engine_dir / graphs["head"]["file"], intra_op_threads)
        t, h = self.config["target"], self.config["head"]
        self._empty_target_kv = np.zeros(
            (t["num_layers"], 1, t["num_kv_heads"], 0, t["head_dim"]), np.float32
        )
        self._empty_head_kv = np.zeros((h["num_layers"], 1, h["num_kv_heads"], 0, h["head_dim"]), np.float32)
        b = self.block_size
        block = torch.ones(b, b, dtype=torch.bool)
        self._block_mask = pack_mask(block.tril() if self.config["causal_head"] else block).numpy()
        self._mask_token_id = int(self.config["mask_token_id"])
        self._vocab = int(self.config["vocab_size"])
        self._reset()

    # ------------------------------------------------------------------ properties
    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def past_len(self) -> int:
        return self._past_len

    @property
    def max_positions(self) -> int:
        return int(self.config["max_positions"])

    @property
    def topk(self) -> int:
        return int(self.config["topk"])

    def check_width(self, width: int) -> None:
        if width > self.topk:
            raise ValueError(
                f"tree width {width} exceeds the engine's top-k ({self.topk}): re-export with --topk >= {width}"
            )

    # ------------------------------------------------------------------ protocol
    def _reset(self) -> None:
        self._kv = (self._empty_target_kv, self._empty_target_kv)
        self._head_kv = (self._empty_head_kv, self._empty_head_kv)
        self._pending_taps: np.ndarray | None = None
        self._pending_pos: np.ndarray | None = None
        self._tree_out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._past_len = 0

    def _run_target(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray):
        logits, _argmax, taps, keys, values = self._target.run(
            None,
            {
                "input_ids": ids.reshape(1, -1).astype(np.int64),
                "position_ids": positions.reshape(1, -1).astype(np.int64),
                "tree_mask": mask.astype(np.int32),
                "past_keys": self._kv[0],
                "past_values": self._kv[1],
            },
        )
        return logits[0], taps, keys, values

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(prompt_ids).reshape(-1).numpy()
        if ids.size == 0:
            raise ValueError("prompt is empty: at least one token is needed to start decoding")
        self._reset()
        n = ids.size
        logits, taps, keys, values = self._run_target(ids, np.arange(n), _chain_mask(n))
        self._kv = (keys, values)
        self._past_len = n
        self._pending_taps, self._pending_pos = taps, np.arange(n, dtype=np.int64)[None]
        return torch.from_numpy(logits[-1].copy())

    def draft(self, anchor_token: int) -> torch.Tensor:
        b = self.block_size
        block = np.full((1, b), self._mask_token_id, dtype=np.int64)
        block[0, 0] = anchor_token
        if self._pending_taps is None:
            raise RuntimeError("draft() needs new context rows: call prefill() or commit() first")
        values, ids, keys, vals = self._head.run(
            None,
            {
                "context_taps": self._pending_taps,
                "context_positions": self._pending_pos,
                "block_ids": block,
                "block_positions": (self._past_len + np.arange(b, dtype=np.int64))[None],
                "block_mask": self._block_mask,
                "past_keys": self._head_kv[0],
                "past_values": self._head_kv[1],
            },
        )
        self._head_kv = (keys, vals)
        self._pending_taps = self._pending_pos = None
        # the decode loop's tree builder reads per-depth log-probs over the vocabulary: scatter the
        # top-k into a -inf row (rows 1.. are depths 1..B-1)
        dense = torch.full((b - 1, self._vocab), float("-inf"))
        dense.scatter_(1, torch.from_numpy(ids[0, 1:]), torch.from_numpy(values[0, 1:]))
        return dense

    def verify(self, tree: DraftTree) -> torch.Tensor:
        ids = tree.tokens.numpy()
        positions = tree.position_ids(self._past_len).numpy()
        logits, taps, keys, values = self._run_target(ids, positions, tree.packed_mask().numpy())
        self._tree_out = (taps, keys, values)
        return torch.from_numpy(logits)

    def commit(self, accepted: list[int]) -> None:
        if self._tree_out is None:
            raise RuntimeError("commit() without a preceding verify()")
        taps, keys, values = self._tree_out
        p = self._past_len
        rows = p + np.asarray(accepted, dtype=np.int64)
        self._kv = (
            np.concatenate([keys[:, :, :, :p], keys[:, :, :, rows]], axis=3),
            np.concatenate([values[:, :, :, :p], values[:, :, :, rows]], axis=3),
        )
        new_taps = taps[:, np.asarray(accepted, dtype=np.int64)]
        new_pos = (p + np.arange(len(accepted), dtype=np.int64))[None]
        if self._pending_taps is None:
            self._pending_taps, self._pending_pos = new_taps, new_pos
        else:
            self._pending_taps = np.concatenate([self._pending_taps, new_taps], axis=1)
            self._pending_pos = np.concatenate([self._pending_pos, new_pos], axis=1)
        self._tree_out = None
        self._past_len += len(accepted)
