"""Questions over the Python reference topics shipped with the interpreter (``pydoc_data.topics``).

Part 0 of a topic is asked for with an "explain briefly" question; later parts (400-character chunks
of the cleaned topic text) with a "quote part k" question. Records are split by topic name.
"""

from __future__ import annotations

import functools
import random
import re

from data_gen.toy._text import sanitize

CHUNK_CHARS = 400
MAX_PARTS = 6
BRIEF_QUESTIONS = (
    "Explain the Python topic '{t}' briefly.",
    "What does the Python reference say about '{t}'?",
    "Give a short description of the Python topic '{t}'.",
)
PART_QUESTION = "Quote part {k} of the Python reference on '{t}'."


def _clean(text: str) -> str:
    text = sanitize(text).replace("\t", "    ")
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text)


@functools.lru_cache(maxsize=1)
def topic_texts() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {k: _clean(v) for k, v in sorted(topics.items()) if v.strip()}


def chunks(text: str, size: int = CHUNK_CHARS, max_parts: int = MAX_PARTS) -> list[str]:
    """Split at whitespace into pieces of at most ~``size`` characters (no piece is empty)."""
    out: list[str] = []
    rest = text.strip()
    while rest and len(out) < max_parts:
        if len(rest) <= size:
            out.append(rest)
            break
        cut = max(rest.rfind(" ", 0, size), rest.rfind("\n", 0, size))
        if cut < size // 2:
            cut = size
        out.append(rest[:cut].rstrip())
        rest = rest[cut:].strip()
    return out


def all_items(topics: list[str] | None = None) -> list[dict]:
    """Every distinct (question, answer) record over ``topics`` (default: all), in sorted order."""
    texts = topic_texts()
    names = sorted(texts) if topics is None else sorted(t for t in topics if t in texts)
    items: list[dict] = []
    for t in names:
        parts = chunks(texts[t])
        for qi, q in enumerate(BRIEF_QUESTIONS):
            items.append(
                {"id": f"prose/{t}/0/{qi}", "topic": t, "prompt": q.format(t=t), "response": parts[0]}
            )
        for k, part in enumerate(parts[1:], start=2):
            items.append(
                {
                    "id": f"prose/{t}/{k}",
                    "topic": t,
                    "prompt": PART_QUESTION.format(k=k, t=t),
                    "response": part,
                }
            )
    for it in items:
        it["domain"] = "prose"
    return items


def generate_prose(n: int, seed: int, topics: list[str] | None = None) -> list[dict]:
    """``n`` records over ``topics``; distinct while the pool lasts, then repeated (seeded order)."""
    pool = all_items(topics)
    if not pool:
        return []
    rng = random.Random(f"prose|{seed}")
    out: list[dict] = []
    while len(out) < n:
        order = list(range(len(pool)))
        rng.shuffle(order)
        out.extend(dict(pool[i]) for i in order[: n - len(out)])
    return out
