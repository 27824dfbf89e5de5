"""Train / held-out sets per domain, disjoint by construction.

- math: a prompt is held-out iff its text falls in hash bucket 0 of 10 (``SPLIT_SALT``); training
  generation rejects those prompts, held-out generation keeps only them.
- code: held-out iff the *top-level module* name falls in hash bucket 0 of 10.
- prose: held-out iff the topic name falls in hash bucket 0 of 10.
"""

from __future__ import annotations

from data_gen.toy import code_corpus, math_problems, prose_corpus
from data_gen.toy._text import is_heldout_key

DOMAINS = ("math", "code", "prose")
CODE_SALT = "code-v1"
PROSE_SALT = "prose-v1"
# Held-out prompts use a seed offset so that calls with the same seed as training still differ.
HELDOUT_SEED_OFFSET = 1_000_003


def code_modules(heldout: bool) -> list[str]:
    tops = sorted({code_corpus.top_level(m) for m, _ in code_corpus.stdlib_modules()})
    return [t for t in tops if is_heldout_key(t, CODE_SALT) == heldout]


def prose_topics(heldout: bool) -> list[str]:
    return [t for t in prose_corpus.topic_texts() if is_heldout_key(t, PROSE_SALT) == heldout]


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")


def train_records(domain: str, n: int, seed: int) -> list[dict]:
    """``n`` training records (keys ``id, domain, prompt, response`` and domain extras)."""
    _check_domain(domain)
    if domain == "math":
        return math_problems.generate_math(n, seed, split="train")
    if domain == "code":
        return code_corpus.generate_code(n, seed, modules=code_modules(heldout=False))
    return prose_corpus.generate_prose(n, seed, topics=prose_topics(heldout=False))


def heldout_records(domain: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` held-out records (with reference responses), never present in any training set."""
    _check_domain(domain)
    s = seed + HELDOUT_SEED_OFFSET
    if domain == "math":
        return math_problems.generate_math(n, s, split="heldout")
    if domain == "code":
        return code_corpus.generate_code(n, s, modules=code_modules(heldout=True))
    topics = prose_topics(heldout=True)
    distinct = len(prose_corpus.all_items(topics))
    return prose_corpus.generate_prose(min(n, distinct), s, topics=topics)


def heldout_prompts(domain: str, n: int, seed: int = 0) -> list[dict]:
    """Alias of :func:`heldout_records` (records carry ``prompt`` and the reference ``response``)."""
    return heldout_records(domain, n, seed)
