"""TensorRT: `jetflow-export --engine` errors, engine profiles, the TensorRT backend's bookkeeping, the
tensorrt-rtx op-coverage lint of the portable graphs and (marked `tensorrt`) real engines against torch.

What runs where:
* everywhere: the bad-input errors (no TensorRT, a missing plugin library, a tree larger than the
  profile), the profile shapes, and the backend's buffer/cache bookkeeping driven by stand-in engines that
  run the exported ONNX graphs with ONNX Runtime (the only part of the backend that needs TensorRT and a
  GPU is the engine object itself);
* where `tensorrt_rtx` imports (CPU is enough): both portable graphs parse and build (op-coverage lint);
* `pytest -m tensorrt` on a GPU machine with TensorRT: real engines, decoded against the torch backend.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR
from export.tensorrt_build import (
    NO_TENSORRT,
    PLUGIN_LIB_ENV,
    ProfileLimits,
    profile_shapes,
    require_tensorrt,
    resolve_plugin_lib,
)
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.contract import HEAD_GRAPH, HEAD_INPUTS, TARGET_GRAPH, TARGET_INPUTS
from jetflow_pl.runtime.tensorrt_backend import TensorRTBackend, check_tree_size, tensorrt_available

REPO = Path(__file__).resolve().parents[1]
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
HAS_TENSORRT_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript", "onnxruntime"))
HAS_HEAD = (SMALL_HEAD_DIR / "model.safetensors").is_file()
needs_export = pytest.mark.skipif(
    not (HAS_ONNX and HAS_HEAD),
    reason="exporting needs onnx/onnxscript/onnxruntime (pip install -e '.[export]') and the shipped toy head",
)


def export_portable_engine(out: Path) -> Path:
    """The `portable` engine directory of the shipped toy target + head (about a minute on one core)."""
    from export.onnx_export import ExportSettings, export_engine

    return export_engine(
        ExportSettings(head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=out, variant="portable")
    )


@pytest.fixture(scope="session")
def portable_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Exported once per session and shared (read-only: copy it before building engines into it)."""
    if not (HAS_ONNX and HAS_HEAD):
        pytest.skip("exporting needs the [export] extra and the shipped toy head")
    return export_portable_engine(tmp_path_factory.mktemp("trt") / "portable")


# ---------------------------------------------------------------------------------------------------
# (a) bad input, on machines without TensorRT
# ---------------------------------------------------------------------------------------------------


def _export_cli(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "engine"
    cmd = [
        sys.executable,
        "-m",
        "export.cli",
        "--head",
        str(SMALL_HEAD_DIR),
        "--target",
        str(SMALL_TARGET_DIR),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--quiet", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, out


def _nothing_written(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


needs_export_cli = pytest.mark.skipif(
    not HAS_ONNX, reason="jetflow-export imports the ONNX exporter first: needs the [export] extra"
)


@needs_export_cli
@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is importable here: the no-TensorRT error cannot occur")
def test_engine_without_tensorrt_is_one_error_line_and_writes_nothing(tmp_path):
    proc, out = _export_cli(tmp_path, "--engine")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {NO_TENSORRT}"], proc.stderr
    assert _nothing_written(out)


@needs_export_cli
@pytest.mark.parametrize("variant", ["plugin", "portable"])
def test_missing_plugin_library_is_one_error_line_and_writes_nothing(tmp_path, variant):
    if variant == "portable" and HAS_TENSORRT:
        pytest.skip("the CLI may drop --plugin-lib for the portable variant, which then exports and builds")
    missing = tmp_path / "nope" / "libjetflow_trt_plugins.so"
    proc, out = _export_cli(tmp_path, "--engine", "--variant", variant, "--plugin-lib", str(missing))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    if variant == "plugin":
        assert str(missing) in lines[0] and "does not exist" in lines[0]
    assert _nothing_written(out)


def test_plugin_library_checks(tmp_path, monkeypatch):
    missing = tmp_path / "missing.so"
    with pytest.raises(UserInputError, match="does not exist"):
        resolve_plugin_lib(missing, "portable")  # an explicit path is checked whatever the variant
    monkeypatch.setenv(PLUGIN_LIB_ENV, str(missing))
    with pytest.raises(UserInputError, match="plugin variant needs the TreeAttention plugin library"):
        resolve_plugin_lib(None, "plugin")
    assert resolve_plugin_lib(None, "portable") is None
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setenv(PLUGIN_LIB_ENV, str(lib))
    assert resolve_plugin_lib(None, "plugin") == lib.resolve()
    assert resolve_plugin_lib(lib, "plugin") == lib.resolve()


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is importable here")
def test_require_tensorrt_and_backend_say_what_is_missing(tmp_path):
    with pytest.raises(UserInputError) as err:
        require_tensorrt(None, variant="portable")
    assert str(err.value) == NO_TENSORRT
    with pytest.raises(UserInputError, match="does not exist"):  # a typo is reported before TensorRT
        require_tensorrt(tmp_path / "missing.so", variant="plugin")
    with pytest.raises(UserInputError) as err:
        require_tensorrt(None, variant="plugin")
    assert str(err.value) == NO_TENSORRT
    with pytest.raises(ImportError, match="TensorRTBackend needs TensorRT"):
        TensorRTBackend(tmp_path)
    assert "not importable" in (tensorrt_available() or "")


def test_tree_larger_than_the_profile_is_refused_naming_both_sizes():
    check_tree_size(256, 256)
    with pytest.raises(ValueError, match=r"257 nodes.*at most 256"):
        check_tree_size(257, 256)


def _config(block_size: int = 16) -> dict:
    return {
        "block_size": block_size,
        "target": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64},
        "head": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 64, "tap_features": 768},
    }


def test_profile_shapes_follow_the_contract():
    limits = ProfileLimits.make(max_tree=100, max_context=1024)
    target = profile_shapes("target", _config(), limits)
    head = profile_shapes("head", _config(), limits)
    assert set(target) == set(TARGET_INPUTS) and set(head) == set(HEAD_INPUTS)
    assert target["input_ids"] == ((1, 1), (1, 64), (1, 100))
    assert target["tree_mask"] == ((1, 1), (64, 2), (100, 4))  # ceil(N / 32) words
    assert target["past_keys"] == ((4, 1, 2, 0, 64), (4, 1, 2, 512, 64), (4, 1, 2, 1024, 64))
    assert head["context_taps"][2] == (1, 1024, 768)  # the whole prompt after the prefill
    assert head["block_ids"][1] == (1, 16)  # tuned for the draft block
    # a block wider than the tree limit still fits the head profile
    assert profile_shapes("head", _config(block_size=128), limits)["block_ids"][2] == (1, 128)
    with pytest.raises(UserInputError, match="max_tree"):
        ProfileLimits.make(max_tree=0, max_context=16)


# ---------------------------------------------------------------------------------------------------
# the backend's bookkeeping (buffers, ping-pong caches, compaction, chunked prefill) on a CPU
# ---------------------------------------------------------------------------------------------------


class OrtStandInEngine:
    """Plays a TensorRT engine for `TensorRTBackend`: same profile limits as a real build, same binding
    rules (shapes inside the profile, dense inputs, outputs sized exactly, no input/output aliasing),
    computed by ONNX Runtime on the graph the engine would be built from."""

    _TYPES = {"tensor(float)": torch.float32, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32}

    def __init__(self, path: Path, shapes: dict) -> None:
        from jetflow_pl.runtime.ort_session import make_session

        self.session = make_session(path, intra_op_threads=1)
        self.shapes = shapes
        self.types = {v.name: self._TYPES[v.type] for v in self.session.get_inputs()}
        self.types.update({v.name: self._TYPES[v.type] for v in self.session.get_outputs()})
        self.outputs = [v.name for v in self.session.get_outputs()]
        self.calls: list[dict[str, tuple[int, ...]]] = []

    def dtype(self, name: str) -> torch.dtype:
        return self.types[name]

    def max_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name][2]

    def run(self, feeds: dict, outs: dict, stream) -> None:
        spans = []
        for name, (lo, _opt, hi) in self.shapes.items():
            t = feeds[name]
            shape = tuple(t.shape)
            assert all(a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True)), (name, shape, hi)
            assert t.is_contiguous() and t.dtype == self.types[name], name
            spans.append((name, t))
        for name in self.outputs:
            assert outs[name].is_contiguous() and outs[name].dtype == self.types[name], name
            spans.append((name, outs[name]))
        for name, t in spans:
            # bound at the start of its own allocation (CUDA allocations are 256-byte aligned; a view
            # into the middle of a buffer need not be, and TensorRT's kernels expect aligned tensors)
            assert t.storage_offset() == 0, f"{name} is bound at an offset into its buffer"
        for i, (a, ta) in enumerate(spans):  # TensorRT would corrupt aliased bindings silently
            for b, tb in spans[i + 1 :]:
                if ta.numel() and tb.numel():
                    a0, b0 = ta.data_ptr(), tb.data_ptr()
                    a1, b1 = a0 + ta.numel() * ta.element_size(), b0 + tb.numel() * tb.element_size()
                    assert a1 <= b0 or b1 <= a0, f"{a} and {b} share memory"
        self.calls.append({n: tuple(feeds[n].shape) for n in self.shapes})
        results = self.session.run(None, {n: feeds[n].numpy() for n in self.shapes})
        for name, value in zip(self.outputs, results, strict=True):
            assert tuple(value.shape) == tuple(outs[name].shape), name
            outs[name].copy_(torch.from_numpy(value))


def stand_in_backend(engine_dir: Path, max_tree: int, max_context: int | None = None) -> TensorRTBackend:
    from jetflow_pl.runtime.engine_config import load_engine_config

    config = load_engine_config(engine_dir)
    limits = ProfileLimits.make(max_tree, max_context or int(config["max_positions"]))
    target = OrtStandInEngine(engine_dir / TARGET_GRAPH, profile_shapes("target", config, limits))
    head = OrtStandInEngine(engine_dir / HEAD_GRAPH, profile_shapes("head", config, limits))
    return TensorRTBackend._from_engines(engine_dir, target, head, "cpu")


@pytest.fixture(scope="module")
def parity_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from data_gen.toy import heldout_prompts
    from data_gen.toy.tokenizer import prompt_ids

    tok = AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)
    return [prompt_ids(tok, r["prompt"]) for r in heldout_prompts("math", 6)]


@needs_export
def test_backend_bookkeeping_matches_onnxruntime_backend(portable_engine_dir, parity_prompts):
    """Same graphs, same decode loop: only the backend's buffers, caches and prefill chunking differ."""
    from jetflow_pl.decoding.generator import SpeculativeGenerator
    from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend

    reference = OnnxRuntimeBackend(portable_engine_dir, intra_op_threads=1)
    # max_tree 40: prompts longer than 40 tokens are prefilled in chunks; budget 32 trees fit
    backend = stand_in_backend(portable_engine_dir, max_tree=40)
    assert backend.max_tree_nodes == 40 and backend.max_positions == reference.max_positions
    assert max(len(p) for p in parity_prompts) > 40, "the prompts should exercise chunked prefill"
    taus = []
    for prompt in parity_prompts:
        want = SpeculativeGenerator(reference, budget=32, width=4, eos_token_id=1).generate(prompt, 40)
        got = SpeculativeGenerator(backend, budget=32, width=4, eos_token_id=1).generate(prompt, 40)
        assert got.tokens == want.tokens
        assert got.accept_lengths == want.accept_lengths
        taus.append(got.tau)
    assert sum(taus) / len(taus) > 2.0  # speculation really happened (accepted rows were compacted)
    prefill_rows = [c["input_ids"][1] for c in backend._target.calls if c["past_keys"][3] == 0]
    assert prefill_rows and max(prefill_rows) == 40


@needs_export
def test_backend_drafts_a_cut_block_into_its_preallocated_buffers(portable_engine_dir, parity_prompts):
    """At budget 2 a causal head drafts 3 block rows, not the whole block: the backend must hand the engine
    output views of that shape (the stand-in checks every output's shape against its buffer, as TensorRT
    does) and decode exactly as ONNX Runtime does."""
    from jetflow_pl.decoding.generator import SpeculativeGenerator
    from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend

    reference = OnnxRuntimeBackend(portable_engine_dir, intra_op_threads=1)
    backend = stand_in_backend(portable_engine_dir, max_tree=40)
    assert backend.causal_head and backend.block_rows(2) == 3 < backend.block_size
    for prompt in parity_prompts[:2]:
        want = SpeculativeGenerator(reference, budget=2, width=4, eos_token_id=1).generate(prompt, 24)
        got = SpeculativeGenerator(backend, budget=2, width=4, eos_token_id=1).generate(prompt, 24)
        assert got.tokens == want.tokens and got.accept_lengths == want.accept_lengths
    blocks = [c["block_ids"][1] for c in backend._head.calls]
    assert blocks and set(blocks) == {3}


@needs_export
def test_backend_refuses_a_tree_larger_than_the_profile(portable_engine_dir):
    from jetflow_pl.decoding.generator import SpeculativeGenerator
    from jetflow_pl.tree import DraftTree

    backend = stand_in_backend(portable_engine_dir, max_tree=8)
    backend.prefill(torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match=r"9 nodes.*at most 8"):
        backend.verify(DraftTree.chain(list(range(9))))
    # the decode loop reads the same limit up front
    with pytest.raises(UserInputError, match="limit of 7 draft tokens"):
        SpeculativeGenerator(backend, budget=8, width=4)


# ---------------------------------------------------------------------------------------------------
# (b) op-coverage lint: the portable graphs parse and build with tensorrt-rtx (CPU builder)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not HAS_TENSORRT_RTX, reason="tensorrt-rtx is not installed (pip install tensorrt-rtx): lint skipped"
)
@pytest.mark.parametrize("role", ["target", "head"])
def test_portable_graph_parses_and_builds_with_tensorrt_rtx(portable_engine_dir, role):
    import tensorrt_rtx

    from export.tensorrt_build import build_serialized_engine
    from jetflow_pl.runtime.engine_config import load_engine_config

    config = load_engine_config(portable_engine_dir)
    limits = ProfileLimits.make(max_tree=64, max_context=int(config["max_positions"]))
    graph = portable_engine_dir / config["graphs"][role]["file"]
    # EngineBuildError lists every parser error (unsupported ops) if the graph does not parse; no timing
    # cache: tensorrt-rtx needs a CUDA driver to (de)serialize one
    engine = build_serialized_engine(tensorrt_rtx, graph, profile_shapes(role, config, limits), "fp32")
    assert len(engine) > 1000


# ---------------------------------------------------------------------------------------------------
# (c) real TensorRT on a GPU: `pytest -m tensorrt`
# ---------------------------------------------------------------------------------------------------


def _skip_without_tensorrt_gpu() -> None:
    reason = tensorrt_available()
    if reason:
        pytest.skip(f"needs TensorRT and a CUDA GPU: {reason}")


@pytest.fixture(scope="module")
def torch_results(parity_prompts) -> dict[int, list]:
    from jetflow_pl.decoding.generator import SpeculativeGenerator
    from jetflow_pl.head import DraftHead
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval()
    backend = TorchBackend(TargetModel.from_pretrained(SMALL_TARGET_DIR, head.config.target_layer_ids), head)
    return {
        b: [
            SpeculativeGenerator(backend, budget=b, width=4, eos_token_id=1).generate(p, 40)
            for p in parity_prompts
        ]
        for b in (16, 64)
    }


@pytest.fixture(scope="module")
def built_engines(portable_engine_dir, tmp_path_factory) -> dict[str, Path]:
    """fp32 engines of both variants (the plugin one only where the plugin library is built)."""
    _skip_without_tensorrt_gpu()
    from export.onnx_export import ExportSettings, export_engine
    from export.tensorrt_build import build_engines, default_plugin_lib

    root = tmp_path_factory.mktemp("trt_engines")
    out = {"portable": Path(shutil.copytree(portable_engine_dir, root / "portable"))}
    build_engines(out["portable"], precision="fp32", max_tree=128)
    if default_plugin_lib().is_file():
        out["plugin"] = export_engine(
            ExportSettings(
                head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=root / "plugin", variant="plugin"
            )
        )
        build_engines(out["plugin"], plugin_lib=default_plugin_lib(), precision="fp32", max_tree=128)
    return out


@pytest.mark.tensorrt
@pytest.mark.parametrize("variant", ["portable", "plugin"])
@pytest.mark.parametrize("budget", [16, 64])
def test_tensorrt_decoding_matches_torch_tokens_and_accept_lengths(
    built_engines, parity_prompts, torch_results, variant, budget
):
    from jetflow_pl.decoding.generator import SpeculativeGenerator

    if variant not in built_engines:
        pytest.skip("the TreeAttention plugin library is not built (trt_plugins/README.md, 'Build')")
    backend = TensorRTBackend(built_engines[variant])
    assert backend.max_tree_nodes == 128
    gen = SpeculativeGenerator(backend, budget=budget, width=4, eos_token_id=1)
    for prompt, want in zip(parity_prompts, torch_results[budget], strict=True):
        got = gen.generate(prompt, 40)
        assert got.tokens == want.tokens
        assert got.accept_lengths == want.accept_lengths


@pytest.mark.tensorrt
def test_tensorrt_engine_refuses_a_tree_larger_than_its_profile(built_engines):
    from jetflow_pl.tree import DraftTree

    backend = TensorRTBackend(built_engines["portable"])
    backend.prefill(torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match=r"129 nodes.*at most 128"):
        backend.verify(DraftTree.chain(list(range(129))))


@pytest.mark.tensorrt
def test_tensorrt_fp16_engines_build_and_decode(portable_engine_dir, tmp_path, parity_prompts):
    _skip_without_tensorrt_gpu()
    from export.tensorrt_build import build_engines
    from jetflow_pl.decoding.generator import SpeculativeGenerator
    from jetflow_pl.runtime.engine_config import load_engine_config

    engine_dir = Path(shutil.copytree(portable_engine_dir, tmp_path / "fp16"))
    block = build_engines(engine_dir, precision="fp16", max_tree=64)
    config = load_engine_config(engine_dir)
    assert config["tensorrt"] == block and block["precision"] == "fp16" and block["max_tree"] == 64
    result = SpeculativeGenerator(TensorRTBackend(engine_dir), budget=32, width=4).generate(
        parity_prompts[0], 40
    )
    assert len(result.tokens) == 40 and result.tau > 1.5
