"""GSM8K-style arithmetic word problems with short, very regular step-by-step solutions.

Every response is 2-4 lines ``<label>: a op b = c`` followed by ``#### <answer>``. The generator checks
its own arithmetic: each step is recomputed and the answer must equal the last step's result.

Held-out problems are those whose prompt text falls in a fixed hash bucket (see ``splits.py``), so a
held-out prompt can never occur in the training set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from data_gen.toy._text import is_heldout_key

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo", "Mia", "Nora"]
ITEMS = ["apple", "pen", "book", "cup", "ball", "card", "toy", "shirt", "plant", "lamp", "kite", "box"]
SPLIT_SALT = "math-v1"


@dataclass(frozen=True)
class Step:
    label: str
    a: int
    op: str
    b: int

    @property
    def result(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        if self.op == "*":
            return self.a * self.b
        if self.op == "/":
            assert self.b != 0 and self.a % self.b == 0, f"inexact division {self.a} / {self.b}"
            return self.a // self.b
        raise ValueError(f"unknown op {self.op!r}")

    def line(self) -> str:
        return f"{self.label}: {self.a} {self.op} {self.b} = {self.result}"


Problem = tuple[str, list[Step]]


def _two(rng: random.Random, k: int = 2) -> list[str]:
    return rng.sample(NAMES, k)


def _shopping(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    i1, i2 = rng.sample(ITEMS, 2)
    a, p, b, q = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 9), rng.randint(2, 12)
    s1, s2 = Step(f"Cost of {i1}s", a, "*", p), Step(f"Cost of {i2}s", b, "*", q)
    question = (
        f"{name} buys {a} {i1}s at ${p} each and {b} {i2}s at ${q} each. "
        f"How many dollars does {name} spend in total?"
    )
    return question, [s1, s2, Step("Total", s1.result, "+", s2.result)]


def _change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, p = rng.randint(2, 9), rng.randint(2, 15)
    cost = a * p
    money = cost + rng.randint(1, 60)
    question = f"{name} has ${money}. {name} buys {a} {item}s that cost ${p} each. How many dollars are left?"
    s1 = Step("Cost", a, "*", p)
    return question, [s1, Step("Left", money, "-", s1.result)]


def _speed(rng: random.Random) -> Problem:
    s1, h1, s2, h2 = rng.randint(20, 90), rng.randint(2, 6), rng.randint(20, 90), rng.randint(2, 6)
    vehicle = rng.choice(["car", "train", "bus", "truck"])
    question = (
        f"A {vehicle} travels at {s1} km per hour for {h1} hours, then at {s2} km per hour for "
        f"{h2} hours. How many km does it travel in total?"
    )
    a, b = Step("First part", s1, "*", h1), Step("Second part", s2, "*", h2)
    return question, [a, b, Step("Total", a.result, "+", b.result)]


def _reading(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    r, d = rng.randint(5, 30), rng.randint(2, 9)
    pages = r * d + rng.randint(5, 120)
    question = (
        f"{name} reads {r} pages each day. After {d} days, how many pages are left in a {pages}-page book?"
    )
    s1 = Step("Pages read", r, "*", d)
    return question, [s1, Step("Pages left", pages, "-", s1.result)]


def _ages(rng: random.Random) -> Problem:
    n1, n2 = _two(rng)
    a, k, y = rng.randint(3, 15), rng.randint(2, 5), rng.randint(2, 20)
    question = f"{n1} is {a} years old. {n2} is {k} times as old as {n1}. How old will {n2} be in {y} years?"
    s1 = Step(f"{n2} now", a, "*", k)
    return question, [s1, Step(f"{n2} later", s1.result, "+", y)]


def _sharing(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    k, each, e = rng.randint(2, 9), rng.randint(4, 15), None
    e = rng.randint(1, each - 1)
    total = k * each
    thing = rng.choice(["candies", "stickers", "cookies", "marbles"])
    question = (
        f"{name} shares {total} {thing} equally among {k} friends. Each friend then gives away {e}. "
        f"How many {thing} does each friend have left?"
    )
    s1 = Step("Each gets", total, "/", k)
    return question, [s1, Step("Each keeps", s1.result, "-", e)]


def _area(rng: random.Random) -> Problem:
    length, width = rng.randint(4, 20), rng.randint(3, 15)
    path = rng.randint(1, length * width - 1)
    question = (
        f"A garden is {length} meters long and {width} meters wide. A path covers {path} square meters. "
        f"How many square meters are left for plants?"
    )
    s1 = Step("Area", length, "*", width)
    return question, [s1, Step("Left for plants", s1.result, "-", path)]


def _savings(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    s, w = rng.randint(3, 20), rng.randint(2, 9)
    saved = s * w
    x, y = rng.randint(1, saved - 1), rng.randint(2, 40)
    question = (
        f"{name} saves ${s} each week for {w} weeks, then spends ${x} on a gift and earns ${y} more. "
        f"How many dollars does {name} have now?"
    )
    s1 = Step("Saved", s, "*", w)
    s2 = Step("After gift", s1.result, "-", x)
    return question, [s1, s2, Step("Now", s2.result, "+", y)]


def _perimeter(rng: random.Random) -> Problem:
    side, k = rng.randint(2, 60), rng.randint(2, 12)
    question = f"A square tile has sides of {side} cm. What is the total perimeter of {k} such tiles?"
    s1 = Step("One tile", 4, "*", side)
    return question, [s1, Step("All tiles", s1.result, "*", k)]


def _packing(rng: random.Random) -> Problem:
    boxes, per, g = rng.randint(2, 9), rng.randint(6, 20), rng.randint(2, 6)
    total = boxes * per
    remaining = g * rng.randint(1, total // g)
    sold = total - remaining
    item = rng.choice(ITEMS)
    question = (
        f"A store has {boxes} boxes with {per} {item}s each. It sells {sold} {item}s and packs the rest "
        f"into bags of {g}. How many bags does it fill?"
    )
    s1 = Step("Total", boxes, "*", per)
    s2 = Step("Remaining", s1.result, "-", sold)
    return question, [s1, s2, Step("Bags", s2.result, "/", g)]


def _classroom(rng: random.Random) -> Problem:
    rows, per, absent = rng.randint(3, 9), rng.randint(3, 9), None
    absent = rng.randint(1, rows * per - 1)
    extra = rng.randint(1, 12)
    question = (
        f"A classroom has {rows} rows of {per} desks. {absent} students are absent and {extra} visitors "
        f"come in. If every desk was full before, how many people are in the room now?"
    )
    s1 = Step("Students", rows, "*", per)
    s2 = Step("Present", s1.result, "-", absent)
    return question, [s1, s2, Step("Now", s2.result, "+", extra)]


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "shopping": _shopping,
    "change": _change,
    "speed": _speed,
    "reading": _reading,
    "ages": _ages,
    "sharing": _sharing,
    "area": _area,
    "savings": _savings,
    "perimeter": _perimeter,
    "packing": _packing,
    "classroom": _classroom,
}


def check_steps(steps: list[Step]) -> int:
    """Recompute every step, check that results chain and are non-negative; return the answer."""
    assert 2 <= len(steps) <= 4, "responses have 2-4 steps"
    for step in steps:
        assert step.result >= 0, f"negative intermediate in {step.line()}"
    return steps[-1].result


def render(question: str, steps: list[Step]) -> tuple[str, str, int]:
    answer = check_steps(steps)
    response = "\n".join(s.line() for s in steps) + f"\n#### {answer}"
    return question, response, answer


def parse_final_answer(text: str) -> int | None:
    """The integer on the last ``#### <n>`` line of ``text`` if that is its last non-empty line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not lines[-1].startswith("####"):
        return None
    value = lines[-1][4:].strip()
    try:
        return int(value)
    except ValueError:
        return None


def generate_math(n: int, seed: int, split: str = "all") -> list[dict]:
    """``n`` distinct problems, deterministic for ``seed``; ``split`` in {"all", "train", "heldout"}.

    Templates are tried round-robin (every template appears once ``n >= len(TEMPLATES)``); a template
    whose parameter space is exhausted simply yields fewer problems.
    """
    if split not in ("all", "train", "heldout"):
        raise ValueError(f"split must be 'all', 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"math|{seed}|{split}")
    names = sorted(TEMPLATES)
    out: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise RuntimeError(f"could not generate {n} distinct {split} math problems")
        template = names[attempts % len(names)]
        question, steps = TEMPLATES[template](rng)
        prompt, response, answer = render(question, steps)
        if prompt in seen:
            continue
        held = is_heldout_key(prompt, SPLIT_SALT)
        if (split == "train" and held) or (split == "heldout" and not held):
            continue
        seen.add(prompt)
        assert parse_final_answer(response) == answer
        out.append(
            {
                "id": f"math/{split}/{seed}/{len(out)}",
                "domain": "math",
                "template": template,
                "prompt": prompt,
                "response": response,
                "answer": answer,
            }
        )
    return out
