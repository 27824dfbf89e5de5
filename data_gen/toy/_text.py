"""Small text helpers shared by the toy generators."""

from __future__ import annotations

import hashlib

# Literal special-token strings must never appear in corpus text (the mask token in particular is
# reserved): they are escaped by inserting a space after the opening bracket.
SPECIAL_LITERALS = ("<|pad|>", "<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>")


def sanitize(text: str) -> str:
    """Escape any special-token literal (anything starting with ``<|``) in corpus text."""
    return text.replace("<|", "< |")


def stable_hash(text: str) -> int:
    """A process-independent 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def is_heldout_key(key: str, salt: str, modulus: int = 10) -> bool:
    """True for the held-out bucket (1 in ``modulus``) of ``key``; disjoint from training by construction."""
    return stable_hash(f"{salt}|{key}") % modulus == 0
