"""`bench/distill.py`'s memory probe on small shapes: the chunked and the full-logits loss agree, and the
probe reports a measured (non-negative) peak for each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_distill", REPO / "bench/distill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_memory_probe_chunked_equals_naive(bench) -> None:
    naive = bench.memory_child("naive", rows=96, hidden=32, vocab=700, chunk=0, threads=1)
    chunked = bench.memory_child("chunked", rows=96, hidden=32, vocab=700, chunk=16, threads=1)
    assert chunked["loss"] == pytest.approx(naive["loss"], rel=1e-5)
    assert chunked["grad_norm"] == pytest.approx(naive["grad_norm"], rel=1e-4)
    for r in (naive, chunked):
        assert r["loss_step_peak_delta_mib"] >= 0 and r["peak_source"]
