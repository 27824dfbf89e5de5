"""Speculative decoding, the algorithm: one round (`round.run_round`), its scheduler (`engine.DecodeEngine`),
the algorithm's settings (`SpeculativeGenerator`), the draft budget (`budget/`) and sampling. The compute it
drives, the backends behind the `DecodeBackend` protocol, lives in `jetflow_pl.runtime`
(`load_backend(kind, ...)`)."""

from jetflow_pl.decoding.generator import ARGenerator, GenerationResult, SpeculativeGenerator
from jetflow_pl.decoding.sampling import SamplingConfig, choose_token, processed_probs
from jetflow_pl.runtime.backend import DecodeBackend

__all__ = [
    "ARGenerator",
    "DecodeBackend",
    "GenerationResult",
    "SamplingConfig",
    "SpeculativeGenerator",
    "choose_token",
    "processed_probs",
]
