"""Stock llama.cpp drafts with our head losslessly, with our chain's acceptance (issue 43): `scripts/llamacpp_check.py`.

`slow`: it converts the head and the target to GGUF and runs llama.cpp's tools twice per prompt (a minute or
two). It needs llama.cpp's tools and a converter venv, which `python scripts/llamacpp_check.py --setup`
builds at `.llamacpp` (or point `JETFLOW_LLAMACPP_DIR` at a `vendor/llama.cpp` tree with `build/bin` and
`JETFLOW_LLAMACPP_PYTHON` at a python with sentencepiece), and the real SmolLM2 target (`python -m
data_gen.real_target`); it skips, saying which is missing, elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / ".llamacpp"
LLAMACPP = Path(
    os.environ.get("JETFLOW_LLAMACPP_DIR", BUILD / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")
)
CONVERTER = Path(os.environ.get("JETFLOW_LLAMACPP_PYTHON", BUILD / "venv" / "bin" / "python"))
TARGET = REPO / "models" / "SmolLM2-135M-Instruct"
TOOLS = ("llama-completion", "llama-speculative-simple")


@pytest.mark.slow
@pytest.mark.skipif(
    not all((LLAMACPP / "build" / "bin" / t).exists() for t in TOOLS),
    reason=f"no llama.cpp build at {LLAMACPP} (llamacpp_check.py --setup, or JETFLOW_LLAMACPP_DIR)",
)
@pytest.mark.skipif(
    not CONVERTER.exists(),
    reason=f"no converter python at {CONVERTER} (llamacpp_check.py --setup, or JETFLOW_LLAMACPP_PYTHON)",
)
@pytest.mark.skipif(
    not (TARGET / "config.json").is_file(), reason="SmolLM2 not materialized (data_gen.real_target)"
)
def test_stock_llamacpp_is_lossless_and_accepts_like_our_chain(tmp_path):
    out = tmp_path / "llamacpp_interop.json"
    cmd = [sys.executable, "scripts/llamacpp_check.py", "--llamacpp-dir", str(LLAMACPP)]
    cmd += [
        "--converter-python",
        str(CONVERTER),
        "--per-category",
        "1",
        "--max-tokens",
        "16",
        "--threads",
        "1",
    ]
    proc = subprocess.run([*cmd, "--workdir", str(tmp_path / "w"), "--out", str(out)], cwd=REPO)
    result = json.loads(out.read_text())
    assert result["lossless"], result["per_prompt"]
    lo, hi = result["allowed_range"]
    ll = result["llamacpp"]["mean_acceptance_length"]
    assert lo - 1e-9 <= ll <= hi + 1e-9, (result["llamacpp"], result["our_chain"])
    assert proc.returncode == 0
