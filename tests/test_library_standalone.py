"""`jetflow_pl` is the ground floor: it imports none of the stages, and its front door is light.

Inside it, the runtime (`jetflow_pl.runtime`: engine directory, backends, KV bookkeeping) is the floor
under the decode loop (`jetflow_pl.decoding`): the loop imports the runtime's protocol, never the reverse.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "jetflow_pl"
#: the stage packages, which import the library, never the reverse
STAGES = ("data_gen", "export", "bench", "scripts", "trt_plugins")


def stage_imports(path: Path, root: Path = REPO, stages: tuple[str, ...] = STAGES) -> list[str]:
    """`file:line module` for every import of one of `stages` (dotted prefixes) in `path`, at any depth
    (functions included)."""
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
            if any(name == stage or name.startswith(stage + ".") for stage in stages):
                found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} {name}"))
    return [hit for _, hit in sorted(found)]


@pytest.mark.parametrize("stage", STAGES)
def test_the_library_imports_no_stage(stage):
    offenders = [
        hit for path in sorted(LIBRARY.rglob("*.py")) for hit in stage_imports(path, stages=(stage,))
    ]
    assert offenders == [], f"jetflow_pl must not import {stage}:\n" + "\n".join(offenders)


def test_the_runtime_does_not_import_the_decode_loop():
    runtime = LIBRARY / "runtime"
    offenders = [
        hit
        for path in sorted(runtime.rglob("*.py"))
        for hit in stage_imports(path, stages=("jetflow_pl.decoding",))
    ]
    assert offenders == [], "jetflow_pl.runtime must not import jetflow_pl.decoding:\n" + "\n".join(offenders)


def test_the_scan_finds_imports_at_any_depth(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\nimport data_gen\n\n"
        "def f():\n    from data_gen.toy.splits import heldout_prompts\n\n"
        "class C:\n    def g(self):\n        import bench.decode as d\n        from . import data_gen\n"
        "import exporter\nfrom export.contract import X\n"
    )
    assert stage_imports(probe, tmp_path) == [
        "probe.py:2 data_gen",
        "probe.py:5 data_gen.toy.splits",
        "probe.py:9 bench.decode",
        "probe.py:12 export.contract",
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
