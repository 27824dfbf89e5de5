"""Gemma 3 (sliding-window layers) as a target: lossless where the window bites, on torch and ONNX Runtime.

The tiny random Gemma 3 (`tiny_targets.py`) has a window of 8 positions, so prompts plus 60 new tokens cross
it many times. Three levels, each with a control that shows the check would catch the window ignored:
the TreeAttention op against the rule written out by hand; one tree verify against transformers' own
forward over every node's path; whole decodes (AR, speculative at several budgets, forced deep acceptance
with KV compaction, a batch of two) against HF `generate()`, on torch and on both exported graph variants.
"""

from __future__ import annotations

import pytest
import torch
from test_decoding import hf_greedy
from tiny_heads import perturbed_head
from tiny_targets import TINY_LAYER_TYPES, TINY_WINDOW, build_tiny_gemma3
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.errors import UserInputError
from jetflow_pl.ops.tree_attention import (
    tree_attention_grouped,
    tree_attention_reference,
    tree_attention_via_masked_attention,
)
from jetflow_pl.runtime.torch_backend import TorchBackend, tree_batch_visibility
from jetflow_pl.target import TargetModel, additive_mask, check_supported, layer_windows
from jetflow_pl.tree import DraftTree, accept_greedy, pack_mask

pytestmark = pytest.mark.usefixtures("one_thread")

MASK_ID = 2  # the toy tokenizer's <|mask|>
NEW_TOKENS = 60


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    target = TargetModel.from_pretrained(gemma_dir)
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (5, 11, 20)]
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]  # no EOS: every decode runs NEW_TOKENS
    return target, hf, prompts, refs


def ignore_windows(monkeypatch) -> None:
    """The negative control: every layer treated as global (what a window-blind verify computes)."""
    monkeypatch.setattr(TargetModel, "windows", property(lambda self: (None,) * self.num_layers))


# --------------------------------------------------------------------------------------------- the rule
def test_layer_windows_per_family():
    gemma = Gemma3TextConfig(num_hidden_layers=4, sliding_window=8, layer_types=list(TINY_LAYER_TYPES))
    assert layer_windows(gemma) == (8, 8, None, 8)
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=16)) == (16, 16, 16)
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=None)) == (None,) * 3
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert layer_windows(qwen2) == (None, None, 32, 32)
    assert layer_windows(Qwen2Config(num_hidden_layers=2)) == (None, None)
    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == (None, None)


def test_unsupported_layer_kinds_and_capping_are_refused_in_one_line():
    chunked = Gemma3TextConfig(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(UserInputError, match="attention layer types \\['chunked_attention'\\]"):
        check_supported(chunked)
    with pytest.raises(UserInputError, match="final_logit_softcapping"):
        check_supported(Gemma3TextConfig(num_hidden_layers=1, final_logit_softcapping=30.0))


def _brute_force(q, pk, pv, k, v, visible_tree, past_lengths, window):
    """The window rule with explicit positions, one request and one head at a time (float64)."""
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(b, hq, n, d, dtype=torch.float64)
    depth = visible_tree.sum(-1) - 1
    for r in range(b):
        past = int(past_lengths[r])
        keys = torch.cat([pk[r, :, :past], k[r]], dim=1).double()
        values = torch.cat([pv[r, :, :past], v[r]], dim=1).double()
        key_pos = torch.cat([torch.arange(past), past + depth[r]])
        for i in range(n):
            seen = torch.cat([torch.ones(past, dtype=torch.bool), visible_tree[r, i]])
            seen &= (past + depth[r, i]) - key_pos < window
            for h in range(hq):
                s = (q[r, h, i].double() @ keys[h // group, seen].T) * d**-0.5
                out[r, h, i] = torch.softmax(s, -1) @ values[h // group, seen]
    return out


@pytest.mark.parametrize(
    "fn", [tree_attention_reference, tree_attention_grouped, tree_attention_via_masked_attention]
)
def test_tree_attention_window_is_the_rule(fn):
    """A batch of two requests with their own trees and KV lengths, window 5: every variant of the op equals
    the rule written out by hand, and differs from it without the window (the control)."""
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, n, p, d, window = 2, 4, 2, 9, 12, 8, 5
    trees = [
        DraftTree.from_parents(torch.arange(n), [-1, 0, 1, 2, 3, 0, 5, 6, 7]),
        DraftTree.from_parents(torch.arange(n), [-1, 0, 0, 1, 2, 4, 5, 6, 6]),
    ]
    dense = torch.stack([t.ancestor_mask() for t in trees])
    packed = torch.stack([pack_mask(t.ancestor_mask()) for t in trees])
    past_lengths = torch.tensor([12, 7], dtype=torch.int32)
    q = torch.randn(b, hq, n, d, generator=gen)
    pk, pv = torch.randn(b, hkv, p, d, generator=gen), torch.randn(b, hkv, p, d, generator=gen)
    k, v = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    want = _brute_force(q, pk, pv, k, v, dense, past_lengths, window)
    got = fn(q, pk, pv, k, v, packed, d**-0.5, past_lengths, window=window)
    # float32 attention over <= 21 keys against float64: a few ulps of the unit-scale outputs
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    blind = fn(q, pk, pv, k, v, packed, d**-0.5, past_lengths)
    assert (blind.double() - want).abs().max() > 1e-2
    # an empty prefix (a first prefill chunk): only the tree rows, still windowed
    empty = torch.zeros(b, dtype=torch.int32)
    got = fn(q, pk[:, :, :0], pv[:, :, :0], k, v, packed, d**-0.5, empty, window=window)
    want0 = _brute_force(q, pk[:, :, :0], pv[:, :, :0], k, v, dense, empty, window)
    torch.testing.assert_close(got.double(), want0, rtol=1e-5, atol=1e-5)
    # batch-1 form (no past_lengths): all P rows visible, the query sits at P + depth
    one = fn(q[:1], pk[:1], pv[:1], k[:1], v[:1], packed[0], d**-0.5, window=window)
    torch.testing.assert_close(one.double(), want[:1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ one tree verify
def _node_logits_vs_hf(target, hf, prompt, tree):
    """Max |verify logits - HF's own forward over the node's whole path| over the tree's nodes."""
    backend = TorchBackend(target)
    backend.prefill(torch.tensor(prompt))
    logits = backend.verify(tree)
    worst = 0.0
    with torch.no_grad():
        for node in range(tree.num_nodes):
            path = tree.path(node)
            ids = torch.tensor([prompt + tree.tokens[path].tolist()])
            ref = hf(ids).logits[0, -1]
            worst = max(worst, float((logits[node] - ref).abs().max()))
    return worst


def test_tree_verify_equals_hf_on_every_node_path(gemma, monkeypatch):
    """A 12-node tree of depth 7 after a 20-token prompt (window 8): each node's logits are the ones
    transformers computes over its own path; ignoring the window moves them far past float error."""
    target, hf, prompts, _ = gemma
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 0, 8, 1, 10]
    tree = DraftTree.from_parents(torch.randint(3, 2000, (12,)), parents)
    # fp32 logits of a 4-layer model computed in two summation orders: ~1e-6 of their unit scale
    assert _node_logits_vs_hf(target, hf, prompts[2], tree) < 1e-4
    ignore_windows(monkeypatch)
    assert _node_logits_vs_hf(target, hf, prompts[2], tree) > 1e-2


def test_batched_tree_visibility_then_window_per_request(gemma):
    """Two requests of different KV lengths in one verify: each row's mask is its own prefix, tree and
    window (positions from its own past length), the sliding mask strictly inside the full one."""
    target, _, _, _ = gemma
    trees = [
        DraftTree.chain(torch.tensor([5, 6, 7])),
        DraftTree.from_parents(torch.tensor([5, 6, 7]), [-1, 0, 0]),
    ]

    class Step:
        num_rows = 3
        past_lengths = torch.tensor([20, 9], dtype=torch.int32)
        positions = torch.tensor([[20, 21, 22], [9, 10, 10]])

    step = Step()
    step.trees = trees
    visible = tree_batch_visibility(step, 20)
    keys = torch.cat([torch.arange(20).expand(2, -1), step.positions], dim=1)
    masks = target.verify_mask(visible, step.positions, keys)
    full = masks["full_attention"][:, 0] == 0
    near = masks["sliding_attention"][:, 0] == 0
    assert torch.equal(full, visible)
    assert torch.equal(near, near & full)
    # request 0, row 2 (position 22) sees prefix rows 15..19 and its chain; request 1, row 1 (position 10)
    # sees prefix rows 3..8, the root and itself
    assert near[0, 2].nonzero().flatten().tolist() == [15, 16, 17, 18, 19, 20, 21, 22]
    assert near[1, 1].nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8, 20, 21]
    assert torch.equal(additive_mask(visible, torch.float32)[:, 0] == 0, full)


# --------------------------------------------------------------------------------------- whole decodes
def _forced_decode(backend, prompt: list[int], ref: list[int], depth: int = 5) -> list[int]:
    """Decode with trees that hold the reference continuation `depth` deep beside decoy branches, so every
    round accepts `depth` nodes and compacts the KV around them (a random head would accept ~nothing)."""
    logits = backend.prefill(torch.tensor(prompt))
    out = [int(logits.argmax())]
    while len(out) < len(ref):
        path = ref[len(out) : len(out) + depth]
        tokens = [out[-1], *path, *[(t + 7) % 1990 + 3 for t in path]]
        parents = [-1, *range(len(path)), *range(len(path))]
        tree = DraftTree.from_parents(torch.tensor(tokens), parents)
        logits = backend.verify(tree)
        accepted, bonus = accept_greedy(tree, logits.argmax(-1))
        backend.commit(accepted)
        out += [int(tokens[i]) for i in accepted[1:]] + [bonus]
    return out[: len(ref)]


def test_torch_decodes_equal_hf_generate(gemma):
    target, _, prompts, refs = gemma
    backend = TorchBackend(target, perturbed_head(target, MASK_ID, block_size=8).eval())
    assert [ARGenerator(backend).generate(p, NEW_TOKENS).tokens for p in prompts] == refs
    for budget in (4, 16, 64):
        gen = SpeculativeGenerator(backend, budget=budget, width=4)
        assert [gen.generate(p, NEW_TOKENS).tokens for p in prompts] == refs, budget
    assert [_forced_decode(backend, p, r) for p, r in zip(prompts, refs, strict=True)] == refs


def test_forced_deep_acceptance_fails_when_the_window_is_ignored(gemma, monkeypatch):
    target, _, prompts, refs = gemma
    ignore_windows(monkeypatch)
    backend = TorchBackend(target)
    assert [_forced_decode(backend, p, r) for p, r in zip(prompts, refs, strict=True)] != refs


def test_left_padded_regeneration_past_the_window_equals_each_prompt_alone(gemma):
    """Regeneration batches prompts left-padded: a row's KV index is its position plus its padding, so a
    window taken over KV indices instead of positions (or a rolling cache under the padding) would change
    what the target writes into the training data. Pads of 0, 9 and 15 rows here, window 8."""
    from data_gen.regenerate.module import batched_generate
    from data_gen.regenerate.prompts import pad_left

    target, _, prompts, refs = gemma
    ids, mask = pad_left(prompts, pad_id=0)  # padded as regeneration pads its batches
    tokens, reasons = batched_generate(target, ids, mask, max_new_tokens=NEW_TOKENS, stop_ids=[])
    assert tokens == refs and reasons == ["length"] * len(prompts)


@pytest.mark.parametrize("kind", ["torch", "batched-graphs", "onnxruntime-batched"])
def test_a_batch_of_two_requests_decodes_each_as_alone(gemma, gemma_dir, tmp_path, kind):
    """Two requests in one verify (different KV lengths, one past the window, one not yet), with 3-deep
    accepted paths: on the torch backend, on the batched decode graphs run eagerly (per-request
    `past_lengths` inside the window rule) and on those graphs exported to ONNX Runtime."""
    target, _, prompts, refs = gemma
    if kind == "torch":
        backend = TorchBackend(target, max_batch=2)
    elif kind == "batched-graphs":
        from jetflow_pl.runtime.graph_backend import TorchGraphBackend

        head = perturbed_head(target, MASK_ID, block_size=8).eval()
        backend = TorchGraphBackend(target, head, variant="portable", max_batch=2)
    else:
        pytest.importorskip("onnxruntime")
        from export.onnx_export import ExportSettings, export_engine
        from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend

        perturbed_head(target, MASK_ID, block_size=8).eval().save_pretrained(tmp_path / "head")
        out = export_engine(
            ExportSettings(head=tmp_path / "head", target=gemma_dir, out=tmp_path / "engine", max_batch=2)
        )
        backend = OnnxRuntimeBackend(out, intra_op_threads=1, max_batch=2)
    slots, outs = [0, 1], [[], []]
    for s, p in zip(slots, (prompts[0], prompts[2]), strict=True):
        outs[s].append(int(backend.prefill(torch.tensor(p), slot=s).argmax()))
    want = [refs[0], refs[2]]
    while min(len(o) for o in outs) < NEW_TOKENS:
        trees = []
        for s in slots:
            path = want[s][len(outs[s]) : len(outs[s]) + 3]
            trees.append(DraftTree.from_parents(torch.tensor([outs[s][-1], *path]), [-1, *range(len(path))]))
        logits = backend.verify_batch(slots, trees)
        accepted = []
        for s, tree, lg in zip(slots, trees, logits, strict=True):
            acc, bonus = accept_greedy(tree, lg.argmax(-1))
            accepted.append(acc)
            outs[s] += [int(tree.tokens[i]) for i in acc[1:]] + [bonus]
        backend.commit_batch(slots, accepted)
    assert [o[:NEW_TOKENS] for o in outs] == want


@pytest.mark.parametrize("variant", ["portable", "plugin", "attention"])
def test_exported_graphs_decode_equal_hf_generate_on_onnx_runtime(gemma, gemma_dir, tmp_path, variant):
    """Export (its parity checks run inside) and decode on ONNX Runtime: AR, speculative, forced deep
    acceptance; the verify graph's TreeAttention nodes carry the window on exactly the local layers."""
    pytest.importorskip("onnxruntime")
    import onnx

    from export.onnx_export import ExportSettings, export_engine
    from jetflow_pl.runtime.contract import TARGET_GRAPH
    from jetflow_pl.runtime.loader import load_backend

    target, _, prompts, refs = gemma
    head_dir = tmp_path / "head"
    perturbed_head(target, MASK_ID, block_size=8).eval().save_pretrained(head_dir)
    out = export_engine(
        ExportSettings(head=head_dir, target=gemma_dir, out=tmp_path / "engine", variant=variant)
    )
    if variant == "plugin":
        nodes = [n for n in onnx.load(str(out / TARGET_GRAPH)).graph.node if n.op_type == "TreeAttention"]
        windows = [next((a.i for a in n.attribute if a.name == "window"), 0) for n in nodes]
        assert windows == [TINY_WINDOW if t == "sliding_attention" else 0 for t in TINY_LAYER_TYPES]
        # the TensorRT plugin's kernel has no window: building engines from these graphs is refused first
        from export.tensorrt_build import build_engines

        with pytest.raises(UserInputError, match="sliding-window layers .* --variant attention"):
            build_engines(out)
    backend = load_backend("onnxruntime", engine_dir=out)
    assert [ARGenerator(backend).generate(p, NEW_TOKENS).tokens for p in prompts] == refs
    gen = SpeculativeGenerator(backend, budget=16, width=4)
    assert [gen.generate(p, NEW_TOKENS).tokens for p in prompts] == refs
    assert [_forced_decode(backend, p, r) for p, r in zip(prompts, refs, strict=True)] == refs


def test_served_concurrently_each_request_equals_hf_generate(gemma, gemma_dir):
    """A real server on 127.0.0.1 (continuous batching over the torch backend): three concurrent
    completions with token-id prompts of different lengths, so each engine step verifies a batch whose
    requests sit at different positions relative to their windows; each answer is HF `generate()`'s."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from transformers import AutoTokenizer

    from jetflow_pl.serve.app import ServeConfig, create_app
    from jetflow_pl.serve.driver import EngineDriver
    from jetflow_pl.serve.runner import ServerThread

    target, _, prompts, refs = gemma
    backend = TorchBackend(target, perturbed_head(target, MASK_ID, block_size=8).eval(), max_batch=4)
    gen = SpeculativeGenerator(backend, budget=16, width=4)
    driver = EngineDriver.for_generator(gen, max_batch=4, max_queue=16, prefill_chunk=8)
    app = create_app(driver, AutoTokenizer.from_pretrained(gemma_dir), ServeConfig("tiny-gemma3", 512))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(prompt: list[int]) -> list[int]:
            choice = client.completions.create(
                model="tiny-gemma3",
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True},
            ).choices[0]
            return list(choice.token_ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
    assert answers == refs


def test_head_init_maps_gemma_norms(gemma):
    """Gemma's RMSNorm scales by `1 + w`, the head's by `w`: a head initialised from the last Gemma layer
    normalizes exactly as the target does (final norm, input norm), and its pre-MLP norm is Gemma's
    `pre_feedforward_layernorm`; the projections are copied as they are."""
    from jetflow_pl.head import DraftHead, DraftHeadConfig
    from jetflow_pl.head.init import init_head_from_target_layers

    target = gemma[0]
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=1, mask_token_id=MASK_ID, target_layer_ids=[2]
    )
    head = DraftHead(cfg)
    copied = init_head_from_target_layers(head, target, [3])
    assert "fc.weight" in copied and cfg.hidden_act == target.config.hidden_activation
    x = torch.randn(3, target.hidden_size) * 40  # Gemma's residual stream is large
    last = target.layers[3]
    with torch.no_grad():
        torch.testing.assert_close(head.norm(x), target.final_norm(x))
        torch.testing.assert_close(head.layers[0].input_layernorm(x), last.input_layernorm(x))
        torch.testing.assert_close(
            head.layers[0].post_attention_layernorm(x), last.pre_feedforward_layernorm(x)
        )
        torch.testing.assert_close(head.hidden_norm(x), last.input_layernorm(x))
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
