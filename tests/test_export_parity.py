"""The export parity rule (export/parity.py, docs/EXPORT.md): it passes honest fp32 noise and refuses bugs.

The rule must not depend on the machine: the tolerance is derived from fp32 round-off and the model's
shape, not measured here. So these tests check the two directions that matter: real numerical bugs in an
exported graph (a wrong tree mask, a wrong softmax scale, an invisible KV prefix) are refused by the
export with one line naming the output, the error and the tolerance, and nothing is left on disk; and the
unit rules (row-wise relative error, near-tie handling of ids) behave as documented on hand-made arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import export.onnx_export as onnx_export
from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR
from export.cli import main as export_main
from export.onnx_export import ExportSettings, export_engine
from export.parity import (
    FP32_UNIT_ROUNDOFF,
    ParityError,
    argmax_tie_violations,
    greedy_decode_check,
    relative_tolerance,
    row_relative_error,
    topk_tie_violations,
)
from jetflow_pl.ops.tree_attention import dense_attention, tree_attention_parts

pytestmark = pytest.mark.skipif(
    not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
)


# ---------------------------------------------------------------------------------------------------
# the rule on hand-made arrays
# ---------------------------------------------------------------------------------------------------


def test_tolerance_follows_the_fp32_accumulation_bound():
    # 8 * sqrt(K) * u * (L + 1): grows with depth and reduction length, never with the data
    assert relative_tolerance(4, 768) == pytest.approx(8 * 768**0.5 * FP32_UNIT_ROUNDOFF * 5)
    assert relative_tolerance(30, 1536) > relative_tolerance(4, 768)
    # a large real model still keeps the tolerance far below what a real bug does (>= 1e-2)
    assert relative_tolerance(100, 16384) < 1e-2


def test_row_relative_error_sees_a_bug_in_one_row_of_many():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(40, 64)).astype(np.float32)
    got = ref * (1 + 1e-7 * rng.normal(size=ref.shape)).astype(np.float32)
    err, _ = row_relative_error(got, ref)
    assert err < 1e-5
    got[17] += 0.05 * ref[17]  # one row 5% off: a tree node that attends to the wrong rows
    err, row = row_relative_error(got, ref)
    assert row == 17 and err == pytest.approx(0.05, rel=1e-3)


def test_row_relative_error_is_scale_free():
    """Massive-activation channels (1e3) do not hide or inflate the error: it is relative per row."""
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(8, 576))
    ref[:, 3] = 2000.0
    noise = 1e-6 * np.abs(ref) * rng.normal(size=ref.shape)
    err_small, _ = row_relative_error(ref + noise, ref)
    err_big, _ = row_relative_error(1e3 * (ref + noise), 1e3 * ref)
    assert err_small == pytest.approx(err_big, rel=1e-9) and err_small < 2e-6


def test_non_finite_output_is_an_infinite_error():
    ref = np.ones((3, 4))
    got = ref.copy()
    got[1, 2] = np.nan
    assert row_relative_error(got, ref) == (float("inf"), 1)


def test_argmax_mismatch_is_allowed_only_at_a_near_tie():
    scores = np.array([[0.0, 5.0, 5.0 + 1e-7, 1.0], [0.0, 5.0, 3.0, 1.0]])
    expected = scores.argmax(-1)  # [2, 1]
    tol = 1e-5
    # row 0: torch's two best are 1e-7 apart, under 2 * tol * rms; a flip there is noise
    assert argmax_tie_violations(np.array([1, 1]), expected, scores, tol) == (0, 1, -1)
    # row 1: a clear winner (gap 2): a flip is a bug
    assert argmax_tie_violations(np.array([2, 2]), expected, scores, tol) == (1, 1, 1)


def test_topk_mismatch_is_allowed_only_between_tied_ranks():
    values = np.array([[-0.1, -2.0, -2.0 + 1e-8, -5.0]])
    ids = np.array([[7, 3, 9, 1]])
    tol = 1e-5
    swapped = np.array([[7, 9, 3, 1]])  # ranks 1 and 2 tie: allowed
    assert topk_tie_violations(swapped, ids, values, tol)[0] == 0
    wrong_top = np.array([[3, 7, 9, 1]])  # rank 0 vs 1 differ by 1.9: a bug
    assert topk_tie_violations(wrong_top, ids, values, tol)[0] >= 1


# ---------------------------------------------------------------------------------------------------
# injected bugs in the exported graph are refused
# ---------------------------------------------------------------------------------------------------


def _ancestors_dropped(q, pk, pv, k, v, mask, scale):
    """Bug: each tree node sees the prefix and itself only (its ancestors' bits ignored)."""
    keys, values, visible = tree_attention_parts(q, pk, pv, k, v, mask)
    n, p = q.shape[2], pk.shape[2]
    idx = torch.arange(n, device=q.device)
    tree = idx[:, None] == idx[None, :]
    return dense_attention(q, keys, values, torch.cat([visible[:, :p], tree], dim=1), scale)


def _causal_not_tree(q, pk, pv, k, v, mask, scale):
    """Bug: a plain causal mask instead of the tree mask (siblings and cousins leak into each other)."""
    keys, values, visible = tree_attention_parts(q, pk, pv, k, v, mask)
    n, p = q.shape[2], pk.shape[2]
    idx = torch.arange(n, device=q.device)
    return dense_attention(
        q, keys, values, torch.cat([visible[:, :p], idx[:, None] >= idx[None, :]], 1), scale
    )


def _prefix_invisible(q, pk, pv, k, v, mask, scale):
    """Bug: the KV prefix is masked out (the cache is never attended)."""
    keys, values, visible = tree_attention_parts(q, pk, pv, k, v, mask)
    p = pk.shape[2]
    return dense_attention(q, keys, values, torch.cat([visible[:, :p] & False, visible[:, p:]], 1), scale)


def _softmax_scale_off(q, pk, pv, k, v, mask, scale):
    """Bug: the softmax scale 10% off (e.g. a head_dim taken from the wrong config field)."""
    keys, values, visible = tree_attention_parts(q, pk, pv, k, v, mask)
    return dense_attention(q, keys, values, visible, scale * 1.1)


BUGS = {
    "ancestors_dropped": _ancestors_dropped,
    "causal_not_tree": _causal_not_tree,
    "prefix_invisible": _prefix_invisible,
    "softmax_scale_off": _softmax_scale_off,
}


def _inject(monkeypatch, bug):
    """Export graphs whose attention is `bug` while the torch side of the comparison stays correct."""
    original = onnx_export._export_graph

    def export_buggy(module, *args, **kwargs):
        correct = module.attend
        module.attend = bug
        try:
            return original(module, *args, **kwargs)
        finally:
            module.attend = correct

    monkeypatch.setattr(onnx_export, "_export_graph", export_buggy)


def _no_engine_left(out) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_numerical_bug_in_the_portable_graph_is_refused(tmp_path, monkeypatch, bug):
    _inject(monkeypatch, BUGS[bug])
    out = tmp_path / "engine"
    with pytest.raises(ParityError, match=r"target_verify\.onnx output '\w+'.*tolerance") as err:
        export_engine(
            ExportSettings(head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=out, variant="portable")
        )
    assert "\n" not in str(err.value)
    assert _no_engine_left(out)


def test_the_cli_prints_one_line_naming_output_error_and_tolerance(tmp_path, monkeypatch, capsys):
    _inject(monkeypatch, _causal_not_tree)
    out = tmp_path / "engine"
    code = export_main(
        ["--quiet", "--head", str(SMALL_HEAD_DIR), "--target", str(SMALL_TARGET_DIR), "--out", str(out)]
        + ["--variant", "portable"]
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: parity check failed:"), err
    assert "norm-relative error" in lines[0] or "token id" in lines[0]
    assert "tolerance" in lines[0] and "Traceback" not in err
    assert _no_engine_left(out)


def test_the_greedy_decode_check_refuses_a_backend_that_changes_a_token(tmp_path, monkeypatch):
    """Passes on the honest export, fails when the ONNX Runtime logits are pushed off one token's argmax."""
    from export.onnx_export import decode_check_prompt, load_pair
    from export.parity import target_tolerance
    from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend

    out = export_engine(
        ExportSettings(head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=tmp_path / "e", variant="portable")
    )
    head, target = load_pair(SMALL_HEAD_DIR, SMALL_TARGET_DIR)
    prompt = decode_check_prompt(SMALL_TARGET_DIR)
    tol = target_tolerance(target)
    assert greedy_decode_check(out, head, target, prompt, tol).matched > 0

    original = OnnxRuntimeBackend.run_target
    calls = {"n": 0}

    def shifted(self, feeds):
        logits, taps, keys, values = original(self, feeds)
        calls["n"] += 1
        if calls["n"] == 3:  # the second decode round: demote every row's argmax
            logits = logits.clone()
            top = logits.argmax(-1, keepdim=True)
            logits.scatter_(-1, top, logits.min().item() - 1.0)
        return logits, taps, keys, values

    monkeypatch.setattr(OnnxRuntimeBackend, "run_target", shifted)
    with pytest.raises(ParityError, match="greedy decode through the exported graphs diverges"):
        greedy_decode_check(out, head, target, prompt, tol)
