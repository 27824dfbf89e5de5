"""The export parity rule: what "the ONNX graph computes what the torch model computes" must prove.

Two different fp32 implementations of the same network (torch's eager kernels and ONNX Runtime's MLAS
kernels, or the same library on a CPU with other vector units or another thread count) sum in different
orders, so their outputs differ in the last bits. A fixed absolute tolerance cannot tell that apart from a
bug: it fails a model whose activations are large (Llama-family residual streams carry a few channels of
magnitude 1e2-1e3, so a last-bit difference there is 1e-4 absolute) and it would pass a bug in a small
output. The check therefore has three parts (docs/EXPORT.md, "The parity rule"):

1. **Float outputs: row-wise norm-relative error.** For every row `r` (the last axis: one token's logits,
   one tap vector, one K/V head vector) `||onnx_r - torch_r||_2 / ||torch_r||_2 <= tol`, with

       tol = SAFETY * sqrt(K) * u * (L + 1)

   `u = 2**-24` is fp32's unit round-off. A length-K dot product in fp32 has a relative rounding error
   that grows like `sqrt(K) * u` when the rounding errors are independent (the usual statistical bound;
   the worst case `K * u` is never approached by real kernels); K is the longest reduction in a layer
   (`max(hidden, intermediate, heads * head_dim)`). Each of the L layers adds its own rounding to the
   residual stream, and the residual connection keeps these relative errors additive, hence `L + 1`
   (the `+1` is the final norm and the lm_head). `SAFETY = 8` covers what the bound leaves out (softmax
   and RMSNorm amplification, fused-vs-unfused kernels): measured errors sit 10-60x under `tol` on the toy
   pair and on SmolLM2-135M (docs/EXPORT.md has the table). A real bug (a wrong mask bit, a missing
   softmax scale, a dropped ancestor) moves a row by 1e-2 or more, which is >= 10x over the tolerance of
   any model with L <= 100 and K <= 16k; `tests/test_export_parity.py` injects such bugs and sees the
   export refused. Rows are checked one by one, so a bug that touches one tree node of forty still fails.
2. **Token ids: exact**, where losslessness depends on them (verify `argmax_ids`, the head's `topk_ids`).
   The one allowed difference is a near-tie: ids may differ where torch's own scores for the two
   candidates are within `2 * tol * rms(row)` of each other, i.e. inside the noise the float check
   already allows. Anything else is a bug.
3. **A short greedy decode** through the exported graphs on ONNX Runtime must produce the torch backend's
   tokens (`greedy_decode_check`): the end-to-end statement that matters for a lossless decoder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jetflow_pl.errors import UserInputError

#: fp32 unit round-off
FP32_UNIT_ROUNDOFF = 2.0**-24
#: margin over the statistical accumulation bound (see the module docstring)
SAFETY = 8.0


class ParityError(UserInputError):
    """An exported graph does not compute what the torch model computes; the message is one line naming
    the graph, the output, the measured error and the tolerance."""


def relative_tolerance(num_layers: int, reduction: int) -> float:
    """`SAFETY * sqrt(reduction) * u * (num_layers + 1)`: the row-wise norm-relative tolerance."""
    if num_layers < 0 or reduction < 1:
        raise ValueError(f"need num_layers >= 0 and reduction >= 1, got {num_layers}, {reduction}")
    return SAFETY * math.sqrt(reduction) * FP32_UNIT_ROUNDOFF * (num_layers + 1)


@dataclass
class OutputCheck:
    """The verdict on one output of one graph."""

    graph: str
    output: str
    kind: str  # "float" or "ids"
    error: float  # float: max row-wise relative error; ids: count of mismatches that are not near-ties
    tolerance: float  # float: the relative tolerance; ids: the near-tie margin factor (2 * tol)
    worst_row: int = -1
    mismatches: int = 0  # ids: all mismatching entries (near-ties included)

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance if self.kind == "float" else self.error == 0

    def describe(self) -> str:
        if self.kind == "float":
            return (
                f"{self.graph} output {self.output!r}: norm-relative error {self.error:.3g} "
                f"(row {self.worst_row}) > tolerance {self.tolerance:.3g}"
            )
        return (
            f"{self.graph} output {self.output!r}: {int(self.error)} token id(s) differ from torch's "
            f"(first at row {self.worst_row}) where torch's scores are not tied (near-tie tolerance "
            f"{self.tolerance:.3g} x rms of the row); ids must agree exactly"
        )

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "error": float(self.error),
            "tolerance": float(self.tolerance),
            "mismatches": int(self.mismatches),
            "ok": self.ok,
        }


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


def row_relative_error(actual: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Max over rows of `||a_r - e_r|| / ||e_r||` and the worst row's index.

    A row whose reference norm is tiny (below 1e-6 of the tensor's RMS row norm, e.g. an all-zero padding
    row) is measured against that floor instead, so 0/0 never decides; a non-finite value anywhere is an
    infinite error.
    """
    a, e = _rows(actual), _rows(expected)
    if a.shape != e.shape:
        raise ParityError(f"shape {a.shape} != {e.shape}")
    if a.size == 0:
        return 0.0, -1
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        bad = np.flatnonzero(~(np.isfinite(a).all(-1) & np.isfinite(e).all(-1)))
        return math.inf, int(bad[0])
    ref = np.linalg.norm(e, axis=-1)
    floor = 1e-6 * float(np.sqrt(np.mean(ref**2))) or 1e-30
    err = np.linalg.norm(a - e, axis=-1) / np.maximum(ref, floor)
    worst = int(np.argmax(err))
    return float(err[worst]), worst


def argmax_tie_violations(
    actual_ids: np.ndarray, expected_ids: np.ndarray, expected_scores: np.ndarray, tol: float
) -> tuple[int, int, int]:
    """Argmax ids (`[..., ]` over scores `[..., V]`): mismatches that are not near-ties.

    Returns `(violations, mismatches, first_violating_row)`. A mismatch is a near-tie when torch's scores
    of its own argmax and of the ONNX argmax differ by at most `2 * tol * rms(row)`.
    """
    a, e = np.asarray(actual_ids).reshape(-1), np.asarray(expected_ids).reshape(-1)
    scores = _rows(expected_scores)
    diff = np.flatnonzero(a != e)
    violations, first = 0, -1
    for r in diff:
        row = scores[r]
        margin = 2 * tol * float(np.sqrt(np.mean(row**2)))
        if not (0 <= a[r] < row.size) or row[e[r]] - row[a[r]] > margin:
            violations += 1
            first = int(r) if first < 0 else first
    return violations, int(diff.size), first


def topk_tie_violations(
    actual_ids: np.ndarray, expected_ids: np.ndarray, expected_values: np.ndarray, tol: float
) -> tuple[int, int, int]:
    """Top-k ids `[..., K]` with torch's sorted values `[..., K]`: mismatches that are not near-ties.

    A rank's id may differ only where torch's value at that rank is within `2 * tol * rms(row)` of a
    neighbouring rank's (two near-equal candidates swapped), or at the last rank (a tie with the first
    candidate outside the top-k, whose value the float check has already compared).
    """
    a, e = _rows(actual_ids).astype(np.int64), _rows(expected_ids).astype(np.int64)
    vals = _rows(expected_values)
    k = vals.shape[-1]
    violations = mismatches = 0
    first = -1
    for r, c in zip(*np.nonzero(a != e), strict=True):
        mismatches += 1
        row = vals[r]
        margin = 2 * tol * float(np.sqrt(np.mean(row**2)))
        neighbours = [row[j] for j in (c - 1, c + 1) if 0 <= j < k]
        tied = c == k - 1 or any(abs(row[c] - v) <= margin for v in neighbours)
        if not tied:
            violations += 1
            first = int(r) if first < 0 else first
    return violations, mismatches, first


def check_outputs(
    graph: str,
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    tol: float,
    id_outputs: Mapping[str, tuple[str, str]],
) -> list[OutputCheck]:
    """Apply the rule to every output of one graph.

    `id_outputs` maps an integer output to `(rule, scores_output)`: rule "argmax" (ids over the scores'
    last axis) or "topk" (ids beside sorted values).
    """
    checks = []
    for name, ref in expected.items():
        got = actual[name]
        if name in id_outputs:
            rule, scores = id_outputs[name]
            fn = argmax_tie_violations if rule == "argmax" else topk_tie_violations
            violations, mismatches, first = fn(got, ref, expected[scores], tol)
            checks.append(OutputCheck(graph, name, "ids", violations, 2 * tol, first, mismatches))
        else:
            err, row = row_relative_error(got, ref)
            checks.append(OutputCheck(graph, name, "float", err, tol, row))
    return checks


def raise_on_failure(checks: list[OutputCheck]) -> None:
    """Raise one `ParityError` naming the first failing output (a float output first: its error is the
    cause, wrong ids the consequence) and listing the other failing outputs."""
    failed = sorted((c for c in checks if not c.ok), key=lambda c: c.kind != "float")
    if failed:
        also = f" (also failing: {', '.join(c.output for c in failed[1:])})" if failed[1:] else ""
        raise ParityError(f"parity check failed: {failed[0].describe()}{also}")


# ---------------------------------------------------------------------------------------------------
# graph-level: tolerances per graph, ONNX Runtime vs eager torch through polygraphy, the greedy decode
# ---------------------------------------------------------------------------------------------------


def _layer_reduction(config) -> int:
    """The longest dot product in one decoder layer of an HF-style config."""
    heads = int(getattr(config, "num_attention_heads", 1))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return max(int(config.hidden_size), int(getattr(config, "intermediate_size", 0) or 0), heads * head_dim)


def target_tolerance(target) -> float:
    """The verify graph: every target layer, the final norm and the lm_head."""
    return relative_tolerance(int(target.num_layers), _layer_reduction(target.config))


def head_tolerance(head) -> float:
    """The head graph: the feature fusion (`fc` over n*H tap features), every head layer, the lm_head."""
    cfg = head.config
    fused = int(cfg.num_taps) * int(cfg.target_hidden_size)
    return relative_tolerance(len(head.layers) + 1, max(_layer_reduction(cfg), fused))


#: integer outputs of the two graphs and the scores they are chosen from
ID_OUTPUTS = {
    "target": {"argmax_ids": ("argmax", "logits")},
    "head": {"topk_ids": ("topk", "topk_logprobs")},
}


def compare_graph_with_torch(module, example, path, output_names: list[str], role: str, tol: float):
    """Run ONNX Runtime and the eager module on the same inputs through polygraphy's runners and
    `Comparator`, then apply the parity rule to every output. Returns the list of `OutputCheck`s."""
    import logging
    import time
    from collections import OrderedDict

    import torch
    from polygraphy import util as poly_util
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.backend.pyt import PytRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    from jetflow_pl.runtime.ort_session import make_session

    class CpuTorchRunner(PytRunner):
        """polygraphy's PytRunner moves inputs to CUDA; this one stays on the module's device (CPU)."""

        @poly_util.check_called_by("infer")
        def infer_impl(self, feed_dict):
            with torch.no_grad():
                start = time.time()
                outs = self.model(*[torch.from_numpy(np.asarray(v)) for v in feed_dict.values()])
                end = time.time()
            self.inference_time = end - start
            return OrderedDict((n, o.cpu().numpy()) for n, o in zip(self.output_names, outs, strict=True))

    if not logging.getLogger("export").isEnabledFor(logging.INFO):  # --quiet: only the verdict matters
        G_LOGGER.module_severity = G_LOGGER.WARNING
    meta = TensorMetadata()
    for name, value in example.items():
        meta.add(name, value.numpy().dtype, tuple(value.shape))
    feed = OrderedDict((k, v.numpy()) for k, v in example.items())
    runners = [
        CpuTorchRunner(lambda: module, meta, output_names, name="torch"),
        OnnxrtRunner(make_session(path), name="onnxruntime"),
    ]
    results = Comparator.run(runners, data_loader=[feed])
    expected = {n: np.asarray(results["torch"][0][n]) for n in output_names}
    actual = {n: np.asarray(results["onnxruntime"][0][n]) for n in output_names}
    return check_outputs(path.name, actual, expected, tol, ID_OUTPUTS[role])


#: the greedy decode check: a fixed text, a few tokens, a small tree
DECODE_CHECK_TEXT = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
DECODE_CHECK_TOKENS = 24
DECODE_CHECK_BUDGET = 16


@dataclass
class DecodeCheck:
    """The greedy decode through the exported graphs (ONNX Runtime) against the torch backend."""

    tokens: int  # tokens compared
    matched: int  # leading tokens identical
    tie_at: int = -1  # step of a near-tie divergence (accepted), -1 if none
    tau: float = 0.0

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "matched": self.matched, "tie_at": self.tie_at, "tau": self.tau}


def greedy_decode_check(engine_dir, head, target, prompt_ids: list[int], tol: float) -> DecodeCheck:
    """Speculative greedy decoding on ONNX Runtime over the exported graphs must give the torch backend's
    autoregressive tokens; a divergence is accepted only at a near-tie of torch's own logits (the two
    tokens' logits within `2 * tol * rms(logits)`), where the decode stops being comparable."""
    import torch

    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
    from jetflow_pl.runtime.torch_backend import TorchBackend

    backend = OnnxRuntimeBackend(engine_dir)
    width = min(4, backend.topk)
    n = min(DECODE_CHECK_TOKENS, backend.max_positions - len(prompt_ids))
    ort = SpeculativeGenerator(backend, budget=DECODE_CHECK_BUDGET, width=width).generate(prompt_ids, n)
    ref = ARGenerator(TorchBackend(target, head)).generate(prompt_ids, n)
    matched = 0
    for a, b in zip(ort.tokens, ref.tokens, strict=False):
        if a != b:
            break
        matched += 1
    if matched == len(ref.tokens) == len(ort.tokens):
        return DecodeCheck(len(ref.tokens), matched, tau=ort.tau)
    if matched < min(len(ref.tokens), len(ort.tokens)):
        with torch.no_grad():
            ids = torch.tensor([list(prompt_ids) + ref.tokens[:matched]])
            row = target(ids, logits_positions="last").logits.reshape(-1).double()
        gap = float(row[ref.tokens[matched]] - row[ort.tokens[matched]])
        margin = 2 * tol * float(row.pow(2).mean().sqrt())
        if gap <= margin:
            return DecodeCheck(len(ref.tokens), matched, tie_at=matched, tau=ort.tau)
        raise ParityError(
            f"parity check failed: greedy decode through the exported graphs diverges from torch at token "
            f"{matched} (onnxruntime {ort.tokens[matched]}, torch {ref.tokens[matched]}; torch logit gap "
            f"{gap:.3g} > near-tie margin {margin:.3g})"
        )
    raise ParityError(
        f"parity check failed: greedy decode through the exported graphs stopped after {len(ort.tokens)} "
        f"tokens, torch after {len(ref.tokens)}"
    )


def parity_report(checks: list[OutputCheck], decode: DecodeCheck) -> dict:
    """What `config.json` records under `parity`: the rule, every output's error and tolerance, the decode."""
    graphs: dict[str, dict] = {}
    for c in checks:
        graphs.setdefault(c.graph, {})[c.output] = c.as_dict()
    return {
        "rule": "row-wise norm-relative error <= SAFETY*sqrt(K)*u*(L+1); ids exact up to near-ties; "
        "greedy decode equal to torch (docs/EXPORT.md)",
        "safety": SAFETY,
        "graphs": graphs,
        "greedy_decode": decode.as_dict(),
    }
