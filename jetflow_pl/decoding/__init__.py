"""Speculative decoding: one loop (`SpeculativeGenerator`) over small backends."""

from jetflow_pl.decoding.backend import DecodeBackend
from jetflow_pl.decoding.generator import ARGenerator, GenerationResult, SpeculativeGenerator
from jetflow_pl.decoding.sampling import SamplingConfig, choose_token, processed_probs

__all__ = [
    "ARGenerator",
    "DecodeBackend",
    "GenerationResult",
    "SamplingConfig",
    "SpeculativeGenerator",
    "choose_token",
    "processed_probs",
]
