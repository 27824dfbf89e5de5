"""The ONNX Runtime backend: the exported head and verify graphs of an engine directory, on CPU.

All decode bookkeeping (KV staging/compaction, queued taps, chain prefill) is `SequenceBackend`'s and the
graph contract (feeds, masks, top-k -> per-depth log-probs) `GraphBackend`'s; this class only runs the two
ONNX Runtime sessions (plugin graphs run their TreeAttention nodes through an onnxruntime-extensions
Python op, see `ort_session.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from jetflow_pl.runtime.engine_config import load_engine_config
from jetflow_pl.runtime.graph_backend import GraphBackend
from jetflow_pl.runtime.ort_session import make_session


def _run(session, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    outputs = session.run(None, {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()})
    return [torch.from_numpy(o) for o in outputs]


class OnnxRuntimeBackend(GraphBackend):
    """Speculative (or autoregressive) decoding on an exported engine directory with ONNX Runtime.

    `topk` (from `config.json`) bounds the tree width: `SpeculativeGenerator(width=...)` must not exceed
    it (`check_width`). `max_batch`: request slots for continuous batching (default: the engine's
    `max_batch`; an engine of batch-1 graphs takes 1, `jetflow-export --max-batch N` writes batched ones,
    which run the whole decoding batch in one session call per forward).
    """

    def __init__(
        self, engine_dir: str | Path, intra_op_threads: int | None = None, max_batch: int | None = None
    ) -> None:
        self.engine_dir = Path(engine_dir)
        #: ONNX Runtime's intra-op threads (None: its default, one per core). Part of the cost profile's
        #: fingerprint: on 2 cores, 2 threads made SmolLM2 tree rounds 1.3x dearer than 1 thread did
        self.intra_op_threads = None if intra_op_threads is None else int(intra_op_threads)
        config = load_engine_config(self.engine_dir)
        graphs = config["graphs"]
        self._target = make_session(self.engine_dir / graphs["target"]["file"], intra_op_threads)
        self._head = make_session(self.engine_dir / graphs["head"]["file"], intra_op_threads)
        super().__init__(config, device="cpu", max_batch=max_batch)

    def run_target(self, feeds):
        logits, _argmax, taps, keys, values = _run(self._target, feeds)
        return logits, taps, keys, values

    def run_head(self, feeds):
        values, ids, keys, vals = _run(self._head, feeds)
        return values, ids, keys, vals
