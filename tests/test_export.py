"""Export stage: engine directories, the graph contract, ONNX Runtime parity with the torch backend.

The two engine directories (plugin and portable variants of the shipped toy target + its trained head)
are exported once per module; every test reads them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from transformers import AutoTokenizer

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR, heldout_prompts
from data_gen.toy.tokenizer import prompt_ids
from export.cli import main as export_main
from export.onnx_export import ExportSettings, export_engine
from jetflow_pl.decoding.budget import ACCEPTANCE_PROFILE_FILE, AcceptanceProfile
from jetflow_pl.decoding.generator import ARGenerator, SpeculativeGenerator
from jetflow_pl.head import DraftHead
from jetflow_pl.runtime.contract import (
    CONFIG_FILE,
    DYNAMIC_AXES,
    HEAD_GRAPH,
    HEAD_INPUTS,
    HEAD_OUTPUTS,
    TARGET_GRAPH,
    TARGET_INPUTS,
    TARGET_OUTPUTS,
    TREE_ATTENTION_DOMAIN,
    TREE_ATTENTION_OP,
)
from jetflow_pl.runtime.engine_config import load_engine_config
from jetflow_pl.runtime.graph_backend import TorchGraphBackend
from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
from jetflow_pl.runtime.ort_session import make_session
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree, build_tree

pytestmark = pytest.mark.skipif(
    not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engines")
    # the portable engine is exported from a copy of the head that carries an acceptance prior
    with_prior = root / "head_with_prior"
    shutil.copytree(SMALL_HEAD_DIR, with_prior)
    AcceptanceProfile(budgets=[4, 16], tau=[2.5, 3.5], rounds=[10, 10], width=4).save(
        with_prior / ACCEPTANCE_PROFILE_FILE
    )
    out = {}
    for variant in ("plugin", "portable", "attention"):
        head = with_prior if variant == "portable" else SMALL_HEAD_DIR
        out[variant] = export_engine(
            ExportSettings(head=head, target=SMALL_TARGET_DIR, out=root / variant, variant=variant)
        )
    return out


def test_the_heads_acceptance_prior_travels_with_the_engine(engines, capsys):
    """`--budget auto` on an engine directory starts from the prior the head was saved with."""
    from jetflow_pl.decode_options import acceptance_prior

    assert not (engines["plugin"] / ACCEPTANCE_PROFILE_FILE).exists()  # the head had none
    copied = AcceptanceProfile.load(engines["portable"] / ACCEPTANCE_PROFILE_FILE)
    assert copied.tau == [2.5, 3.5] and copied.width == 4
    args = argparse.Namespace(acceptance_profile=None, head=None, engine_dir=engines["portable"], width=4)
    assert acceptance_prior(args).tau == [2.5, 3.5]
    args.width = 2  # measured at width 4: found, not given, so ignored with a note
    assert acceptance_prior(args) is None
    assert "measured at --width 4" in capsys.readouterr().err


def test_an_engine_directory_alone_is_enough_to_generate(engines, pair, capsys):
    """`generate --engine-dir DIR` with no --target and no --head: the engine holds graphs, config and
    tokenizer (issue 46: it used to ask for --head). Its output is the target's own greedy output."""
    from jetflow_pl.chat import encode_prompt
    from jetflow_pl.generate_cli import main as generate_main

    prompt = heldout_prompts("math", 1)[0]["prompt"]
    argv = ["--engine-dir", str(engines["portable"]), "--prompt", prompt, "--budget", "16"]
    assert generate_main([*argv, "--max-new-tokens", "12", "--compare", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "vs AR" in out and "identical to AR: True" in out and "HF generate" not in out
    # the text is the target's greedy continuation (torch, in process)
    head, target = pair
    tok = AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)
    ids = encode_prompt(tok, prompt, chat=True)  # what generate feeds the engine
    ref = ARGenerator(TorchBackend(target), eos_token_id=tok.eos_token_id).generate(ids, 12).tokens
    assert tok.decode(ref, skip_special_tokens=True) in out
    # a --head without --target is refused in one line (the engine carries its own head graph)
    assert generate_main([*argv, "--head", str(SMALL_HEAD_DIR)]) == 2
    assert "--head needs --target" in capsys.readouterr().err
    # a torch backend still needs the target
    assert generate_main(["--backend", "torch", "--prompt", "x"]) == 2
    assert "needs --target" in capsys.readouterr().err


def _no_head_is_made(monkeypatch) -> None:
    """An engine's graphs hold its head: building one (an untrained head needs a mask token, which e.g.
    SmolLM2's tokenizer lacks: issue "--engine-dir alone") is a failure."""
    from jetflow_pl import decode_options

    def refuse(*args, **kwargs):
        raise AssertionError("a head was loaded or made for an engine backend")

    monkeypatch.setattr(decode_options, "load_head_or_untrained", refuse)


def _without_timings(value):
    """A JSON report with every timing (seconds, tokens/s, speedups) left out: what two runs share."""
    if isinstance(value, dict):
        return {
            k: _without_timings(v)
            for k, v in value.items()
            if not any(w in k for w in ("seconds", "per_s", "speedup"))
        }
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def test_an_engine_directory_alone_generates_what_it_does_with_its_target(
    engines, tmp_path, monkeypatch, capsys
):
    """`generate --backend onnxruntime --engine-dir DIR` with neither --target nor --head gives the same
    tokens as with `--target` (the target's tokenizer): the engine's copy tokenizes, applies the chat
    template and stops at EOS alike. No head is made in either run (the issue's `--target` without `--head`
    failed asking for one)."""
    from jetflow_pl.generate_cli import main as generate_main

    _no_head_is_made(monkeypatch)
    max_new = 48
    argv = ["--backend", "onnxruntime", "--engine-dir", str(engines["portable"]), "--budget", "16"]
    argv += ["--max-new-tokens", str(max_new), "--threads", "1"]
    argv += ["--prompt", "Ann has 4 bags with 6 apples each. How many apples?"]
    argv += ["--prompt", heldout_prompts("math", 1)[0]["prompt"]]
    rows = {}
    for name, extra in (("engine", []), ("target", ["--target", str(SMALL_TARGET_DIR)])):
        assert generate_main([*argv, *extra, "--json", str(tmp_path / f"{name}.json")]) == 0
        assert "untrained" not in capsys.readouterr().err
        rows[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert _without_timings(rows["engine"]) == _without_timings(rows["target"])
    assert all(r["output"] for r in rows["engine"])
    assert any(r["new_tokens"] < max_new for r in rows["engine"])  # a decode ended at EOS
    # HF generate() is what --compare needs the target for: without it, AR only, said in one note
    assert generate_main([*argv[:-2], "--max-new-tokens", "4", "--compare"]) == 0  # the first prompt
    captured = capsys.readouterr()
    assert "HF generate() needs --target" in captured.err and "HF generate" not in captured.out


def test_evaluate_on_an_engine_directory_alone_records_what_it_does_with_its_target(
    engines, tmp_path, monkeypatch
):
    """`evaluate --engine-dir DIR` (onnxruntime by default there) with no --target: every turn's prompt
    length (tokenizer, chat template, the second turn built on the first answer), new tokens (EOS) and
    accepted lengths equal those of the same run with `--target`."""
    from jetflow_pl.evaluate_cli import main as evaluate_main

    _no_head_is_made(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"m{i}", "domain": "math", "turns": [r["prompt"], "And twice that?"]}) + "\n"
            for i, r in enumerate(heldout_prompts("math", 2))
        )
    )
    argv = ["--engine-dir", f"ort={engines['portable']}", "--prompts", str(prompts), "--budget", "8"]
    argv += ["--max-new-tokens", "16", "--threads", "1", "--no-plot"]
    results = {}
    for name, extra in (("engine", []), ("target", ["--target", str(SMALL_TARGET_DIR)])):
        assert evaluate_main([*argv, *extra, "--out", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name / "evaluate.json").read_text())
    engine, target = results["engine"], results["target"]
    assert engine["lossless"] and engine["settings"]["backend"] == "onnxruntime"
    assert engine["settings"]["target"] is None and target["settings"]["target"] == str(SMALL_TARGET_DIR)
    assert [r["turn"] for r in engine["records"]] == [1, 2, 1, 2]
    assert _without_timings(engine["records"]) == _without_timings(target["records"])


def test_serve_resolves_an_engine_directory_alone(engines, monkeypatch):
    """`jetflow-serve --engine-dir DIR`: the tokenizer (EOS, chat template) is the engine's copy of the
    target's and the served name the folder's; with `--target` too, the target's tokenizer as before."""
    from jetflow_pl.chat import encode_prompt
    from jetflow_pl.serve.cli import build_parser, load_server_parts

    _no_head_is_made(monkeypatch)
    ref = AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)
    prompt = heldout_prompts("math", 1)[0]["prompt"]
    base = ["--engine-dir", str(engines["portable"]), "--budget", "16", "--threads", "1"]
    for extra in ([], ["--target", str(SMALL_TARGET_DIR)]):
        gen, tokenizer, name = load_server_parts(build_parser().parse_args([*base, *extra]))
        assert name == "portable" and isinstance(gen.backend, OnnxRuntimeBackend)
        assert encode_prompt(tokenizer, prompt, chat=True) == encode_prompt(ref, prompt, chat=True)
        assert gen.eos_ids == {ref.eos_token_id}


def test_an_engine_directory_without_a_tokenizer_asks_for_target_or_a_re_export(
    engines, tmp_path, monkeypatch, capsys
):
    """An older export has no `tokenizer/`: generate, evaluate and serve say in one line to pass --target
    or re-export; with --target it decodes."""
    from jetflow_pl.errors import UserInputError
    from jetflow_pl.evaluate_cli import main as evaluate_main
    from jetflow_pl.generate_cli import main as generate_main
    from jetflow_pl.serve.cli import build_parser, load_server_parts

    old = tmp_path / "old_engine"
    old.mkdir()
    for f in engines["portable"].iterdir():
        if f.name != "tokenizer":
            (old / f.name).symlink_to(f.resolve())
    words = ("carries no tokenizer", "pass --target DIR", "re-export")
    argv = ["--engine-dir", str(old), "--prompt", "hi", "--max-new-tokens", "4", "--budget", "4"]
    assert generate_main(argv) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert all(w in line for w in words), line
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert evaluate_main(["--engine-dir", str(old), "--prompts", str(prompts), "--out", str(tmp_path)]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert all(w in line for w in words), line
    with pytest.raises(UserInputError, match="carries no tokenizer"):
        load_server_parts(build_parser().parse_args(["--engine-dir", str(old)]))
    _no_head_is_made(monkeypatch)
    assert generate_main([*argv, "--target", str(SMALL_TARGET_DIR), "--threads", "1"]) == 0


@pytest.fixture(scope="module")
def pair() -> tuple[DraftHead, TargetModel]:
    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval()
    return head, TargetModel.from_pretrained(SMALL_TARGET_DIR, head.config.target_layer_ids)


def _load(engine_dir: Path, file: str) -> onnx.ModelProto:
    return onnx.load(str(engine_dir / file))


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


# ---------------------------------------------------------------------------------------------------
# graph contract
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("file,layers_key", [(TARGET_GRAPH, "target"), (HEAD_GRAPH, "head")])
def test_plugin_graph_has_one_tree_attention_node_per_layer_with_plugin_attributes(engines, file, layers_key):
    config = load_engine_config(engines["plugin"])
    model = _load(engines["plugin"], file)
    nodes = [n for n in model.graph.node if n.op_type == TREE_ATTENTION_OP]
    assert len(nodes) == config[layers_key]["num_layers"]
    for node in nodes:
        assert node.domain == TREE_ATTENTION_DOMAIN
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_version"] == b"1"
        assert attrs["plugin_namespace"] == b""
        assert attrs["num_heads"] == config[layers_key]["num_heads"]
        assert attrs["num_kv_heads"] == config[layers_key]["num_kv_heads"]
        assert attrs["head_size"] == config[layers_key]["head_dim"]
        assert attrs["scale"] == pytest.approx(config[layers_key]["head_dim"] ** -0.5)
        assert len(node.input) == 6 and len(node.output) == 1
    assert any(o.domain == TREE_ATTENTION_DOMAIN for o in model.opset_import)


@pytest.mark.parametrize("file", [TARGET_GRAPH, HEAD_GRAPH])
def test_portable_graph_uses_only_standard_onnx_ops(engines, file):
    model = _load(engines["portable"], file)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert not any(n.op_type == TREE_ATTENTION_OP for n in model.graph.node)
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("file,layers_key", [(TARGET_GRAPH, "target"), (HEAD_GRAPH, "head")])
def test_attention_variant_has_one_opset23_attention_node_per_layer(engines, file, layers_key):
    config = load_engine_config(engines["attention"])
    model = _load(engines["attention"], file)
    assert config["opset"] == 23
    assert {(o.domain or "ai.onnx"): o.version for o in model.opset_import}["ai.onnx"] == 23
    assert sum(n.op_type == "Attention" for n in model.graph.node) == config[layers_key]["num_layers"]
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("variant", ["plugin", "portable", "attention"])
def test_graph_inputs_outputs_and_dynamic_axes_follow_the_contract(engines, variant):
    config = load_engine_config(engines[variant])
    for role, file, inputs, outputs in (
        ("target", TARGET_GRAPH, TARGET_INPUTS, TARGET_OUTPUTS),
        ("head", HEAD_GRAPH, HEAD_INPUTS, HEAD_OUTPUTS),
    ):
        model = _load(engines[variant], file)
        assert [i.name for i in model.graph.input] == list(inputs) == config["graphs"][role]["inputs"]
        assert [o.name for o in model.graph.output] == list(outputs) == config["graphs"][role]["outputs"]
        graph_inputs = {i.name: i for i in model.graph.input}
        for name, axes in DYNAMIC_AXES[role].items():
            dims = _dims(graph_inputs[name])
            for axis in axes:
                assert isinstance(dims[axis], str), f"{file}:{name} axis {axis} is static ({dims[axis]})"
        # the batch axis is static 1 everywhere it appears first
        assert _dims(graph_inputs["past_keys"])[1] == 1


def test_packed_mask_input_is_int32_rows_by_words(engines):
    model = _load(engines["plugin"], TARGET_GRAPH)
    mask = next(i for i in model.graph.input if i.name == "tree_mask")
    assert mask.type.tensor_type.elem_type == onnx.TensorProto.INT32
    n_sym, w_sym = _dims(mask)
    ids = next(i for i in model.graph.input if i.name == "input_ids")
    assert _dims(ids)[1] == n_sym  # one mask row per tree node
    assert w_sym != n_sym  # words are their own axis (ceil(N/32))


def test_engine_config_describes_the_pair(engines, pair):
    head, target = pair
    config = json.loads((engines["plugin"] / CONFIG_FILE).read_text())
    assert config["block_size"] == head.config.block_size
    assert config["mask_token_id"] == head.config.mask_token_id
    assert config["target_layer_ids"] == list(head.config.target_layer_ids)
    assert config["vocab_size"] == target.vocab_size
    assert config["target"]["num_layers"] == target.num_layers
    assert (engines["plugin"] / "tokenizer" / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(engines["plugin"] / "tokenizer")
    assert len(tok) == len(AutoTokenizer.from_pretrained(SMALL_TARGET_DIR))


# ---------------------------------------------------------------------------------------------------
# numerics: a wide tree (N > 32, bit 31 set) through the verify graph vs the HF target
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["plugin", "portable"])
def test_verify_graph_matches_hf_target_on_a_wide_tree_after_a_prefix(engines, pair, variant):
    _, target = pair
    backend = OnnxRuntimeBackend(engines[variant], intra_op_threads=1)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 2000, (11,), generator=gen)
    backend.prefill(prompt)
    n = 70  # three mask words; node 31 and 63 sit on bit 31
    parents = [-1] + [int(torch.randint(max(0, i - 40), i, (1,), generator=gen)) for i in range(1, n)]
    tree = DraftTree.from_parents(torch.randint(3, 2000, (n,), generator=gen), torch.tensor(parents))
    got = backend.verify(tree)

    from jetflow_pl.runtime.hf_cache import new_cache

    cache = new_cache()
    target(prompt[None], cache=cache, logits_positions=None)
    want = target(
        tree.tokens[None],
        position_ids=tree.position_ids(prompt.numel())[None],
        attention_mask=tree.additive_mask(prompt.numel()),
        cache=cache,
    ).logits[0]
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("role", ["target", "head"])
def test_attention_variant_graphs_parse_and_build_with_tensorrt_rtx(engines, role):
    """Op-coverage lint on TensorRT's CPU-capable flavour for the opset-23 `Attention` graphs (ONNX
    `Attention` becomes TensorRT's IAttention); the portable graphs' lint is in test_tensorrt.py."""
    variant = "attention"
    tensorrt_rtx = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed: lint skipped")
    from export.tensorrt_build import ProfileLimits, build_serialized_engine, profile_shapes

    config = load_engine_config(engines[variant])
    limits = ProfileLimits.make(max_tree=64, max_context=int(config["max_positions"]))
    graph = engines[variant] / config["graphs"][role]["file"]
    engine = build_serialized_engine(tensorrt_rtx, graph, profile_shapes(role, config, limits), "fp32")
    assert len(engine) > 1000


def test_onnxruntime_plugin_loader_leaves_the_file_untouched(engines):
    path = engines["plugin"] / HEAD_GRAPH
    before = path.read_bytes()
    make_session(path, intra_op_threads=1)
    assert path.read_bytes() == before
    assert any(n.domain == TREE_ATTENTION_DOMAIN for n in onnx.load(str(path)).graph.node)


# ---------------------------------------------------------------------------------------------------
# token-exact parity of the decode loop: ONNX Runtime vs torch
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_prompts() -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)
    return [prompt_ids(tok, r["prompt"]) for r in heldout_prompts("math", 20)]


@pytest.fixture(scope="module")
def torch_results(pair, parity_prompts) -> dict[int, list]:
    head, target = pair
    backend = TorchBackend(target, head)
    out = {}
    for budget in (16, 64):
        gen = SpeculativeGenerator(backend, budget=budget, width=4, eos_token_id=1)
        out[budget] = [gen.generate(p, 40) for p in parity_prompts]
    return out


@pytest.mark.parametrize("variant", ["plugin", "portable", "attention"])
@pytest.mark.parametrize("budget", [16, 64])
def test_onnxruntime_decoding_matches_torch_tokens_and_accept_lengths(
    engines, parity_prompts, torch_results, variant, budget
):
    backend = OnnxRuntimeBackend(engines[variant], intra_op_threads=1)
    gen = SpeculativeGenerator(backend, budget=budget, width=4, eos_token_id=1)
    taus = []
    for prompt, want in zip(parity_prompts, torch_results[budget], strict=True):
        got = gen.generate(prompt, 40)
        assert got.tokens == want.tokens
        assert got.accept_lengths == want.accept_lengths
        taus.append(got.tau)
    # a trained head: speculation really happens (guards against a backend that drafts garbage)
    assert sum(taus) / len(taus) > 2.0


def test_torch_graph_backend_matches_the_torch_backend(pair, parity_prompts, torch_results):
    """The decode graphs run eagerly (the op's reference on CPU) decode exactly like TorchBackend."""
    head, target = pair
    gen = SpeculativeGenerator(TorchGraphBackend(target, head), budget=64, width=4, eos_token_id=1)
    for prompt, want in zip(parity_prompts[:10], torch_results[64][:10], strict=True):
        got = gen.generate(prompt, 40)
        assert (got.tokens, got.accept_lengths) == (want.tokens, want.accept_lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the op's Triton kernel)")
def test_torch_graph_backend_on_cuda_uses_the_triton_op_and_matches_cpu(parity_prompts, torch_results):
    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval().cuda()
    target = TargetModel.from_pretrained(SMALL_TARGET_DIR, head.config.target_layer_ids, device="cuda")
    gen = SpeculativeGenerator(TorchGraphBackend(target, head), budget=64, width=4, eos_token_id=1)
    for prompt, want in zip(parity_prompts[:10], torch_results[64][:10], strict=True):
        got = gen.generate(prompt, 40)
        assert got.tokens == want.tokens


def test_topk_bounds_the_tree_width(engines):
    backend = OnnxRuntimeBackend(engines["portable"], intra_op_threads=1)
    with pytest.raises(ValueError, match="top-k"):
        backend.check_width(backend.topk + 1)
    backend.prefill(torch.tensor([5, 6, 7]))
    dense = backend.draft(9)
    assert dense.shape == (backend.block_size - 1, backend.config["vocab_size"])
    assert bool((torch.isfinite(dense).sum(-1) == backend.topk).all())
    tree = build_tree(dense, 9, 64, backend.topk)
    assert tree.budget == 64


# ---------------------------------------------------------------------------------------------------
# bad input: one message, no engine directory (partial or not)
# ---------------------------------------------------------------------------------------------------


def _run_export(tmp_path, capsys, **overrides) -> tuple[int, str, Path]:
    out = overrides.pop("out", tmp_path / "engine")
    args = {"--head": SMALL_HEAD_DIR, "--target": SMALL_TARGET_DIR, "--out": out, **overrides}
    argv = [x for k, v in args.items() for x in ([k] if v is True else [k, str(v)])]
    code = export_main(["--quiet", *argv])
    return code, capsys.readouterr().err, out


def _no_engine_left(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


def test_head_that_does_not_fit_the_target_is_refused(tmp_path, capsys, tiny_target_dir):
    target = tmp_path / "tiny"
    shutil.copytree(tiny_target_dir, target)
    shutil.copy2(SMALL_TARGET_DIR / "tokenizer.json", target / "tokenizer.json")  # only the model misfits
    code, err, out = _run_export(tmp_path, capsys, **{"--target": target})
    assert code == 2
    assert "error: draft head does not fit the target" in err and "target_hidden_size" in err
    assert _no_engine_left(out)


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    fake = tmp_path / "bert"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    code, err, out = _run_export(tmp_path, capsys, **{"--target": fake})
    assert code == 2 and "unsupported target architecture 'bert'" in err
    assert _no_engine_left(out)


def test_existing_output_folder_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err, _ = _run_export(tmp_path, capsys, out=out)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_missing_tokenizer_is_refused(tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(SMALL_TARGET_DIR, target)
    (target / "tokenizer.json").unlink()
    code, err, out = _run_export(tmp_path, capsys, **{"--target": target})
    assert code == 2 and "tokenizer" in err
    assert _no_engine_left(out)


def test_a_failure_during_export_leaves_no_partial_engine_dir(tmp_path, monkeypatch):
    import export.onnx_export as onnx_export

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash after the first graph")

    monkeypatch.setattr(onnx_export, "compare_graph_with_torch", boom)
    out = tmp_path / "engine"
    with pytest.raises(RuntimeError, match="simulated crash"):
        export_engine(
            ExportSettings(head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=out, variant="portable")
        )
    assert _no_engine_left(out)


def test_engine_config_errors_name_the_problem(tmp_path, engines):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_engine_config(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(engines["portable"], broken)
    (broken / HEAD_GRAPH).unlink()
    with pytest.raises(FileNotFoundError, match="head graph"):
        load_engine_config(broken)
    (broken / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_engine_config(broken)


def test_numpy_inputs_of_every_dtype_named_in_the_contract_are_accepted(engines):
    """The ORT session takes exactly the contract's dtypes (int64 ids/positions, int32 mask, float)."""
    session = make_session(engines["portable"] / TARGET_GRAPH, intra_op_threads=1)
    types = {i.name: i.type for i in session.get_inputs()}
    expect = {"int64": "tensor(int64)", "int32": "tensor(int32)", "float": "tensor(float)"}
    for name, (dtype, _) in TARGET_INPUTS.items():
        assert types[name] == expect[dtype]


def test_evaluate_on_the_onnxruntime_engine_is_lossless_against_ort_ar(engines, tmp_path, monkeypatch):
    """`python -m jetflow_pl evaluate --backend onnxruntime`: the engine's head against ORT's own AR on a
    local prompt file, every output identical, `auto` starting from the prior copied into the engine."""
    import json

    from jetflow_pl.evaluate_cli import main as evaluate_main

    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"m{i}", "domain": "math", "prompt": r["prompt"]}) + "\n"
            for i, r in enumerate(heldout_prompts("math", 2))
        )
    )
    out = tmp_path / "eval"
    argv = [
        "--target",
        str(SMALL_TARGET_DIR),
        "--backend",
        "onnxruntime",
        "--engine-dir",
        f"ort={engines['portable']}",
    ]
    argv += ["--prompts", str(prompts), "--budget", "8", "--budget", "auto", "--max-new-tokens", "16"]
    assert evaluate_main([*argv, "--threads", "1", "--no-plot", "--out", str(out)]) == 0
    result = json.loads((out / "evaluate.json").read_text())
    assert result["lossless"] and result["settings"]["backend"] == "onnxruntime"
    (whole,) = [r for r in result["table"] if r["group"] == "all" and r["config"] == "ort@8"]
    assert whole["turns"] == 2 and whole["tau"] > 1.0  # the trained toy head drafts on toy math
    # the ORT backend's own head needs --engine-dir, not --head
    assert (
        evaluate_main(
            [
                "--target",
                str(SMALL_TARGET_DIR),
                "--backend",
                "onnxruntime",
                "--head",
                "x",
                "--prompts",
                str(prompts),
            ]
        )
        == 2
    )
