"""What one decode round costs on this machine: the cost half of choosing a draft budget.

A speculative round at budget k costs one target verify of `N = k + 1` tree nodes plus one head draft
(head forward + the target's lm_head over the draft depths: a causal head drafts only the min(k, B-1)
depths a budget-k tree can reach, so the draft is timed per tree size too) plus building the tree; an AR
step costs a 1-node verify. `budget="auto"` (`auto.py`) needs these costs *relative* to an AR step, t(N)/t(1) and
draft/t(1), because the best budget is where expected tokens per round divided by relative round cost
peaks. Those ratios depend on the hardware and the model (on a 2-core CPU t(17)/t(1) is ~2.2 for a 135M
target; on a GPU it stays near 1 to N = 64 and beyond), so they are measured, once, by the decode backend
itself through its protocol (`prefill` / `draft` / `verify` / `commit`), at a realistic KV length.

A `CostProfile` is cached as JSON under `~/.cache/jetflow_pl/cost_profiles/` (or `$JETFLOW_PL_CACHE_DIR`,
or `$XDG_CACHE_HOME/jetflow_pl`), named by a digest of its *fingerprint*: CPU and GPU model, torch
threads and version, the backends' compute revision (`COST_REVISION`), backend kind, dtype, device, and
the identity of target and head. The identity is the model *architecture* (config digest): the cost of
a forward depends on shapes, not on weight values.
A cached profile whose fingerprint no longer matches is re-measured; one passed explicitly
(`--cost-profile FILE`) that does not match is refused with one line naming what differs.

**The batch dimension.** Under continuous batching a round verifies B trees in ONE forward (the trees
padded to the largest), against B plain AR steps batched, t(B, 1). What the chooser needs at batch B is
again a ratio: t(B, N)/t(B, 1) (plus the batched draft and the B trees' build, over t(B, 1)); on a CPU it
grows fast with B (the forward turns compute-bound: B x N rows), on a GPU slowly. It is measured the same
way, with B slots prefilled and paired rounds, for B = 2, 4, 8, ... up to the engine's `max_batch`; at
each B the ladder stops at the first N whose round costs more than the head can ever commit (`block_size`
tokens), and at `MAX_BATCH_TOKENS` rows, so measuring stays bounded. A batch size between two measured ones
takes the larger one's costs, and one above the largest is bounded by `B / B_max` times its costs (a
forward of B rows costs at most that many forwards of B_max rows): both err toward AR. A version-1 file
(no batch dimension) still loads; the batch sizes it lacks are measured and the file is re-written.

**The KV length.** A round's cost ratio depends on the KV length it runs at: the verify's attention reads
the whole cache (linear in its length), the rest of the forward does not, and a tree of N nodes pays the
attention N times where an AR step pays it once. Measured on SmolLM2 with ONNX Runtime at 16 requests,
budget 16 cost 7.3 AR steps at 64 positions, 5.9 at 128 and 5.2 at 256 (the AR step: 92 / 124 / 168 ms).
A profile priced at one length under-prices every round on shorter sequences. So a profile is measured at
two lengths, `kv_len` and `kv_len / SHORT_KV_DIVISOR` (`short_kv`, same tree and batch sizes), and every
time in it is read at the round's own KV length as an affine function of it, through both points (the
model the two costs follow: attention linear in the length, everything else constant; at 128 it
predicted 6.3 for the measured 5.9, the err toward AR). `cost(budget, batch, kv_len)`; the budget
chooser passes the longest KV length of the round's requests, which a padded batch runs at.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import math
import os
import platform
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from jetflow_pl.errors import UserInputError, check_finite
from jetflow_pl.files import atomic_write_text, json_digest
from jetflow_pl.runtime.backend import DecodeBackend, max_budget, vocab_size
from jetflow_pl.tree import SCORE_QUANTUM, DraftTree, accept_greedy, build_tree

log = logging.getLogger(__name__)

#: tree sizes N (nodes, root included) whose verify cost is measured: budgets 0, 1, 2, 4, ..., 256
LADDER_NODES = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)
#: KV length at which costs are measured (a prompt plus part of a response)
DEFAULT_KV_LEN = 256
#: the second KV length a profile is measured at, as a fraction of the first (256 -> 64): a round's cost
#: ratio depends on the KV length it runs at (see `CostProfile.short_kv`), and two points fix the
#: affine model of seconds in KV length. Below `MIN_SHORT_KV` positions no second point is measured
SHORT_KV_DIVISOR = 4
MIN_SHORT_KV = 8
DEFAULT_REPEATS = 5
#: the first measurement on a machine (`cost_profile_for` with no profile yet, `full=False`): one timed
#: pass per KV length and batch size instead of `DEFAULT_REPEATS` / `BATCH_REPEATS`, and trees of at most
#: `QUICK_MAX_NODES` nodes (the largest ones cost the most to time and pay least on the machines where
#: measuring is slow), so a first `--budget auto` answers after a bounded wait; the decode loop's clock
#: check corrects what one pass gets wrong, and `full=True` (`--measure-costs`) measures the full profile
QUICK_REPEATS = 1
QUICK_MAX_NODES = 65
#: a pass times up to this many back-to-back rounds of one size, enough to fill MIN_SAMPLE_SECONDS
MAX_INNER_ROUNDS = 8
MIN_SAMPLE_SECONDS = 0.03
#: `CostProfile.spread` above this flags a profile measured under load
NOISY_SPREAD = 0.35
PROFILE_VERSION = 4
#: versions `CostProfile.load` reads (1: no batch dimension, its batch sizes are measured when needed;
#: 1 and 2: one draft time for every tree size, the full block's; 1-3: measured at one KV length only,
#: every round priced as at that length)
READABLE_VERSIONS = (1, 2, 3, 4)
#: the batch sizes a profile covers when nobody says how many requests decode together
DEFAULT_MEASURED_BATCH = 8
#: most rows (B x N) of one measured batched verify: bounds the measurement's time and memory
MAX_BATCH_TOKENS = 2048
#: repeats of the batched measurement (each pass prefills B slots)
BATCH_REPEATS = 3
#: paired samples per tree size and pass at B > 1, whatever `MIN_SAMPLE_SECONDS` allows: a batched round
#: is slow enough that the time rule gives one pair, and three pairs in all are too few for a median
MIN_BATCH_PAIRS = 2
#: untimed AR rounds after every prefill before a pass's first timed round. The first round after a
#: prefill pays one-time work that no decoding round repeats (a batch's KV group is gathered from its
#: prefilled slots; first-call allocations for the new shapes): measured on SmolLM2, torch, 16 slots,
#: 245 ms against 127 ms for the rounds after it. Timed, it fell on the AR half of the first pair of a
#: pass, which passes with an ascending ladder give to the smallest tree: the ratio t(B, 2)/t(B, 1) came
#: out 1.0 where decoding rounds measure 1.4-1.7.
SETTLE_ROUNDS = 1
#: revision of what the backends compute per round, part of the fingerprint: bumped when a change to a
#: backend's compute changes what a round costs, so profiles measured before it are measured again
#: (2: the draft's lm_head runs as the transposed product for a few rows, `TargetModel.few_row_logits`;
#: 3: a causal head drafts only the depths the round's trees can reach, `SequenceBackend.block_rows`, and
#: a ragged batch's KV commit moves only the kept rows, `KVGroup.commit`; 4: not a compute change but a
#: measurement fix, the first round after a prefill is no longer timed (`SETTLE_ROUNDS`): profiles
#: measured before it under-priced the smallest trees, most at large batch sizes; 5: the portable graphs'
#: attention reads the cache in place (`tree_attention_grouped`) and the batched graphs' caches keep a tree
#: round's output whole (`TensorKVGroup` slack), so rounds of ONNX Runtime cost less, most at large B;
#: 6: a measurement change, profiles are measured at a second, shorter KV length (`short_kv`): one
#: measured at 256 positions only under-priced budget 16 at 16 requests by 30% at 64 positions)
COST_REVISION = 6
#: config keys that do not change what a forward computes (paths, versions, bookkeeping)
_VOLATILE_CONFIG_KEYS = ("transformers_version", "architectures", "dtype", "torch_dtype")


class CostProfileMismatch(UserInputError):
    """An explicitly given cost profile was measured for another model, backend or machine."""


# --------------------------------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------------------------------


def _digest(obj: Any) -> str:
    return json_digest(obj, 16)


def _config_digest(config: Any) -> str:
    """Digest of an HF config's architecture (private `_...` keys, versions and dtype dropped)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return _digest({k: v for k, v in d.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS})


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _backend_device(backend: DecodeBackend) -> torch.device:
    device = getattr(backend, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def model_identity(backend: DecodeBackend) -> dict[str, str]:
    """`{"target", "head", "name", "dtype"}` of the models behind `backend`.

    `TorchBackend` exposes `target` / `head` (HF configs); graph, ONNX Runtime and TensorRT backends carry
    the engine directory's model description in `config` (`graphs.pair_config`).
    """
    target = getattr(backend, "target", None)
    if target is not None and hasattr(target, "config"):
        head = getattr(backend, "head", None)
        return {
            "target": _config_digest(target.config),
            "head": _config_digest(head.config) if head is not None else "none",
            "name": Path(str(getattr(target.config, "_name_or_path", "") or "target")).name,
            "dtype": str(getattr(target, "dtype", "")).replace("torch.", ""),
        }
    cfg = getattr(backend, "config", None)
    if isinstance(cfg, dict) and "target" in cfg:
        target_keys = ("target", "vocab_size", "max_positions", "target_layer_ids", "variant")
        head_keys = ("head", "block_size", "causal_head", "topk")
        engine_dir = getattr(backend, "engine_dir", None)
        return {
            "target": _digest({k: cfg.get(k) for k in target_keys}),
            "head": _digest({k: cfg.get(k) for k in head_keys}),
            "name": Path(str(engine_dir)).name if engine_dir is not None else "engine",
            "dtype": str(cfg.get("dtype", "")),
        }
    return {"target": type(backend).__qualname__, "head": "unknown", "name": "unknown", "dtype": ""}


def fingerprint(backend: DecodeBackend) -> dict[str, Any]:
    """Everything a measured cost depends on: machine, software, backend and model architecture."""
    device = _backend_device(backend)
    gpu = None
    if device.type == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(device)
    ident = model_identity(backend)
    kind = type(backend).__qualname__
    config = (getattr(backend, "config", None) or {}) if kind != "TorchBackend" else {}
    variant = config.get("variant")
    if config.get("batched"):  # batched graphs run other shapes (padded KV, per-request lengths)
        variant = f"{variant}+batched"
    # a runtime with its own thread pool (ONNX Runtime) does not follow torch's thread count; an explicit
    # pool size is part of what was measured (its default, None, keeps the fingerprint as it was)
    pool = getattr(backend, "intra_op_threads", None)
    if pool is not None:
        variant = f"{variant}+threads={pool}" if variant else f"threads={pool}"
    return {
        "cpu": cpu_model(),
        "gpu": gpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "revision": COST_REVISION,
        "backend": kind + (f"/{variant}" if variant else ""),
        "dtype": ident["dtype"],
        "device": str(device),
        "target": ident["target"],
        "head": ident["head"],
    }


# --------------------------------------------------------------------------------------------------
# the profile
# --------------------------------------------------------------------------------------------------


@dataclass
class CostProfile:
    """Measured round costs of one backend on one machine, in seconds (`measure_cost_profile`: ratios to
    t(1) are medians of paired samples, t(1) is the fastest AR round seen).

    nodes[i]: a tree size N; verify_s[i]: one verify of N nodes + the greedy acceptance walk + commit
    (N = 1 is one AR step, t(1)); build_s[i]: building the budget N-1 tree from draft log-probs;
    draft_s[i]: the head draft that tree needs (head forward + lm_head over its depths; 0 at N = 1; a
    file of version 1 or 2 holds one number, the full block's draft, which stands for every N). `cost(k)`
    is the ratio the budget chooser uses.
    """

    fingerprint: dict[str, Any]
    nodes: list[int]
    verify_s: list[float]
    build_s: list[float]
    draft_s: list[float]
    kv_len: int
    repeats: int
    name: str = ""
    created: str = ""
    version: int = PROFILE_VERSION
    measure_seconds: float = 0.0
    #: relative spread of the paired ratio samples (median over sizes of IQR / median): 0.1 is a quiet
    #: machine, > NOISY_SPREAD means the numbers are load, not the model (re-measure when quiet)
    spread: float = 0.0
    load_average: float | None = None
    #: batch sizes B > 1 measured (increasing); per B: its tree sizes (from 1), the seconds of one batched
    #: verify of B trees of N nodes (N = 1: B AR steps batched, t(B, 1)), of building the B trees, and of
    #: the batched draft they need (per N, as `draft_s`). Empty: no batch dimension (a version-1 file, or a
    #: backend of one sequence)
    batch_sizes: list[int] = field(default_factory=list)
    batch_nodes: list[list[int]] = field(default_factory=list)
    batch_verify_s: list[list[float]] = field(default_factory=list)
    batch_build_s: list[list[float]] = field(default_factory=list)
    batch_draft_s: list[list[float]] = field(default_factory=list)
    #: the same measurement at a second, shorter KV length: `{"kv_len": L, "verify_s", "build_s",
    #: "draft_s"` (per tree size, as the fields above), `"batch_verify_s", "batch_build_s",
    #: "batch_draft_s"` (per batch size and tree size, the same sizes as `batch_nodes`)`}`. None: one KV
    #: length only (a file before version 4, or a context too short), every round priced at `kv_len`
    short_kv: dict[str, Any] | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.nodes or self.nodes[0] != 1:
            raise UserInputError("a cost profile must start at N = 1 (one AR step)")
        if not (len(self.nodes) == len(self.verify_s) == len(self.build_s)):
            raise UserInputError("a cost profile needs one verify and one build time per tree size")
        if any(b <= a for a, b in pairwise(self.nodes)):
            raise UserInputError(f"cost profile tree sizes must increase, got {self.nodes}")
        self.draft_s = _per_size(self.draft_s, self.nodes, "draft_s")
        if not all(t > 0 for t in self.verify_s) or min(self.draft_s) < 0 or any(t < 0 for t in self.build_s):
            raise UserInputError("cost profile times must be positive")
        rows = (self.batch_nodes, self.batch_verify_s, self.batch_build_s, self.batch_draft_s)
        if any(len(r) != len(self.batch_sizes) for r in rows):
            raise UserInputError(
                "a cost profile needs tree sizes, verify, build and draft times per batch size"
            )
        if any(b <= a for a, b in pairwise(self.batch_sizes)) or any(b < 2 for b in self.batch_sizes):
            raise UserInputError(f"cost profile batch sizes must be > 1 and increase, got {self.batch_sizes}")
        drafts = []
        for b, nodes, verify, build, draft in zip(self.batch_sizes, *rows, strict=True):
            if not nodes or nodes[0] != 1 or any(y <= x for x, y in pairwise(nodes)):
                raise UserInputError(f"cost profile tree sizes at batch {b} must start at 1 and increase")
            if not (len(nodes) == len(verify) == len(build)):
                raise UserInputError(
                    f"cost profile at batch {b}: one verify and one build time per tree size"
                )
            drafts.append(_per_size(draft, nodes, f"batch_draft_s at batch {b}"))
            if not all(t > 0 for t in verify) or min(drafts[-1]) < 0 or any(t < 0 for t in build):
                raise UserInputError(f"cost profile times at batch {b} must be positive")
        self.batch_draft_s = drafts
        if self.short_kv is not None:
            self.short_kv = self._checked_short(self.short_kv)

    def _checked_short(self, short: dict[str, Any]) -> dict[str, Any]:
        """`short` (see `short_kv`) with every time list shaped as the first length's, else one error."""
        try:
            length = int(short["kv_len"])
            out: dict[str, Any] = {"kv_len": length}
            for key in ("verify_s", "build_s", "draft_s"):
                out[key] = [float(x) for x in short[key]]
                if len(out[key]) != len(self.nodes):
                    raise ValueError(f"{key} needs one time per tree size ({len(self.nodes)})")
            for key in ("batch_verify_s", "batch_build_s", "batch_draft_s"):
                rows = [[float(x) for x in row] for row in short[key]]
                if [len(r) for r in rows] != [len(n) for n in self.batch_nodes]:
                    raise ValueError(f"{key} needs the tree sizes of every measured batch size")
                out[key] = rows
        except (KeyError, TypeError, ValueError) as err:
            raise UserInputError(f"cost profile short_kv is malformed ({err})") from None
        if not 0 < length < self.kv_len:
            raise UserInputError(f"cost profile short_kv length must be in (0, {self.kv_len}), got {length}")
        times = [out["verify_s"], *out["batch_verify_s"]]
        extras = [out["build_s"], out["draft_s"], *out["batch_build_s"], *out["batch_draft_s"]]
        if any(t <= 0 for row in times for t in row) or any(t < 0 for row in extras for t in row):
            raise UserInputError("cost profile short_kv times must be positive")
        return out

    # ---- ratios -----------------------------------------------------------------------------------
    @property
    def t1(self) -> float:
        """Seconds of one AR step (verify of the root alone)."""
        return self.verify_s[0]

    @property
    def budgets(self) -> list[int]:
        """The budgets whose cost is known: N - 1 for every measured N."""
        return [n - 1 for n in self.nodes]

    @property
    def draft_ratio(self) -> float:
        """The full block's head draft (the largest tree size's) relative to one AR step."""
        return self.draft_s[-1] / self.t1

    def draft_ratio_at(self, budget: int) -> float:
        """The head draft a budget-`budget` round needs, relative to one AR step (0 at budget 0)."""
        return self.draft_s[self._index(budget + 1)] / self.t1

    def verify_ratio(self, n: int) -> float:
        """t(N)/t(1) for a measured N."""
        return self.verify_s[self._index(n)] / self.t1

    def cost(self, budget: int, batch: int = 1, kv_len: int | None = None) -> float:
        """Cost of one round at `budget` for `batch` requests at `kv_len` positions (None: the profile's
        own `kv_len`), in (batched) AR steps at that length: 1 for budget 0 (no draft at all), else
        (t(B, k+1) + draft(B) + build of B trees) / t(B, 1); batch 1 is (t(k+1) + draft + build) / t(1).
        A batch size or KV length that was not measured: see the module docstring."""
        if budget == 0:
            return 1.0
        nodes, verify, build, draft, scale = self._row(batch, kv_len)
        try:
            i = nodes.index(int(budget) + 1)
        except ValueError:
            where = f" at batch {batch}" if batch > 1 else ""
            raise ValueError(f"tree size {budget + 1} was not measured{where} (measured: {nodes})") from None
        return scale * (verify[i] + draft[i] + build[i]) / verify[0]

    def budgets_at(self, batch: int) -> list[int]:
        """The budgets whose cost is known at `batch` requests per round."""
        return [n - 1 for n in self._row(batch)[0]]

    @property
    def max_measured_batch(self) -> int:
        return self.batch_sizes[-1] if self.batch_sizes else 1

    def ar_seconds(self, batch: int = 1, kv_len: int | None = None) -> float:
        """Seconds of one AR step of `batch` requests batched, t(B, 1), at `kv_len` positions (None: the
        profile's `kv_len`), by the rules of `cost`."""
        _, verify, _, _, scale = self._row(batch, kv_len)
        return scale * verify[0]

    def batch_ar_ratio(self, batch: int) -> float | None:
        """t(B, 1)/t(1): what a batched AR step costs against one request's (None: B not measured)."""
        if batch == 1:
            return 1.0
        if batch not in self.batch_sizes:
            return None
        return self.batch_verify_s[self.batch_sizes.index(batch)][0] / self.t1

    def _row(
        self, batch: int, kv_len: int | None = None
    ) -> tuple[list[int], list[float], list[float], list[float], float]:
        """(tree sizes, verify s, build s, draft s, scale) of a round of `batch` requests (`_batch_index`;
        batch 1: the single-request ladder), every time read at `kv_len` positions (`_at_kv`)."""
        if batch <= 1:
            row: int | None = None
            nodes, verify, build, draft, scale = self.nodes, self.verify_s, self.build_s, self.draft_s, 1.0
        else:
            row, scale = self._batch_index(batch)
            if row is None:  # no batch dimension: the single-request row, times B
                nodes, verify, build, draft = self.nodes, self.verify_s, self.build_s, self.draft_s
            else:
                nodes = self.batch_nodes[row]
                verify, build, draft = (
                    self.batch_verify_s[row],
                    self.batch_build_s[row],
                    self.batch_draft_s[row],
                )
        short = self.short_kv
        if kv_len is None or short is None or int(kv_len) == self.kv_len:
            return nodes, verify, build, draft, scale
        prefix = "" if row is None else "batch_"

        def at(key: str, long: list[float]) -> list[float]:
            low = short[prefix + key] if row is None else short[prefix + key][row]
            return _at_kv(low, long, short["kv_len"], self.kv_len, int(kv_len))

        # a tree of more nodes never costs less than a smaller one, nor a deeper draft less: an
        # extrapolated time keeps the order the measured ones have
        verify_at = list(itertools.accumulate(at("verify_s", verify), max))
        draft_at = list(itertools.accumulate(at("draft_s", draft), max))
        return nodes, verify_at, at("build_s", build), draft_at, scale

    def _batch_index(self, batch: int) -> tuple[int | None, float]:
        """(row of the batch dimension, scale) that prices `batch` requests: the smallest measured batch
        size >= it (costs grow with B, so this errs toward AR), or above the largest measured one its
        costs times `batch / B_max` (an upper bound: a forward of B rows costs at most B / B_max forwards
        of B_max rows, and t(B, 1) >= t(B_max, 1)). No batch dimension: row None (the single-request
        ladder) and scale B."""
        i = bisect_left(self.batch_sizes, int(batch))
        if i < len(self.batch_sizes):
            return i, 1.0
        top = self.max_measured_batch
        return (None, float(batch)) if top == 1 else (len(self.batch_sizes) - 1, batch / top)

    def _index(self, n: int) -> int:
        try:
            return self.nodes.index(int(n))
        except ValueError:
            raise ValueError(f"tree size {n} was not measured (measured: {self.nodes})") from None

    @property
    def quick(self) -> bool:
        """True for a first, one-pass measurement (`QUICK_REPEATS`): `cost_profile_for(full=True)` replaces
        it with the full one."""
        return self.repeats < DEFAULT_REPEATS

    @property
    def noisy(self) -> bool:
        """True when the samples scattered too much for the ratios to describe the model."""
        return self.spread > NOISY_SPREAD

    def summary(self) -> str:
        """One line: t(1), t(N)/t(1) per N, the draft ratio, and a warning when the samples were noisy."""
        ratios = " ".join(f"{n}:{self.verify_ratio(n):.2f}" for n in self.nodes[1:])
        drafts = " ".join(
            f"{n}:{d / self.t1:.2f}" for n, d in zip(self.nodes[1:], self.draft_s[1:], strict=True)
        )
        line = f"t(1) {self.t1 * 1e3:.2f} ms; t(N)/t(1) {ratios}; draft/t(1) {drafts}"
        for b, nodes, verify, draft in zip(
            self.batch_sizes, self.batch_nodes, self.batch_verify_s, self.batch_draft_s, strict=True
        ):
            per = " ".join(f"{n}:{v / verify[0]:.2f}" for n, v in zip(nodes[1:], verify[1:], strict=True))
            line += (
                f"; batch {b}: t({b},1) {verify[0] / self.t1:.2f} t(1), t({b},N)/t({b},1) {per}, "
                f"full draft {draft[-1] / verify[0]:.2f}"
            )
        if self.short_kv is not None:
            at = self.short_kv["kv_len"]
            line += (
                f"; at KV {at} (measured at {self.kv_len} above): t(1) {self.ar_seconds(1, at) * 1e3:.2f} ms"
            )
            for b in [1, *self.batch_sizes]:
                nodes = self.budgets_at(b)
                per = " ".join(f"{k + 1}:{self.cost(k, b, at):.2f}" for k in nodes[1:])
                line += f", cost{'' if b == 1 else f' at batch {b}'} {per}"
        if self.noisy:
            load = f", load average {self.load_average:.1f}" if self.load_average is not None else ""
            line += (
                f"; NOISY (spread {self.spread:.2f}{load}): measured while the machine was busy, "
                "delete the profile to re-measure when it is quiet"
            )
        return line

    # ---- matching ---------------------------------------------------------------------------------
    def mismatch(self, other: dict[str, Any]) -> list[str]:
        """Fingerprint keys whose values differ from `other` (empty: this profile applies)."""
        keys = sorted(set(self.fingerprint) | set(other))
        return [k for k in keys if self.fingerprint.get(k) != other.get(k)]

    # ---- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    def save(self, path: str | Path) -> Path:
        """Write as JSON atomically (`files.atomic_write_text`): a reader never sees half a profile."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """Read a profile written by `save`; anything else is one `UserInputError` naming the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            if data.get("version") not in READABLE_VERSIONS:
                raise ValueError(f"version {data.get('version')!r}, expected one of {READABLE_VERSIONS}")
            prof = cls(**data)
        except UserInputError as err:
            raise UserInputError(f"cost profile {path}: {err}") from err
        except (OSError, ValueError, TypeError) as err:
            raise UserInputError(f"cost profile {path} is not a readable cost profile ({err})") from err
        prof.source = str(path)
        return prof


# --------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ladder_for(
    backend: DecodeBackend, kv_len: int, nodes: Sequence[int] = LADDER_NODES
) -> tuple[list[int], int]:
    """(tree sizes to measure, KV length): the ladder capped by the backend's tree limit and context.

    The KV length is at most half the context; each timed round commits one position, so the ladder
    also leaves room for a pass's growth (at most `MAX_INNER_ROUNDS` pairs of rounds per size).
    """
    max_pos = int(backend.max_positions)
    kv_len = max(1, min(int(kv_len), max_pos // 2))
    room = max_pos - kv_len - 2 * len(nodes) * MAX_INNER_ROUNDS - 1
    has_head = backend.block_size >= 2
    limit = max_budget(backend) + 1
    ladder = [n for n in nodes if n <= limit and n <= room and (n == 1 or has_head)]
    if not ladder or ladder[0] != 1:
        ladder = [1, *ladder]
    return ladder, kv_len


@torch.no_grad()
def _measurement_setup(backend: DecodeBackend, kv_len: int, nodes: Sequence[int], seed: int):
    """What every measurement starts from: the tree-size ladder and KV length the backend allows, its
    device, a seeded random prompt of `kv_len` tokens and its last token as the anchor."""
    ladder, kv_len = ladder_for(backend, kv_len, nodes)
    vocab = vocab_size(backend) or 2
    prompt = torch.randint(0, vocab, (kv_len,), generator=torch.Generator().manual_seed(seed))
    return ladder, kv_len, _backend_device(backend), prompt, int(prompt[-1])


def measure_cost_profile(
    backend: DecodeBackend,
    kv_len: int = DEFAULT_KV_LEN,
    nodes: Sequence[int] = LADDER_NODES,
    repeats: int = DEFAULT_REPEATS,
    width: int = 4,
    seed: int = 0,
    max_batch: int | None = None,
    batch_repeats: int = BATCH_REPEATS,
    short_kv_len: int | None = None,
    progress: bool = False,
) -> CostProfile:
    """Time the backend's own round steps for every tree size of the ladder (see the module docstring),
    and, where the backend batches, the batch dimension for `batch_sizes_for(backend, max_batch)`
    (`measure_batch_costs`, `batch_repeats` passes); then both again at `short_kv_len` positions (None:
    `kv_len / SHORT_KV_DIVISOR`; 0, or under `MIN_SHORT_KV`: not measured) for the same tree and batch
    sizes (`CostProfile.short_kv`).

    One warm-up pass, then `repeats` timed passes, each after a fresh prefill of `kv_len` seeded random
    tokens (token values do not change the cost of a forward) and `SETTLE_ROUNDS` untimed AR rounds (the
    first round after a prefill pays one-time work no decoding round repeats). A sample of size N is a pair of full
    rounds back to back: an AR round, then a round of N nodes (draft, build, verify, accept, commit);
    a pass takes a few samples per size (enough to fill `MIN_SAMPLE_SECONDS`, at most
    `MAX_INNER_ROUNDS`), alternating the order of sizes between passes. The chooser needs ratios only,
    and the per-pair ratio is what survives a shared machine: load comes in bursts that slow a step
    10x or more (a descheduled intra-op thread stalls the whole op), but two rounds milliseconds apart
    mostly see the same load. So t(N)/t(1), draft/t(1) and build/t(1) are medians of paired ratios,
    and t(1) itself (for display) is the fastest AR round seen. Trees are built from the head's real
    draft log-probs (best-first, `width` children), so their depths and positions are the ones
    decoding verifies. Every round commits only the root, so the KV length stays within a pass's
    rounds of `kv_len`. Leaves the backend needing a fresh `prefill`. `progress`: a progress bar on
    stderr (one step per pass), shown once the measurement has taken more than two seconds.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    ladder, kv_len, device, prompt, anchor = _measurement_setup(backend, kv_len, nodes, seed)
    sizes = batch_sizes_for(backend, max_batch)
    short = short_kv_for(kv_len, short_kv_len)
    # a pass: the warm-up or a timed one, per KV length and batch size (the batch-1 one included)
    passes = (1 + repeats + len(sizes) * (1 + batch_repeats)) * (2 if short else 1)
    with tqdm(
        total=passes, desc="measuring this machine's cost profile", unit="pass", delay=2, disable=not progress
    ) as bar:
        tick = bar.update
        single = _measure_single(backend, ladder, prompt, anchor, device, repeats, width, tick)
        batched = measure_batch_costs(backend, sizes, kv_len, nodes, batch_repeats, width, seed, tick=tick)
        short_kv = None
        if short:
            _, _, _, short_prompt, short_anchor = _measurement_setup(backend, short, nodes, seed)
            low = _measure_single(backend, ladder, short_prompt, short_anchor, device, repeats, width, tick)
            low_batched = measure_batch_costs(
                backend, sizes, short, nodes, batch_repeats, width, seed, ladders=batched["nodes"], tick=tick
            )
            short_kv = _short_kv(short, low, low_batched)
    return CostProfile(
        fingerprint=fingerprint(backend),
        nodes=ladder,
        verify_s=single["verify_s"],
        build_s=single["build_s"],
        draft_s=single["draft_s"],
        kv_len=kv_len,
        repeats=repeats,
        name=model_identity(backend)["name"],
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        measure_seconds=time.perf_counter() - t_start,
        spread=single["spread"],
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        batch_sizes=batched["sizes"],
        batch_nodes=batched["nodes"],
        batch_verify_s=batched["verify_s"],
        batch_build_s=batched["build_s"],
        batch_draft_s=batched["draft_s"],
        short_kv=short_kv,
    )


def short_kv_for(kv_len: int, short_kv_len: int | None = None) -> int:
    """The second KV length a profile measured at `kv_len` is measured at (0: none): `short_kv_len`, or
    by default `kv_len // SHORT_KV_DIVISOR`; none below `MIN_SHORT_KV` or at `kv_len` and above."""
    short = kv_len // SHORT_KV_DIVISOR if short_kv_len is None else int(short_kv_len)
    return short if MIN_SHORT_KV <= short < kv_len else 0


def _short_kv(length: int, single: dict[str, Any], batched: dict[str, list]) -> dict[str, Any]:
    """`CostProfile.short_kv` from the measurements at the second length."""
    return {
        "kv_len": length,
        **{k: single[k] for k in ("verify_s", "build_s", "draft_s")},
        **{f"batch_{k}": batched[k] for k in ("verify_s", "build_s", "draft_s")},
    }


@torch.no_grad()
def _measure_single(
    backend: DecodeBackend,
    ladder: Sequence[int],
    prompt: torch.Tensor,
    anchor: int,
    device: torch.device,
    repeats: int,
    width: int,
    tick: Callable[[], Any] = lambda: None,
) -> dict[str, Any]:
    """The single-request half of `measure_cost_profile` on one prompt: `{"verify_s", "build_s",
    "draft_s"}` per tree size of `ladder` and the samples' `spread`; `tick()` after every pass."""

    def one_round(n: int) -> tuple[float, float, float]:
        """(draft, build, verify + accept + commit) seconds of one round with a tree of `n` nodes."""
        d_s = b_s = 0.0
        if n > 1:
            _sync(device)
            t0 = time.perf_counter()
            lp = backend.draft(anchor, n - 1)  # the depths a budget n-1 tree can reach, as decoding asks
            check_finite(lp, "the draft head", "while measuring costs", "")  # as the decode loop does
            float(lp[0, 0])  # waits for the device, as the tree builder's host copy does
            t1 = time.perf_counter()
            tree = build_tree(lp, anchor, n - 1, width, None, SCORE_QUANTUM)
            d_s, b_s = t1 - t0, time.perf_counter() - t1
        else:
            tree = DraftTree.chain([anchor])
        _sync(device)
        t3 = time.perf_counter()
        logits = backend.verify(tree)
        check_finite(logits, "the target", "while measuring costs", "")
        accept_greedy(tree, logits.argmax(dim=-1))
        backend.commit([0])
        _sync(device)
        return d_s, b_s, time.perf_counter() - t3

    # warm-up pass (first-call allocations, graph/kernel caches); it also sizes how many back-to-back
    # samples of each size a pass takes, so cheap sizes get as many chances as expensive ones
    backend.prefill(prompt)
    inner = {}
    t_ar = sum(one_round(1))
    for n in ladder:
        t = sum(one_round(n)) + t_ar
        inner[n] = max(1, min(MAX_INNER_ROUNDS, math.ceil(MIN_SAMPLE_SECONDS / max(t, 1e-9))))
    tick()
    # every sample of size n is a pair: one AR round, then one round of n nodes, back to back. Other
    # processes slow both alike when they are that close in time, so the per-pair ratio is stable
    # where the raw times are not (bursts of load on a shared machine come and go over seconds)
    t1: list[float] = []
    ratio: dict[int, list[float]] = {n: [] for n in ladder if n > 1}
    build: dict[int, list[float]] = {n: [] for n in ladder if n > 1}
    draft: dict[int, list[float]] = {n: [] for n in ladder if n > 1}
    for rep in range(repeats):
        backend.prefill(prompt)
        for _ in range(SETTLE_ROUNDS):
            one_round(1)
        for n in ladder if rep % 2 == 0 else ladder[::-1]:
            for _ in range(inner[n]):
                a = one_round(1)[2]
                t1.append(a)
                if n == 1:
                    continue
                d_s, b_s, v_s = one_round(n)
                ratio[n].append(v_s / a)
                build[n].append(b_s / a)
                draft[n].append(d_s / a)
        tick()
    base = min(t1)
    # a verify of more nodes is never cheaper: fit the medians non-decreasing in N and >= t(1), so noise
    # cannot make a large tree look cheaper than a small one (the first value stays exactly 1)
    medians = [1.0, *(max(1.0, statistics.median(ratio[n])) for n in ladder[1:])]
    verify_s = [base * r for r in isotonic(medians)]
    build_s = [0.0 if n == 1 else base * statistics.median(build[n]) for n in ladder]
    draft_s = _draft_seconds(ladder, draft, base)
    spreads = [_relative_iqr(ratio[n]) for n in ladder[1:] if len(ratio[n]) >= 4]
    return {
        "verify_s": verify_s,
        "build_s": build_s,
        "draft_s": draft_s,
        "spread": statistics.median(spreads) if spreads else 0.0,
    }


def batch_sizes_for(backend: Any, max_batch: int | None = None) -> list[int]:
    """Batch sizes B > 1 a profile of `backend` should cover: 2, 4, 8, ... and `max_batch` itself, up to
    `max_batch` (default `DEFAULT_MEASURED_BATCH`) and the backend's request slots; none for a backend of
    one sequence (no `verify_batch`, or one slot)."""
    slots = int(getattr(backend, "max_batch", 1) or 1)
    if not hasattr(backend, "verify_batch") or slots < 2:
        return []
    cap = min(slots, DEFAULT_MEASURED_BATCH if max_batch is None else int(max_batch))
    sizes = []
    b = 2
    while b <= cap:
        sizes.append(b)
        b *= 2
    if cap >= 2 and cap not in sizes:
        sizes.append(cap)
    return sizes


@torch.no_grad()
def measure_batch_costs(
    backend: Any,
    batch_sizes: Sequence[int],
    kv_len: int = DEFAULT_KV_LEN,
    nodes: Sequence[int] = LADDER_NODES,
    repeats: int = BATCH_REPEATS,
    width: int = 4,
    seed: int = 0,
    ladders: Sequence[Sequence[int]] | None = None,
    tick: Callable[[], Any] = lambda: None,
) -> dict[str, list]:
    """The batch dimension of a cost profile (the `batch_*` fields of `CostProfile`), measured through the
    backend's batch protocol (`prefill(prompt, slot)`, `draft_batch` / `verify_batch` / `commit_batch`,
    `release`) as `measure_cost_profile` measures batch 1: per B, slots `0..B-1` prefilled with `kv_len`
    seeded tokens and `SETTLE_ROUNDS` untimed AR rounds, then pairs of rounds back to back (B AR steps
    batched, then B trees of N nodes in one draft and one verify), at least `MIN_BATCH_PAIRS` per size and
    pass, ratios as medians of the pairs. At each B the ladder stops after the first N
    whose round already costs more than `block_size` batched AR steps (no round can commit more tokens per
    request, so no larger N can pay) and at `MAX_BATCH_TOKENS` rows; `ladders` (one per batch size, in
    increasing order of B) fixes the tree sizes instead, so a second KV length is measured at exactly the
    sizes of the first (`CostProfile.short_kv`). Leaves every slot it used released. `tick()` after every
    pass (the warm-up included).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ladder, kv_len, device, prompt, anchor = _measurement_setup(backend, kv_len, nodes, seed)
    most_tokens = max(int(backend.block_size), 1)
    out: dict[str, list] = {k: [] for k in ("sizes", "nodes", "verify_s", "build_s", "draft_s")}
    order = [b for b in sorted(set(int(x) for x in batch_sizes)) if b >= 2]
    if ladders is not None and len(ladders) != len(order):
        raise ValueError(f"ladders: one per batch size {order}, got {len(ladders)}")
    for j, b in enumerate(order):
        slots = list(range(b))

        def one_round(n: int, slots: list[int] = slots) -> tuple[float, float, float]:
            return _batched_round(backend, slots, anchor, n, width, device)

        # warm-up: sizes the inner loops and cuts the ladder where a round can no longer pay
        _prefill_slots(backend, slots, prompt)
        t_ar = min(one_round(1)[2], one_round(1)[2])
        sizes, inner = [1], {1: 1}
        for n in ladder[1:] if ladders is None else list(ladders[j])[1:]:
            if ladders is None and b * n > MAX_BATCH_TOKENS:
                break
            t = sum(one_round(n))
            sizes.append(n)
            inner[n] = max(
                MIN_BATCH_PAIRS,
                min(MAX_INNER_ROUNDS, math.ceil(MIN_SAMPLE_SECONDS / max(t + t_ar, 1e-9))),
            )
            # 1.5: one slow warm-up round must not cut the ladder short
            if ladders is None and t / t_ar > 1.5 * most_tokens:
                break
        tick()
        base: list[float] = []
        ratio: dict[int, list[float]] = {n: [] for n in sizes[1:]}
        build: dict[int, list[float]] = {n: [] for n in sizes[1:]}
        draft: dict[int, list[float]] = {n: [] for n in sizes[1:]}
        for rep in range(repeats):
            _prefill_slots(backend, slots, prompt)
            for _ in range(SETTLE_ROUNDS):
                one_round(1)
            for n in sizes[1:] if rep % 2 == 0 else sizes[:0:-1]:
                for _ in range(inner[n]):
                    a = one_round(1)[2]
                    base.append(a)
                    d_s, b_s, v_s = one_round(n)
                    ratio[n].append(v_s / a)
                    build[n].append(b_s / a)
                    draft[n].append(d_s / a)
            if len(sizes) == 1:
                base.append(one_round(1)[2])
            tick()
        for s in slots:
            backend.release(s)
        t_b1 = min(base)
        medians = [1.0, *(max(1.0, statistics.median(ratio[n])) for n in sizes[1:])]
        out["sizes"].append(b)
        out["nodes"].append(sizes)
        out["verify_s"].append([t_b1 * r for r in isotonic(medians)])
        out["build_s"].append([0.0 if n == 1 else t_b1 * statistics.median(build[n]) for n in sizes])
        out["draft_s"].append(_draft_seconds(sizes, draft, t_b1))
    return out


def _at_kv(
    short: Sequence[float], long: Sequence[float], short_len: int, long_len: int, kv: int
) -> list[float]:
    """Times measured at `short_len` and `long_len` positions, read at `kv` positions: per entry the
    line through both points (attention linear in the length, the rest constant: module docstring),
    never below the line through the origin and the shorter point (a cost of the form a + b * L with
    a, b >= 0 is at least that below `short_len`). Where noise made the longer time the smaller one, the
    entry does not depend on the length: the mean of the two."""
    out = []
    for lo, hi in zip(short, long, strict=True):
        if hi < lo:
            out.append((lo + hi) / 2)
            continue
        t = lo + (hi - lo) * (kv - short_len) / (long_len - short_len)
        out.append(max(t, lo * max(kv, 1) / short_len) if kv < short_len else t)
    return out


def _per_size(draft: Any, nodes: Sequence[int], name: str) -> list[float]:
    """Draft seconds per tree size: a list as it is; one number (a version 1 or 2 file: the full block's
    draft, which every round then ran) for every N > 1, 0 at N = 1 (an AR step drafts nothing)."""
    if isinstance(draft, (int, float)):
        return [0.0 if n == 1 else float(draft) for n in nodes]
    if not isinstance(draft, list) or len(draft) != len(nodes):
        raise UserInputError(f"cost profile {name} needs one draft time per tree size ({len(nodes)})")
    return [float(x) for x in draft]


def _draft_seconds(sizes: Sequence[int], ratios: dict[int, list[float]], base: float) -> list[float]:
    """Per tree size, the median draft/AR ratio times `base` (0 at N = 1), never decreasing in N (a tree
    that can grow deeper needs at least as many drafted depths): pairs of noisy medians are fit."""
    medians = [statistics.median(ratios[n]) if ratios.get(n) else 0.0 for n in sizes[1:]]
    return [0.0, *(base * r for r in isotonic(medians))]


def _prefill_slots(backend: Any, slots: Sequence[int], prompt: torch.Tensor) -> None:
    for s in slots:
        backend.release(s)
    for s in slots:
        backend.prefill(prompt, s)


def _batched_round(
    backend: Any, slots: list[int], anchor: int, n: int, width: int, device: torch.device
) -> tuple[float, float, float]:
    """(draft, build, verify + accept + commit) seconds of one batched round of `n`-node trees on `slots`
    (every tree from its own request's draft; only the roots are committed, as in `measure_cost_profile`)."""
    d_s = b_s = 0.0
    if n > 1:
        _sync(device)
        t0 = time.perf_counter()
        lps = backend.draft_batch(slots, [anchor] * len(slots), n - 1)
        check_finite(lps[0], "the draft head", "while measuring costs", "")
        float(lps[0][0, 0])  # waits for the device, as the tree builder's host copy does
        t1 = time.perf_counter()
        trees = [build_tree(lp, anchor, n - 1, width, None, SCORE_QUANTUM) for lp in lps]
        d_s, b_s = t1 - t0, time.perf_counter() - t1
    else:
        trees = [DraftTree.chain([anchor]) for _ in slots]
    _sync(device)
    t3 = time.perf_counter()
    logits = backend.verify_batch(slots, trees)
    for tree, lg in zip(trees, logits, strict=True):
        accept_greedy(tree, lg.argmax(dim=-1))
    backend.commit_batch(slots, [[0]] * len(slots))
    _sync(device)
    return d_s, b_s, time.perf_counter() - t3


def with_batch_costs(
    prof: CostProfile, measured: dict[str, list], short_measured: dict[str, list] | None = None
) -> CostProfile:
    """`prof` with the batch sizes of `measured` (`measure_batch_costs`) added (replacing equal ones);
    `short_measured`: the same sizes at `prof.short_kv`'s length, without which a profile with a second
    KV length drops it (its batch rows would no longer cover every batch size)."""
    keys = ("nodes", "verify_s", "build_s", "draft_s")
    rows = {
        b: [
            prof_row[i]
            for prof_row in (prof.batch_nodes, prof.batch_verify_s, prof.batch_build_s, prof.batch_draft_s)
        ]
        for i, b in enumerate(prof.batch_sizes)
    }
    for i, b in enumerate(measured["sizes"]):
        rows[b] = [measured[k][i] for k in keys]
    order = sorted(rows)
    short = prof.short_kv
    if short is not None and short_measured is None:
        log.info("cost profile: batch sizes added without the KV length %s, dropping it", short["kv_len"])
        short = None
    if short is not None and short_measured is not None:
        low = {b: [short[f"batch_{k}"][i] for k in keys[1:]] for i, b in enumerate(prof.batch_sizes)}
        for i, b in enumerate(short_measured["sizes"]):
            low[b] = [short_measured[k][i] for k in keys[1:]]
        for j, k in enumerate(keys[1:]):
            short[f"batch_{k}"] = [low[b][j] for b in order]
    prof.batch_sizes = order
    prof.batch_nodes, prof.batch_verify_s, prof.batch_build_s, prof.batch_draft_s = (
        [rows[b][j] for b in order] for j in range(len(keys))
    )
    prof.short_kv = short
    prof.version = PROFILE_VERSION
    prof.__post_init__()
    return prof


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, c_ = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += c_
    out: list[float] = []
    for s_, c_ in blocks:
        out.extend([s_ / c_] * int(c_))
    return out


def _relative_iqr(xs: Sequence[float]) -> float:
    q = statistics.quantiles(xs, n=4)
    med = statistics.median(xs)
    return (q[2] - q[0]) / med if med > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """`$JETFLOW_PL_CACHE_DIR/cost_profiles`, else `$XDG_CACHE_HOME/jetflow_pl/cost_profiles`, else
    `~/.cache/jetflow_pl/cost_profiles`."""
    root = os.environ.get("JETFLOW_PL_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "cost_profiles"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "jetflow_pl" / "cost_profiles"


def cache_file(fp: dict[str, Any], cache_dir: str | Path | None = None) -> Path:
    """Where the profile of fingerprint `fp` is cached (`cache_dir`, default `default_cache_dir()`)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{_digest(fp)}.json"


def _complete(backend: Any, prof: CostProfile, max_batch: int | None, file: Path | None) -> CostProfile:
    """`prof` covering every batch size `batch_sizes_for(backend, max_batch)` names: the missing ones are
    measured now and `file` (if any) re-written with them."""
    missing = [b for b in batch_sizes_for(backend, max_batch) if b not in prof.batch_sizes]
    if not missing:
        return prof
    log.info("cost profile %s lacks batch sizes %s: measuring them", prof.source or "(given)", missing)
    source = prof.source
    measured = measure_batch_costs(backend, missing, prof.kv_len, prof.nodes)
    short = None
    if prof.short_kv is not None:
        at = prof.short_kv["kv_len"]
        short = measure_batch_costs(backend, missing, at, prof.nodes, ladders=measured["nodes"])
    with_batch_costs(prof, measured, short)
    prof.source = f"{source} (batch sizes {missing} measured now)"
    if file is not None:
        try:
            prof.save(file)
        except OSError as err:
            log.warning("could not write the completed cost profile to %s: %s", file, err)
    return prof


def cost_profile_for(
    backend: DecodeBackend,
    path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    max_batch: int | None = None,
    full: bool = False,
    progress: bool = False,
    **measure_kw: Any,
) -> CostProfile:
    """The cost profile of `backend` on this machine: from `path`, else from the cache, else measured.

    `path` given: an existing file must match this backend's fingerprint (else `CostProfileMismatch`,
    one line naming the differing keys); a missing one is measured and written there. No `path`: the
    cached profile for this fingerprint, re-measured (and re-cached) when absent, unreadable or stale.
    `max_batch`: the most requests that will decode together (`batch_sizes_for`); batch sizes a matching
    profile lacks (a version-1 file has none) are measured and written back. `profile.source` says where
    the returned profile came from.

    A profile measured here is a quick one (`QUICK_REPEATS` passes, trees up to `QUICK_MAX_NODES`: the
    first `auto` answers after a bounded wait, the decode loop's clock check corrects it) unless `full`, which also replaces a quick
    profile found on disk by the full measurement (`DEFAULT_REPEATS` / `BATCH_REPEATS` passes).
    `measure_kw` (`measure_cost_profile`'s) override both; `progress` shows a progress bar on stderr.
    """
    fp = fingerprint(backend)
    quick = {
        "repeats": QUICK_REPEATS,
        "batch_repeats": QUICK_REPEATS,
        "nodes": [n for n in LADDER_NODES if n <= QUICK_MAX_NODES],
    }
    passes = {} if full else quick
    measure_kw = {**passes, **measure_kw, "max_batch": max_batch, "progress": progress}

    def measured(file: Path, where: str) -> CostProfile:
        prof = measure_cost_profile(backend, **measure_kw)
        kind = "quick, one pass" if prof.quick else "full"
        try:
            prof.save(file)
            prof.source = f"{file} ({where} now, {kind})"
        except OSError as err:  # a read-only home must not stop decoding: the profile is still used
            if path is not None:
                raise
            log.warning("could not cache the cost profile in %s: %s", file, err)
            prof.source = f"measured now, {kind} (not cached)"
        return prof

    if path is not None:
        path = Path(path)
        if path.exists():
            prof = CostProfile.load(path)
            diff = prof.mismatch(fp)
            if diff:
                details = ", ".join(f"{k}: {prof.fingerprint.get(k)!r} here {fp.get(k)!r}" for k in diff)
                raise CostProfileMismatch(
                    f"cost profile {path} was measured for another model or machine ({details}); "
                    "delete it to re-measure, or leave out --cost-profile to use this machine's cache"
                )
            if full and prof.quick:
                return measured(path, "re-measured in full")
            return _complete(backend, prof, max_batch, path)
        return measured(path, "measured")
    file = cache_file(fp, cache_dir)
    if file.exists():
        try:
            prof = CostProfile.load(file)
            if not prof.mismatch(fp):
                if full and prof.quick:
                    return measured(file, "re-measured in full")
                return _complete(backend, prof, max_batch, file)
            log.info("cached cost profile %s does not match this machine/model: re-measuring", file)
        except UserInputError as err:
            log.info("unreadable cached cost profile (%s): re-measuring", err)
    return measured(file, "measured")
