"""Speculative decoding: one loop (`SpeculativeGenerator`) over small backends."""

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
