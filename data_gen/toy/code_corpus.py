"""Python functions and classes from the running interpreter's standard library.

prompt = decorators + signature + docstring, response = the rest of the body (original indentation
relative to the ``def``/``class`` line). Only definitions with a docstring and a non-empty body after
it are used; sizes are capped. Records are split by top-level module name (see ``splits.py``).
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
import tokenize

from data_gen.toy._text import sanitize

EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo", "lib2to3"}
MAX_PROMPT_CHARS = 500
MAX_RESPONSE_CHARS = 600
MIN_RESPONSE_CHARS = 16


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=1)
def stdlib_modules() -> tuple[tuple[str, str], ...]:
    """Sorted ``(dotted_module_name, path)`` for every stdlib ``.py`` file outside the excluded folders."""
    root = stdlib_dir()
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and not all(p.isidentifier() for p in parts):
            continue
        for fn in sorted(filenames):
            if not fn.endswith(".py") or not fn[:-3].isidentifier():
                continue
            mod_parts = parts + ([] if fn == "__init__.py" else [fn[:-3]])
            if not mod_parts:
                continue
            found.append((".".join(mod_parts), os.path.join(dirpath, fn)))
    found.sort()
    return tuple(found)


def top_level(module: str) -> str:
    return module.split(".", 1)[0]


def _strip_indent(lines: list[str], indent: int) -> list[str]:
    out = []
    for line in lines:
        prefix = line[:indent]
        out.append(line[indent:] if prefix.strip() == "" else line.lstrip())
    return out


@functools.lru_cache(maxsize=4096)
def extract_module(module: str, path: str) -> tuple[dict, ...]:
    """All usable (prompt, response) records of one module file, in source order."""
    try:
        with tokenize.open(path) as f:
            source = f.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return ()
    lines = source.splitlines()
    records: list[dict] = []

    def visit(node: ast.AST, qual: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{qual}.{child.name}" if qual else child.name
                rec = _record(child, lines, module, name)
                if rec is not None:
                    records.append(rec)
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    visit(tree, "")
    return tuple(records)


def _record(node, lines: list[str], module: str, qualname: str) -> dict | None:
    if ast.get_docstring(node) is None or len(node.body) < 2:
        return None
    doc = node.body[0]
    if doc.end_lineno is None or node.body[1].lineno <= doc.end_lineno or node.end_lineno is None:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    def_line = lines[node.lineno - 1]
    indent = len(def_line) - len(def_line.lstrip())
    head = _strip_indent(lines[start - 1 : doc.end_lineno], indent)
    body = _strip_indent(lines[doc.end_lineno : node.end_lineno], indent)
    while body and not body[-1].strip():
        body.pop()
    prompt = sanitize("\n".join(ln.rstrip() for ln in head))
    response = sanitize("\n".join(ln.rstrip() for ln in body))
    if "\t" in prompt or "\t" in response:
        return None
    if len(prompt) > MAX_PROMPT_CHARS or not (MIN_RESPONSE_CHARS <= len(response) <= MAX_RESPONSE_CHARS):
        return None
    return {
        "id": f"code/{module}/{qualname}",
        "domain": "code",
        "module": module,
        "prompt": prompt,
        "response": response,
    }


def generate_code(n: int, seed: int, modules: list[str] | None = None) -> list[dict]:
    """Up to ``n`` distinct records drawn from ``modules`` (top-level names; default: all), seeded.

    Modules are visited in a seeded order and parsed only until a pool of ``3 n`` records is found, so
    small requests are fast. Fewer than ``n`` records come back only if the modules hold fewer.
    """
    allowed = None if modules is None else set(modules)
    candidates = [(m, p) for m, p in stdlib_modules() if allowed is None or top_level(m) in allowed]
    rng = random.Random(f"code|{seed}")
    rng.shuffle(candidates)
    pool: list[dict] = []
    for module, path in candidates:
        pool.extend(extract_module(module, path))
        if len(pool) >= 3 * n:
            break
    if len(pool) <= n:
        return [dict(r) for r in pool]
    return [dict(r) for r in rng.sample(pool, n)]
