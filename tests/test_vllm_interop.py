"""Stock vLLM serves our head losslessly, with our chain's acceptance (issue 43): `scripts/vllm_check.py`.

`slow`: it starts vLLM's CPU engine twice (minutes). It needs the vLLM venv, which `python
scripts/vllm_check.py --setup` creates at `.venv-vllm` (or point `JETFLOW_VLLM_VENV` at one), and the real
SmolLM2 target (`python -m data_gen.real_target`); it skips, saying which is missing, elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("JETFLOW_VLLM_VENV", REPO / ".venv-vllm"))
TARGET = REPO / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.slow
@pytest.mark.skipif(
    not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV} (vllm_check.py --setup)"
)
@pytest.mark.skipif(
    not (TARGET / "config.json").is_file(), reason="SmolLM2 not materialized (data_gen.real_target)"
)
def test_stock_vllm_is_lossless_and_accepts_like_our_chain(tmp_path):
    out = tmp_path / "vllm_interop.json"
    cmd = [
        sys.executable,
        "scripts/vllm_check.py",
        "--venv",
        str(VENV),
        "--per-category",
        "1",
        "--max-tokens",
        "32",
    ]
    proc = subprocess.run(
        [*cmd, "--tree-budgets", "--workdir", str(tmp_path / "w"), "--out", str(out)], cwd=REPO
    )
    result = json.loads(out.read_text())
    assert result["lossless"], result["per_prompt"]
    assert result["acceptance_gap"] <= result["tolerance"], (result["vllm"], result["our_chain"])
    assert proc.returncode == 0
