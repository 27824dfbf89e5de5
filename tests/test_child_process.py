"""The regeneration child of `DistillDataModule.prepare_data` dies with its parent: a fit stopped from outside
must not leave a regeneration writing on alone into the staging folder a rerun then writes into too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's exit may be reaped late by a container's init)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_child_is_killed_when_its_parent_dies(tmp_path):
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent_code = (
        "import sys\n"
        "from jetflow_pl.training.data import run_tied_to_parent\n"
        f"run_tied_to_parent([sys.executable, '-c', {child!r}])\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert _alive(pid)
    parent.kill()  # SIGKILL: the parent runs no cleanup at all
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the child outlived its parent"


def test_exit_status_is_returned(tmp_path):
    from jetflow_pl.training.data import run_tied_to_parent

    assert run_tied_to_parent([sys.executable, "-c", "raise SystemExit(3)"]) == 3
