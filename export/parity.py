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
   and RMSNorm amplification, fused-vs-unfused kernels): measured errors sit 7-700x under `tol` on the toy
   pair and on SmolLM2-135M (docs/EXPORT.md has the table). A real bug (a wrong mask bit, a missing
   softmax scale, a dropped ancestor) moves a row by 1e-2 or more, which is >= 10x over the tolerance of
   any model with L <= 100 and K <= 16k; `tests/test_export_parity.py` injects such bugs and sees the
   export refused. Rows are checked one by one, so a bug that touches one tree node of forty still fails.
   Outputs that are a linear projection `W x` of a normed hidden state `x` (the verify graph's logits and
   its new K/V rows) inherit the relative error of `x` multiplied by the projection's condition
   `||W||_2 ||x|| / ||W x||` (6-23 for SmolLM2's lm_head): they are measured in the scale `||W||_2 ||x||`
   of the state they come from (`lm_head_row_scale`, `kv_row_scale`), not in their own.
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


def row_relative_error(
    actual: np.ndarray, expected: np.ndarray, scale: np.ndarray | None = None
) -> tuple[float, int]:
    """Max over rows of `||a_r - e_r|| / ||e_r||` (or `/ scale_r` when given) and the worst row's index.

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
    ref = np.linalg.norm(e, axis=-1) if scale is None else np.asarray(scale, np.float64).reshape(-1)
    floor = 1e-6 * float(np.sqrt(np.mean(ref**2))) or 1e-30
    err = np.linalg.norm(a - e, axis=-1) / np.maximum(ref, floor)
    worst = int(np.argmax(err))
    return float(err[worst]), worst


def argmax_tie_violations(
    actual_ids: np.ndarray,
    expected_ids: np.ndarray,
    expected_scores: np.ndarray,
    tol: float,
    lm_head: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[int, int, int]:
    """Argmax ids (`[..., ]` over scores `[..., V]`): mismatches that are not near-ties.

    Returns `(violations, mismatches, first_violating_row)`. A mismatch between torch's argmax `i` and
    the ONNX argmax `j` is a near-tie when torch's scores of the two differ by at most what the float
    rule allows each of them to move: `2 * tol * rms(row)` in general; for logits `y = W h` with
    `lm_head=(||h_r|| per row, ||w_v|| per vocab row)`, `tol * ||h_r|| * (||w_i|| + ||w_j||)` (each logit
    `w_v . h` moves by at most `||w_v|| * ||dh||`, and `||dh|| <= tol * ||h||` is what the rule allows).
    """
    a, e = np.asarray(actual_ids).reshape(-1), np.asarray(expected_ids).reshape(-1)
    scores = _rows(expected_scores)
    diff = np.flatnonzero(a != e)
    violations, first = 0, -1
    for r in diff:
        row = scores[r]
        if not 0 <= a[r] < row.size:
            margin = -1.0
        elif lm_head is not None:
            margin = tol * float(lm_head[0][r]) * float(lm_head[1][e[r]] + lm_head[1][a[r]])
        else:
            margin = 2 * tol * float(np.sqrt(np.mean(row**2)))
        if margin < 0 or row[e[r]] - row[a[r]] > margin:
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
    row_scales: Mapping[str, np.ndarray] | None = None,
    lm_head: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[OutputCheck]:
    """Apply the rule to every output of one graph.

    `id_outputs` maps an integer output to `(rule, scores_output)`: rule "argmax" (ids over the scores'
    last axis) or "topk" (ids beside sorted values). `row_scales` gives an output the per-row scale its
    error is measured against instead of its own row norm (the logits: `lm_head_row_scale`); `lm_head`
    (`lm_head_norms`) gives argmax ids over logits their exact near-tie margin.
    """
    row_scales = row_scales or {}
    checks = []
    for name, ref in expected.items():
        got = actual[name]
        if name in id_outputs:
            rule, scores = id_outputs[name]
            if rule == "argmax":
                violations, mismatches, first = argmax_tie_violations(
                    got, ref, expected[scores], tol, lm_head
                )
            else:
                violations, mismatches, first = topk_tie_violations(got, ref, expected[scores], tol)
            checks.append(OutputCheck(graph, name, "ids", violations, 2 * tol, first, mismatches))
        else:
            err, row = row_relative_error(got, ref, row_scales.get(name))
            checks.append(OutputCheck(graph, name, "float", err, tol, row))
    return checks


def raise_on_failure(checks: list[OutputCheck]) -> None:
    """Raise one `ParityError` naming the first failing output (a float output first: its error is the
    cause, wrong ids the consequence) and listing the other failing outputs."""
    failed = sorted((c for c in checks if not c.ok), key=lambda c: c.kind != "float")
    if failed:
        also = f" (also failing: {', '.join(c.output for c in failed[1:])})" if failed[1:] else ""
        raise ParityError(f"parity check failed: {failed[0].describe()}{also}")


def _spectral_norm(weight) -> float:
    import torch

    w = weight.detach().to(torch.float64)
    return float(torch.linalg.eigvalsh(w.T @ w).max().clamp_min(0).sqrt())


def lm_head_row_scale(hidden: np.ndarray, weight) -> np.ndarray:
    """Per row `||W||_2 * ||h_r||`: the scale in which the logits `y_r = W h_r` are compared.

    The logits are a fixed linear map of the final normed hidden state. A relative error `e` of `h_r`
    (what the layers' rounding leaves) becomes `||W dh|| <= e * ||W||_2 * ||h_r||` in the logits, which
    relative to `||y_r||` is multiplied by the map's condition `||W||_2 ||h_r|| / ||y_r||` (6-23 on
    SmolLM2-135M's tied 49152 x 576 embedding). Measuring the logits error against `||W||_2 ||h_r||`
    holds them to the same tolerance as the hidden state they come from.
    """
    return _spectral_norm(weight) * np.linalg.norm(_rows(hidden), axis=-1)


def kv_row_scale(present: np.ndarray, projections: list[tuple[tuple, object]]) -> np.ndarray:
    """Per-row scales for `present_keys`/`present_values` `[L, B, Hkv, P+N, d]` (torch's values).

    The N new rows of layer `l`, KV head `h` are `k = W_h x` (then RoPE, a rotation, and on Qwen3 a
    per-head RMSNorm, which keeps relative errors) of the layer's normed input `x`: like the logits, their
    relative error is multiplied by the condition `||W_h||_2 ||x_n|| / ||k_n||`, so each row is measured
    against `||row|| * ||W_h||_2 ||x_n|| / ||k_n||` (`||W_h||_2 ||x_n||` on Llama). The P prefix rows are
    the input cache passed through, measured against their own norm. `projections[l]` is
    `((input x [B,N,H], output k [B,N,Hkv*d]), weight [Hkv*d, H])` (B = 1 for the batch-1 graphs).
    """
    import torch

    out = np.linalg.norm(np.asarray(present, dtype=np.float64), axis=-1)  # [L, B, Hkv, P+N]
    for layer, ((x, k), weight) in enumerate(projections):
        n = x.shape[1]
        heads = out.shape[2]
        w = weight.detach().to(torch.float64).reshape(heads, -1, weight.shape[-1])  # [Hkv, d, H]
        sigma = torch.linalg.eigvalsh(w @ w.transpose(1, 2)).amax(-1).clamp_min(0).sqrt().numpy()  # [Hkv]
        for b in range(x.shape[0]):
            x_norm = np.linalg.norm(x[b].double().numpy(), axis=-1)  # [N]
            k_norm = np.linalg.norm(k[b].double().numpy().reshape(n, heads, -1), axis=-1).T  # [Hkv, N]
            cond = sigma[:, None] * x_norm[None, :] / np.maximum(k_norm, 1e-30)
            out[layer, b, :, -n:] *= np.maximum(cond, 1.0)
    return out


def lm_head_norms(hidden: np.ndarray, weight) -> tuple[np.ndarray, np.ndarray]:
    """`(||h_r|| per row, ||w_v|| per vocabulary row)`: the exact per-logit error bound's factors."""
    return np.linalg.norm(_rows(hidden), axis=-1), weight.detach().double().norm(dim=-1).numpy()


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
    # the target's projections (logits = lm_head(final norm), K and V = k/v_proj(input norm)) are compared
    # in the scale of the hidden state they are computed from: keep what the torch side's modules see
    seen: dict[tuple[str, int], tuple] = {}
    hooks = []
    if role == "target":
        t = module.target

        def keep(key):
            return lambda _m, inputs, out: seen.update({key: (inputs[0].detach(), out.detach())})

        hooks.append(t.final_norm.register_forward_hook(keep(("final", 0))))
        for i, layer in enumerate(t.layers):
            hooks.append(layer.self_attn.k_proj.register_forward_hook(keep(("k", i))))
            hooks.append(layer.self_attn.v_proj.register_forward_hook(keep(("v", i))))
    try:
        results = Comparator.run(runners, data_loader=[feed])
    finally:
        for hook in hooks:
            hook.remove()
    expected = {n: np.asarray(results["torch"][0][n]) for n in output_names}
    actual = {n: np.asarray(results["onnxruntime"][0][n]) for n in output_names}
    scales, norms = {}, None
    if role == "target":
        hidden, weight = seen[("final", 0)][1].numpy(), module.target.lm_head.weight
        scales["logits"] = lm_head_row_scale(hidden, weight)
        norms = lm_head_norms(hidden, weight)
        for name, kind in (("present_keys", "k"), ("present_values", "v")):
            proj = [
                (seen[(kind, i)], getattr(layer.self_attn, f"{kind}_proj").weight)
                for i, layer in enumerate(module.target.layers)
            ]
            scales[name] = kv_row_scale(expected[name], proj)
    return check_outputs(path.name, actual, expected, tol, ID_OUTPUTS[role], scales, norms)


#: the greedy decode check: a fixed text, a few tokens, a small tree
DECODE_CHECK_TEXT = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
DECODE_CHECK_TOKENS = 24
DECODE_CHECK_BUDGET = 16
#: requests decoded together by the check of batched graphs
DECODE_CHECK_BATCH = 3


@dataclass
class DecodeCheck:
    """The greedy decode through the exported graphs (ONNX Runtime) against the torch backend."""

    tokens: int  # tokens compared
    matched: int  # leading tokens identical
    tie_at: int = -1  # step of a near-tie divergence (accepted), -1 if none
    tau: float = 0.0
    batch: int = 1  # requests decoded together in the batched check (1: none)
    batch_tokens: int = 0  # tokens compared there, over every request
    batch_matched: int = 0

    def as_dict(self) -> dict:
        out = {"tokens": self.tokens, "matched": self.matched, "tie_at": self.tie_at, "tau": self.tau}
        if self.batch > 1:
            out.update(batch=self.batch, batch_tokens=self.batch_tokens, batch_matched=self.batch_matched)
        return out


def greedy_decode_check(engine_dir, head, target, prompt_ids: list[int], tol: float) -> DecodeCheck:
    """Speculative greedy decoding on ONNX Runtime over the exported graphs must give the torch backend's
    autoregressive tokens; a divergence is accepted only at a near-tie of torch's own logits (the two
    tokens' logits within the margin of `argmax_tie_violations`), where the decode stops being comparable.

    Batched graphs (`max_batch > 1`) are checked as a batch too: the prompt and `DECODE_CHECK_BATCH - 1`
    shorter cuts of it decode together through the continuous-batching engine (different KV lengths,
    trees and acceptances in one forward), and every request must give its own torch tokens."""
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
    from jetflow_pl.runtime.torch_backend import TorchBackend

    backend = OnnxRuntimeBackend(engine_dir)
    width = min(4, backend.topk)
    n = min(DECODE_CHECK_TOKENS, backend.max_positions - len(prompt_ids))
    gen = SpeculativeGenerator(backend, budget=DECODE_CHECK_BUDGET, width=width)
    ort = gen.generate(prompt_ids, n)
    ar = ARGenerator(TorchBackend(target, head))
    check = _compare_decode(ort, ar.generate(prompt_ids, n).tokens, prompt_ids, target, tol, "")
    batch = min(DECODE_CHECK_BATCH, backend.max_batch)
    if batch > 1:
        prompts = [list(prompt_ids)] + [
            list(prompt_ids[: max(1, len(prompt_ids) - 5 * i)]) for i in range(1, batch)
        ]
        engine = gen.engine(max_batch=batch)
        handles = [engine.submit(p, n) for p in prompts]
        engine.run()
        for i, (p, h) in enumerate(zip(prompts, handles, strict=True)):
            one = _compare_decode(
                h.result, ar.generate(p, n).tokens, p, target, tol, f" (batch of {batch}, request {i})"
            )
            check.batch_tokens += one.tokens
            check.batch_matched += one.matched
            if check.tie_at < 0 and one.tie_at >= 0:
                check.tie_at = one.tie_at
        check.batch = batch
    return check


def _compare_decode(ort, ref_tokens: list[int], prompt_ids, target, tol: float, where: str) -> DecodeCheck:
    """`ort` (a generation result) against torch's AR tokens of the same prompt (see `greedy_decode_check`)."""
    import torch

    matched = 0
    for a, b in zip(ort.tokens, ref_tokens, strict=False):
        if a != b:
            break
        matched += 1
    if matched == len(ref_tokens) == len(ort.tokens):
        return DecodeCheck(len(ref_tokens), matched, tau=ort.tau)
    if matched < min(len(ref_tokens), len(ort.tokens)):
        with torch.no_grad():
            ids = torch.tensor([list(prompt_ids) + ref_tokens[:matched]])
            out = target(ids, logits_positions="last", return_hidden=True)
        row = out.logits.reshape(-1).double()
        i, j = ref_tokens[matched], ort.tokens[matched]
        h_norm, w_norms = lm_head_norms(out.hidden[:, -1].numpy(), target.lm_head.weight)
        gap = float(row[i] - row[j])
        margin = tol * float(h_norm[0]) * float(w_norms[i] + w_norms[j])
        if gap <= margin:
            return DecodeCheck(len(ref_tokens), matched, tie_at=matched, tau=ort.tau)
        raise ParityError(
            f"parity check failed: greedy decode through the exported graphs{where} diverges from torch at "
            f"token {matched} (onnxruntime {ort.tokens[matched]}, torch {ref_tokens[matched]}; torch logit "
            f"gap {gap:.3g} > near-tie margin {margin:.3g})"
        )
    raise ParityError(
        f"parity check failed: greedy decode through the exported graphs{where} stopped after "
        f"{len(ort.tokens)} tokens, torch after {len(ref_tokens)}"
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
