"""The toy world: seeded synthetic corpora, a small BPE tokenizer and small Qwen3 targets.

Nothing here downloads anything; every generator is deterministic for a given seed.
"""

from pathlib import Path

from data_gen.toy.math_problems import generate_math
from data_gen.toy.splits import DOMAINS, heldout_prompts, train_records

ASSETS_DIR = Path(__file__).parent / "assets"
#: the shipped small toy target (see its README.md)
SMALL_TARGET_DIR = ASSETS_DIR / "small"
#: the shipped trained causal draft head for SMALL_TARGET_DIR (see its README.md)
SMALL_HEAD_DIR = ASSETS_DIR / "small_head"

__all__ = [
    "ASSETS_DIR",
    "DOMAINS",
    "SMALL_HEAD_DIR",
    "SMALL_TARGET_DIR",
    "generate_math",
    "heldout_prompts",
    "train_records",
]
