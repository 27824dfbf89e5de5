"""`jetflow_pl` is the ground floor: it imports none of the stages, and its front door is light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "jetflow_pl"
#: the stages that import the library, never the reverse (`export` is tracked by its own issue)
STAGES = ("data_gen", "bench", "scripts")


def stage_imports(path: Path, root: Path = REPO) -> list[str]:
    """`file:line module` for every import of a stage in `path`, at any depth (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in STAGES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_the_library_imports_no_stage():
    offenders = [hit for path in sorted(LIBRARY.rglob("*.py")) for hit in stage_imports(path)]
    assert offenders == [], "jetflow_pl must not import " + "/".join(STAGES) + ":\n" + "\n".join(offenders)


def test_the_scan_finds_imports_at_any_depth(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\nimport data_gen\n\n"
        "def f():\n    from data_gen.toy.splits import heldout_prompts\n\n"
        "class C:\n    def g(self):\n        import bench.decode as d\n        from . import data_gen\n"
    )
    assert stage_imports(probe, tmp_path) == [
        "probe.py:2 data_gen",
        "probe.py:5 data_gen.toy.splits",
        "probe.py:9 bench.decode",
    ]


def test_top_level_names_are_the_real_classes():
    from jetflow_pl import DraftHead, SpeculativeGenerator, TargetModel
    from jetflow_pl.decoding.generator import SpeculativeGenerator as Gen
    from jetflow_pl.head import DraftHead as Head
    from jetflow_pl.target import TargetModel as Target

    assert (TargetModel, DraftHead, SpeculativeGenerator) == (Target, Head, Gen)


def test_importing_the_package_loads_neither_torch_nor_transformers():
    code = "import sys, jetflow_pl; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    bad = subprocess.run(
        [sys.executable, "-c", "import jetflow_pl; jetflow_pl.NoSuchThing"], capture_output=True, text=True
    )
    assert "module 'jetflow_pl' has no attribute 'NoSuchThing'" in bad.stderr
