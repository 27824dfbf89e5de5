"""Batch > 1 on ONNX Runtime: the batched decode graphs (`jetflow-export --max-batch N`) decode a whole
batch per forward and stay lossless per request.

The engines are the shipped toy target + its trained head exported with batched graphs (portable and
plugin variants, once per module). The ground truth is the same as the torch batching tests
(tests/test_batching.py, whose requests, references and checks this module reuses): every request's greedy
tokens equal the target's own autoregressive tokens for that prompt decoded alone, while requests of
different prompt lengths join (prefilled in chunks between rounds) and leave (EOS or their own
`max_new_tokens`); sampled tokens follow the target's processed distribution (chi-square, slow). The
batched logits are compared with the torch backend's batched logits under the export parity rule
(`export/parity.py`), with different KV lengths, tree sizes and acceptances in one forward.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx
import pytest
import test_batching as torch_batching
import torch
from test_batching import EOS, assert_lossless, check_sampling_is_exact, run_continuous

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR
from export.cli import main as export_main
from export.onnx_export import ExportSettings, export_engine
from export.parity import (
    argmax_tie_violations,
    head_tolerance,
    row_relative_error,
    target_tolerance,
    topk_tie_violations,
)
from jetflow_pl.decoding import SpeculativeGenerator
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.contract import (
    BATCHED_HEAD_INPUTS,
    BATCHED_TARGET_INPUTS,
    HEAD_GRAPH,
    TARGET_GRAPH,
    TREE_ATTENTION_DOMAIN,
    graph_io,
)
from jetflow_pl.runtime.engine_config import load_engine_config
from jetflow_pl.runtime.graph_backend import GraphBackend, TorchGraphBackend
from jetflow_pl.runtime.graphs import pair_config
from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.tree import SCORE_QUANTUM, accept_greedy, build_tree

pytestmark = pytest.mark.skipif(
    not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
)

MAX_BATCH = 4

# the torch batching tests' fixtures, shared so both backends are held to the same requests and references
pair = torch_batching.pair
requests = torch_batching.requests
references = torch_batching.references
spread_prompts = torch_batching.spread_prompts


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    """Batched engines of the toy pair; each export runs the parity rule and the batched decode check."""
    root = tmp_path_factory.mktemp("batched_engines")
    return {
        variant: export_engine(
            ExportSettings(
                head=SMALL_HEAD_DIR,
                target=SMALL_TARGET_DIR,
                out=root / variant,
                variant=variant,
                max_batch=MAX_BATCH,
            )
        )
        for variant in ("portable", "plugin")
    }


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


# ---------------------------------------------------------------------------------------------------
# the engine directory: config, graph contract, the export's own checks
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["portable", "plugin"])
def test_batched_engine_records_its_layout_and_follows_the_batched_contract(engines, variant):
    config = load_engine_config(engines[variant])
    assert config["batched"] is True and config["max_batch"] == MAX_BATCH
    for role, file, inputs in (
        ("target", TARGET_GRAPH, BATCHED_TARGET_INPUTS),
        ("head", HEAD_GRAPH, BATCHED_HEAD_INPUTS),
    ):
        model = onnx.load(str(engines[variant] / file))
        assert [i.name for i in model.graph.input] == list(inputs) == config["graphs"][role]["inputs"]
        assert [o.name for o in model.graph.output] == list(graph_io(role, True)[1])
        graph_inputs = {i.name: i for i in model.graph.input}
        for name, axes in graph_io(role, True)[2].items():
            dims = _dims(graph_inputs[name])
            for axis in axes:
                assert isinstance(dims[axis], str), f"{file}:{name} axis {axis} is static ({dims[axis]})"
        batch = _dims(graph_inputs["past_keys"])[1]
        assert isinstance(batch, str) and _dims(graph_inputs["past_lengths"]) == [batch]
        nodes = [n for n in model.graph.node if n.domain == TREE_ATTENTION_DOMAIN]
        if variant == "plugin":  # one 7-input node per layer: per-request KV lengths reach the op
            assert len(nodes) == config[role]["num_layers"] and all(len(n.input) == 7 for n in nodes)
        else:
            assert nodes == []
    if variant == "plugin":  # the [B, N, W] per-request mask is the verify graph's tree_mask
        mask = {i.name: i for i in onnx.load(str(engines[variant] / TARGET_GRAPH)).graph.input}["tree_mask"]
        assert mask.type.tensor_type.elem_type == onnx.TensorProto.INT32 and len(_dims(mask)) == 3
    # the export decoded a batch of requests through the graphs and matched torch on every token
    decode = config["parity"]["greedy_decode"]
    assert decode["batch"] == 3 and decode["batch_matched"] == decode["batch_tokens"] > 0
    assert all(c["ok"] for g in config["parity"]["graphs"].values() for c in g.values())


def test_engine_config_layout_must_match_its_graphs(engines, tmp_path):
    """A config whose `batched` flag contradicts its graphs' inputs (or asks batch-1 graphs for slots) is
    one clear error at load, not a wrong feed at the first forward."""
    import json
    import shutil

    from jetflow_pl.runtime.contract import CONFIG_FILE

    broken = tmp_path / "broken"
    shutil.copytree(engines["portable"], broken)
    config = json.loads((broken / CONFIG_FILE).read_text())
    (broken / CONFIG_FILE).write_text(json.dumps({**config, "batched": False, "max_batch": 1}))
    with pytest.raises(ValueError, match="not the batch-1 contract"):
        load_engine_config(broken)
    (broken / CONFIG_FILE).write_text(json.dumps({**config, "batched": False, "max_batch": 4}))
    with pytest.raises(ValueError, match="needs batched graphs"):
        load_engine_config(broken)


def test_head_graph_reads_each_requests_own_rows_first():
    """`past ++ new` of a padded batch: request 0 has 2 of P = 2 cached rows and 1 of T = 3 new ones,
    request 1 none cached and 3 new: the attention's view starts with exactly each request's rows."""
    from jetflow_pl.runtime.graphs import own_rows_first

    order = own_rows_first(
        torch.tensor([2, 0], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32), 2, 3
    )
    assert order[0, :3].tolist() == [0, 1, 2] and order[1, :3].tolist() == [2, 3, 4]
    assert bool((order >= 0).all()) and bool((order < 5).all())  # padding indices stay in range


def test_batch1_graphs_refuse_more_than_one_slot(pair):
    head, target = pair
    with pytest.raises(ValueError, match="batched graphs"):
        GraphBackend(pair_config(head, target, 8), max_batch=2)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        GraphBackend({**pair_config(head, target, 8), "batched": True}, max_batch=0)


def test_tensorrt_engines_are_refused_for_batched_graphs(engines, tmp_path, capsys):
    """TensorRT stays batch 1: building engines from batched graphs is one clear error (before TensorRT is
    even imported), and so is asking the CLI for both."""
    from export.tensorrt_build import build_engines

    with pytest.raises(UserInputError, match="batched graphs"):
        build_engines(engines["portable"])
    code = export_main(
        ["--quiet", "--head", str(SMALL_HEAD_DIR), "--target", str(SMALL_TARGET_DIR), "--out",
         str(tmp_path / "e"), "--engine", "--max-batch", "2"]
    )  # fmt: skip
    assert code == 2 and "batch-1 graphs" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


# ---------------------------------------------------------------------------------------------------
# greedy: identical per request, requests joining and leaving between rounds
# ---------------------------------------------------------------------------------------------------


def _continuous(backend, batch: int, budget: int, requests, references) -> None:
    gen = SpeculativeGenerator(backend, budget=budget, width=4, eos_token_id=EOS)
    engine = gen.engine(max_batch=batch, prefill_chunk=16)  # prompts of 20-60 tokens join in chunks
    handles, peak = run_continuous(engine, requests)
    assert_lossless(handles, requests, references)
    assert peak >= min(batch, 4)  # several requests really decoded in one forward
    if budget >= 4:
        taus = [h.result.tau for h in handles]
        assert sum(taus) / len(taus) > 1.5  # a trained head: real multi-token acceptance happened
    # every request's rows were freed as it finished: no slot holds target or head KV
    assert engine.num_active == 0 and sorted(engine._free) == list(range(batch))
    for store in (backend.kv, backend.head_kv):
        assert all(store.group(s).size == 1 and store.length(s) == 0 for s in range(batch))


@pytest.mark.parametrize("budget", [0, 4, 16])
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_ort_batched_greedy_equals_each_request_alone(engines, requests, references, batch, budget):
    backend = OnnxRuntimeBackend(engines["portable"], intra_op_threads=1, max_batch=batch)
    assert backend.max_batch == batch
    _continuous(backend, batch, budget, requests, references)


@pytest.mark.parametrize("budget", [0, 16])
def test_ort_plugin_graphs_batched_greedy_equals_each_request_alone(engines, requests, references, budget):
    """The TreeAttention nodes with per-request lengths (onnxruntime-extensions Python op), batch 3."""
    backend = OnnxRuntimeBackend(engines["plugin"], intra_op_threads=1, max_batch=3)
    _continuous(backend, 3, budget, requests, references)


def test_engine_max_batch_is_the_default_slot_count(engines):
    assert OnnxRuntimeBackend(engines["portable"], intra_op_threads=1).max_batch == MAX_BATCH


def test_torch_graph_backend_runs_the_batched_graphs_eagerly(pair, requests, references):
    head, target = pair
    backend = TorchGraphBackend(target, head, variant="portable", max_batch=3)
    assert backend.batched and backend.max_batch == 3
    _continuous(backend, 3, 16, requests[:6], references[:6])


# ---------------------------------------------------------------------------------------------------
# numerics: ORT batched vs torch batched under the export parity rule
# ---------------------------------------------------------------------------------------------------


def _check_head(ort_rows, torch_rows, k: int, tol: float) -> None:
    """Per request: ORT's top-k (the finite entries of its dense rows) against torch's top-k of its full
    log-probs: values under the float rule, ids exact up to near-ties (`export/parity.py`)."""
    for got, want in zip(ort_rows, torch_rows, strict=True):
        assert bool((torch.isfinite(got).sum(-1) == k).all())
        g_vals, g_ids = got.topk(k, dim=-1)
        w_vals, w_ids = want.topk(k, dim=-1)
        err, row = row_relative_error(g_vals.numpy(), w_vals.numpy())
        assert err <= tol, (err, row, tol)
        violations, _, first = topk_tie_violations(g_ids.numpy(), w_ids.numpy(), w_vals.numpy(), tol)
        assert violations == 0, first


def _check_target(ort_rows, torch_rows, tol: float) -> None:
    """Per request: logits row by row under the float rule (measured against each row's own norm: stricter
    than the rule's lm_head scale, which is at least as large), argmax exact up to near-ties."""
    for got, want in zip(ort_rows, torch_rows, strict=True):
        assert got.shape == want.shape
        err, row = row_relative_error(got.numpy(), want.numpy())
        assert err <= tol, (err, row, tol)
        violations, _, first = argmax_tie_violations(
            got.argmax(-1).numpy(), want.argmax(-1).numpy(), want.numpy(), tol
        )
        assert violations == 0, first


def test_ort_batched_forwards_agree_with_torch_batched_within_the_parity_rule(engines, pair, requests):
    """Three requests of different prompt lengths, trees of different sizes in one verify (budgets 16, 3
    and 9: the backend takes per-request trees), different acceptances, then one request leaves and
    another joins the batch with a fresh prompt: the ORT batched head and verify forwards match torch's
    batched forwards within the parity rule's tolerances at every round."""
    head, target = pair
    tol_t, tol_h = target_tolerance(target), head_tolerance(head)
    ort = OnnxRuntimeBackend(engines["portable"], intra_op_threads=1, max_batch=3)
    ref = TorchBackend(target, head, max_batch=3)
    k = ort.topk
    prompts = [requests[i][0] for i in (0, 1, 5)]
    assert len({len(p) for p in prompts}) == 3
    anchors = {}

    def prefill(slot: int, prompt: list[int]) -> None:
        got, want = ort.prefill(torch.tensor(prompt), slot), ref.prefill(torch.tensor(prompt), slot)
        _check_target([got[None]], [want[None]], tol_t)
        anchors[slot] = int(want.argmax())

    for s, p in enumerate(prompts):
        prefill(s, p)
    budgets = {0: 16, 1: 3, 2: 9}
    for round_ in range(6):
        if round_ == 3:  # request 1 leaves, a new one takes its slot and joins the batch
            ort.release(1)
            ref.release(1)
            assert ort.past_length(1) == 0 and ort.head_kv.length(1) == 0
            prefill(1, requests[7][0])
        slots = [0, 1, 2]
        drafts_ort = ort.draft_batch(slots, [anchors[s] for s in slots])
        drafts_ref = ref.draft_batch(slots, [anchors[s] for s in slots])
        _check_head(drafts_ort, drafts_ref, k, tol_h)
        trees = [
            build_tree(d, anchors[s], budgets[s], 4, score_quantum=SCORE_QUANTUM)
            for s, d in zip(slots, drafts_ref, strict=True)
        ]
        logits_ort, logits_ref = ort.verify_batch(slots, trees), ref.verify_batch(slots, trees)
        _check_target(logits_ort, logits_ref, tol_t)
        accepted = []
        for s, tree, lg in zip(slots, trees, logits_ref, strict=True):
            nodes, bonus = accept_greedy(tree, lg.argmax(-1))
            accepted.append(nodes)
            anchors[s] = int(bonus)
        ort.commit_batch(slots, accepted)
        ref.commit_batch(slots, accepted)
        assert [ort.past_length(s) for s in slots] == [ref.past_length(s) for s in slots]
    lengths = [ort.past_length(s) for s in (0, 1, 2)]
    assert len(set(lengths)) == 3  # the requests really held different KV lengths in one batch


# ---------------------------------------------------------------------------------------------------
# sampling: exact per request on ONNX Runtime (chi-square, as the torch test)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ort_batched_sampling_is_exact_per_request(engines, pair, spread_prompts):
    _, target = pair
    engine_dir = engines["portable"]
    check_sampling_is_exact(
        lambda b: OnnxRuntimeBackend(engine_dir, intra_op_threads=1, max_batch=b),
        target,
        spread_prompts,
        batch=4,
    )


# ---------------------------------------------------------------------------------------------------
# served: a batched engine directory behind jetflow-serve batches its requests
# ---------------------------------------------------------------------------------------------------


def test_batched_engine_is_served_in_batches_and_exact(engines, requests, references):
    """`jetflow-serve --engine-dir` of a batched engine keeps the engine's slots (`--max-batch 8` is
    clamped to its 4, not to 1 as for a batch-1 engine); concurrent greedy requests, sent as token ids,
    each get exactly the target's own tokens."""
    import openai

    from jetflow_pl.serve.cli import build_parser, make_app
    from jetflow_pl.serve.runner import ServerThread

    args = build_parser().parse_args(
        [
            "--engine-dir",
            str(engines["portable"]),
            "--budget",
            "16",
            "--max-batch",
            "8",
            "--served-model-name",
            "m",
        ]
    )
    app = make_app(args)
    assert app.state.driver.engine.max_batch == MAX_BATCH
    jobs = list(zip(requests[:6], references[:6], strict=True))
    with ServerThread(app) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as cl:

            def ask(job) -> list[int]:
                (prompt, max_new), _ = job
                choice = cl.completions.create(
                    model="m",
                    prompt=list(prompt),
                    max_tokens=max_new,
                    temperature=0,
                    extra_body={"return_token_ids": True},
                ).choices[0]
                return choice.token_ids

            with ThreadPoolExecutor(len(jobs)) as pool:
                got = list(pool.map(ask, jobs))
    for ((_, max_new), ref), ids in zip(jobs, got, strict=True):
        assert ids == ref[:max_new]
