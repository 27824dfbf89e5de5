"""Target-side token choice: greedy, or sampling from the processed distribution (temperature, top-k, top-p).

Speculative sampling here is exact because every committed token is drawn from `processed_probs` of the
target at the true prefix; the same function serves the AR baseline, so both sample the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is turned into a token.

    temperature 0 means greedy (argmax). top_k 0 and top_p 1.0 disable those filters. `seed` fixes the
    generator so the same call reproduces the same output.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities `[..., V]` after temperature, top-k and top-p (nucleus) filtering, in fp32."""
    if cfg.greedy:
        raise ValueError("processed_probs is for sampling; greedy decoding takes the argmax")
    scores = logits.float() / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - torch.softmax(sorted_scores, dim=-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from `[V]` logits: argmax when greedy, else a draw from the processed distribution."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = processed_probs(logits, cfg)
    return int(torch.multinomial(probs, 1, generator=generator))
