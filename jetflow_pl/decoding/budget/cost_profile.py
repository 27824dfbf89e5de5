"""What one decode round costs on this machine: the cost half of choosing a draft budget.

A speculative round at budget k drafts with the head, builds a tree of `N = k + 1` nodes, verifies it
with the target, accepts and commits; an AR round verifies the root alone. `budget="auto"` (`auto.py`)
needs these costs *relative* to an AR round, because the best budget is where expected tokens per round
divided by relative round cost peaks. The ratios depend on the hardware and the model (on a 2-core CPU a
budget-16 round of a 135M target costs about 2.2 AR rounds; on a GPU it stays near 1 to N = 64 and
beyond), so they are measured on the machine, through the decode loop's own round (`measure_costs.py`).

**Batch sizes.** Under continuous batching a round verifies B trees in ONE forward, against B AR steps
batched. A profile holds one row per measured batch size (1, 2, 4, 8, ...): the seconds of one whole
round of B trees of N nodes, N = 1 being B AR steps batched. A batch size between two measured ones takes
the larger one's costs; one above the largest is bounded by `B / B_max` times its costs (a forward of B
rows costs at most that many forwards of B_max rows): both err toward AR.

A `CostProfile` is cached as JSON under `~/.cache/jetflow_pl/cost_profiles/` (or `$JETFLOW_PL_CACHE_DIR`,
or `$XDG_CACHE_HOME/jetflow_pl`), named by a digest of its *fingerprint*: CPU and GPU model, torch
threads and version, the backends' compute revision (`COST_REVISION`), backend kind, dtype, device, and
the identity of target and head. The identity is the model *architecture* (config digest): the cost of
a forward depends on shapes, not on weight values.
"""

from __future__ import annotations

import os
import platform
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from jetflow_pl.errors import UserInputError
from jetflow_pl.files import VersionedJsonFile, json_digest
from jetflow_pl.runtime.backend import DecodeBackend

#: tree sizes N (nodes, root included) whose round cost is measured: budgets 0, 1, 2, 4, ..., 256
LADDER_NODES = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)
#: KV length at which costs are measured (a prompt plus part of a response)
DEFAULT_KV_LEN = 256
#: timed passes per batch size of a full profile (`cost_profile_for(full=True)`, `--measure-costs`)
DEFAULT_REPEATS = 5
#: the first measurement on a machine: one timed pass per batch size and trees of at most
#: `QUICK_MAX_NODES` nodes (the largest cost the most to time and pay least where measuring is slow), so
#: a first `--budget auto` answers after a bounded wait; the decode loop's clock check corrects it
QUICK_REPEATS = 1
QUICK_MAX_NODES = 65
#: `CostProfile.spread` above this flags a profile measured under load
NOISY_SPREAD = 0.35
#: the file format `save` writes and `load` reads: whole-round seconds per batch size and tree size.
#: Earlier versions (1-4: verify, build and draft timed apart by a private copy of the round, at one or
#: two KV lengths) are measured again: a cached one is replaced, a given one is refused with one line
PROFILE_VERSION = 5
#: the batch sizes a profile covers when nobody says how many requests decode together
DEFAULT_MEASURED_BATCH = 8
#: revision of what the backends compute per round, part of the fingerprint: bumped when a change to a
#: backend's compute, or to how a round is measured, changes what a profile holds, so profiles measured
#: before it are measured again (7: rounds are timed through the decode loop's own `run_round`)
COST_REVISION = 7
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
class CostProfile(VersionedJsonFile):
    """Measured round costs of one backend on one machine (`measure_costs.measure_cost_profile`).

    batch_sizes: the measured batch sizes, increasing, the first 1. Per batch size: `nodes`, its tree
    sizes (from N = 1, one AR round); `round_s`, the seconds of one whole round of that batch size and
    tree size (draft, build, verify, accept, commit: `RoundResult.seconds`), the AR round's being the
    fastest seen and the others that times the median of paired ratios. `cost(k, B)` is the ratio the
    budget chooser uses.
    """

    FILE_KIND = "cost profile"
    FILE_VERSION = PROFILE_VERSION
    FILE_STALE = ": delete it to re-measure"

    fingerprint: dict[str, Any]
    batch_sizes: list[int]
    nodes: list[list[int]]
    round_s: list[list[float]]
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
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        sizes = [int(b) for b in self.batch_sizes]
        if not sizes or sizes[0] != 1 or any(b <= a for a, b in pairwise(sizes)):
            raise UserInputError(f"cost profile batch sizes must start at 1 and increase, got {sizes}")
        if not (len(self.nodes) == len(self.round_s) == len(sizes)):
            raise UserInputError("a cost profile needs tree sizes and round times per batch size")
        for b, nodes, secs in zip(sizes, self.nodes, self.round_s, strict=True):
            if not nodes or nodes[0] != 1 or any(y <= x for x, y in pairwise(nodes)):
                raise UserInputError(f"cost profile tree sizes at batch {b} must start at N = 1 and increase")
            if len(nodes) != len(secs):
                raise UserInputError(f"cost profile at batch {b}: one round time per tree size")
            if not all(t > 0 for t in secs):
                raise UserInputError(f"cost profile times at batch {b} must be positive")
        self.batch_sizes = sizes

    # ---- ratios -----------------------------------------------------------------------------------
    @property
    def t1(self) -> float:
        """Seconds of one AR round of one request."""
        return self.round_s[0][0]

    @property
    def budgets(self) -> list[int]:
        """The budgets whose cost is known for one request: N - 1 for every measured N."""
        return self.budgets_at(1)

    def budgets_at(self, batch: int) -> list[int]:
        """The budgets whose cost is known at `batch` requests per round."""
        return [n - 1 for n in self._row(batch)[0]]

    @property
    def max_measured_batch(self) -> int:
        return self.batch_sizes[-1]

    def cost(self, budget: int, batch: int = 1) -> float:
        """Cost of one round at `budget` for `batch` requests in (batched) AR rounds: 1 for budget 0, else
        t(B, k+1) / t(B, 1). A batch size that was not measured: see the module docstring."""
        if budget == 0:
            return 1.0
        nodes, secs, scale = self._row(batch)
        try:
            i = nodes.index(int(budget) + 1)
        except ValueError:
            where = f" at batch {batch}" if batch > 1 else ""
            raise ValueError(f"tree size {budget + 1} was not measured{where} (measured: {nodes})") from None
        return scale * secs[i] / secs[0]

    def ar_seconds(self, batch: int = 1) -> float:
        """Seconds of one AR round of `batch` requests batched, t(B, 1), by the rules of `cost`."""
        _, secs, scale = self._row(batch)
        return scale * secs[0]

    def batch_ar_ratio(self, batch: int) -> float | None:
        """t(B, 1)/t(1): what a batched AR round costs against one request's (None: B not measured)."""
        if batch not in self.batch_sizes:
            return None
        return self.round_s[self.batch_sizes.index(batch)][0] / self.t1

    def _row(self, batch: int) -> tuple[list[int], list[float], float]:
        """(tree sizes, round seconds, scale) pricing `batch` requests: the smallest measured batch size
        >= it (costs grow with B, so this errs toward AR), or above the largest its costs times
        `batch / B_max` (a forward of B rows costs at most B / B_max forwards of B_max rows)."""
        b = max(1, int(batch))
        i = bisect_left(self.batch_sizes, b)
        if i < len(self.batch_sizes):
            return self.nodes[i], self.round_s[i], 1.0
        return self.nodes[-1], self.round_s[-1], b / self.batch_sizes[-1]

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
        """One line: t(1), then per batch size its AR round against t(1) and each tree size's cost, and a
        warning when the samples were noisy."""
        parts = [f"t(1) {self.t1 * 1e3:.2f} ms at KV {self.kv_len}"]
        for b, nodes in zip(self.batch_sizes, self.nodes, strict=True):
            costs = " ".join(f"{n}:{self.cost(n - 1, b):.2f}" for n in nodes[1:])
            head = "cost(N)" if b == 1 else f"batch {b}: t({b},1) {self.batch_ar_ratio(b):.2f} t(1), cost(N)"
            parts.append(f"{head} {costs}")
        line = "; ".join(parts)
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
