"""Shared fixtures: real tiny models saved to real directories (built in seconds, seeded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_VOCAB = 96


def pytest_configure(config: pytest.Config) -> None:
    """Materialize the real target before collection when its package is installed (the README's test
    command installs it), so every real-target test runs whatever the test order; skip-marks evaluated
    at import time would otherwise see no folder yet. Cached: after the first run this only checks the
    marker (tests/test_real_target.py covers the materialization itself)."""
    import importlib.util

    from data_gen import real_target

    if importlib.util.find_spec(real_target.SMOLLM2_PACKAGE) is not None:
        real_target.ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init `tiny` Qwen3 target on disk (the toy world's `tiny` preset)."""
    from data_gen.toy.target_trainer import build_tiny_target

    out = tmp_path_factory.mktemp("tiny_target")
    build_tiny_target(out, vocab_size=TINY_VOCAB, seed=0)
    return out


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _ieee_subnormals():
    """Tests that build a DistillationModule without fitting it leave flush-to-zero on (it is process-wide
    by design, see DistillationModule); reset it so later tests, e.g. hypothesis float strategies, are
    independent of test order."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is many times faster than two when
    the other core is busy. Files opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
