"""`bench/distill.py`'s memory probe on small shapes: the chunked and the full-logits loss agree, and the
probe measures a much lower peak for the chunked one."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench():
    from bench import distill

    return distill


def test_memory_probe_chunked_equals_naive_and_needs_less_memory(bench) -> None:
    # 1024 x 8000 fp32 logits are 31 MiB: the full-logits step holds several such tensors, 64-row chunks
    # hold ~2 MiB at a time, so the probe must see a clear difference (RSS noise is well under 1 MiB)
    naive = bench.memory_child("naive", rows=1024, hidden=32, vocab=8000, chunk=0, threads=1)
    chunked = bench.memory_child("chunked", rows=1024, hidden=32, vocab=8000, chunk=64, threads=1)
    assert chunked["loss"] == pytest.approx(naive["loss"], rel=1e-5)
    assert chunked["grad_norm"] == pytest.approx(naive["grad_norm"], rel=1e-4)
    assert naive["peak_source"] and chunked["peak_source"]
    assert naive["loss_step_peak_delta_mib"] > 31
    assert naive["loss_step_peak_delta_mib"] > 2 * max(chunked["loss_step_peak_delta_mib"], 1.0)
