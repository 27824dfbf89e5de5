"""The toy world: seeded synthetic corpora, a small BPE tokenizer and small Qwen3 targets.

Nothing here downloads anything; every generator is deterministic for a given seed.
"""

from data_gen.toy.math_problems import generate_math
from data_gen.toy.splits import DOMAINS, heldout_prompts, train_records

__all__ = ["DOMAINS", "generate_math", "heldout_prompts", "train_records"]
