"""The batched `jetflow::tree_attention` contract: per-request masks `[B, N, W]` and prefix lengths.

The ground truth of a batch is the batch-1 op run on each request alone (its own tree, its own valid
prefix): batching must not change a single valid row. Padding (prefix rows past a request's length, rows
past its generation length) is checked to be invisible (NaN planted there never leaks) and to give finite
outputs, with the contents the contract names. Exports of a tiny module in the portable, `attention` and
plugin forms are compared with eager torch on ONNX Runtime, at a batch shape other than the traced one.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from jetflow_pl.masks import pack_mask, pack_tree_batch
from jetflow_pl.ops.tree_attention import (
    tree_attention,
    tree_attention_grouped,
    tree_attention_reference,
    tree_attention_via_masked_attention,
)
from jetflow_pl.runtime.contract import (
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TREE_ATTENTION_DOMAIN,
    TREE_ATTENTION_OP,
)
from jetflow_pl.runtime.ort_session import make_session, session_from_model
from jetflow_pl.tree import DraftTree

# Outputs are convex combinations of N(0, 1) values (|out| < ~4); two fp32 evaluations of the same
# softmax over <= ~600 keys that differ only in summation order (batched vs one request) differ by a few
# ulps of the largest terms: 1e-5 absolute is ~100 ulps of 4, and any masking bug is an O(0.1-1) error.
ATOL = 1e-5


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    """A random tree of `n` nodes, parent-before-child, each parent drawn uniformly from earlier nodes."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents))


def deep_tree(n: int, gen: torch.Generator) -> DraftTree:
    """Nodes 0..31 a chain, every later node a descendant of node 31: those rows have bit 31 of word 0 set
    (negative int32 words) and masks spanning several words."""
    parents = [i - 1 for i in range(min(n, 32))]
    parents += [int(torch.randint(31, i, (1,), generator=gen)) for i in range(32, n)]
    return DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents))


def make_batch(sizes, past_lengths, hq, hkv, d, seed, num_nodes=None, pad_past=3):
    """Inputs of one batched call; prefix padding rows are NaN (they must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(n, gen) if n < 40 else deep_tree(n, gen) for n in sizes]
    masks = pack_tree_batch(trees, num_nodes)
    b, n = masks.batch_size, masks.num_nodes
    p = max(past_lengths) + pad_past
    q = torch.randn(b, hq, n, d, generator=gen)
    pk, pv = torch.randn(2, b, hkv, p, d, generator=gen)
    k, v = torch.randn(2, b, hkv, n, d, generator=gen)
    for i, length in enumerate(past_lengths):
        pk[i, :, length:] = float("nan")
        pv[i, :, length:] = float("nan")
    lengths = torch.tensor(past_lengths, dtype=torch.int32)
    return (q, pk, pv, k, v, masks.packed_mask, d**-0.5, lengths), trees, masks


def per_request(op, args, trees):
    """The batch-1 op on request b alone: its own rows, its own valid prefix, its own [n_b, W_b] mask."""
    q, pk, pv, k, v, _, scale, lengths = args
    outs = []
    for i, tree in enumerate(trees):
        n, p = tree.num_nodes, int(lengths[i])
        outs.append(
            op(
                q[i : i + 1, :, :n],
                pk[i : i + 1, :, :p],
                pv[i : i + 1, :, :p],
                k[i : i + 1, :, :n],
                v[i : i + 1, :, :n],
                tree.packed_mask(),
                scale,
            )
        )
    return outs


def prefix_only(q, pk, pv, scale):
    """What a padding row holds: attention over the request's valid prefix alone (GQA by repetition)."""
    group = q.shape[1] // pk.shape[1]
    keys, vals = pk.repeat_interleave(group, 1), pv.repeat_interleave(group, 1)
    return torch.softmax(q @ keys.transpose(-1, -2) * scale, dim=-1) @ vals


# (tree sizes per request, past lengths per request, Hq, Hkv, padded N or None)
CASES = [
    ([5, 1, 12], [4, 0, 9], 4, 2, None),  # GQA 2, a request with no prefix and a lone root
    ([33, 7], [0, 20], 2, 2, None),  # two words for one request, one for the other
    ([256, 70, 3, 129], [11, 0, 5, 30], 6, 2, None),  # N = 256 (8 words), bit 31 set, GQA 3
    ([9, 9], [3, 3], 4, 1, 64),  # padded to a fixed engine shape N = 64, MQA
]


PYTHON_FORMS = [
    tree_attention,
    tree_attention_reference,
    tree_attention_grouped,
    tree_attention_via_masked_attention,
]


@pytest.mark.parametrize("op", PYTHON_FORMS)
@pytest.mark.parametrize(("sizes", "past", "hq", "hkv", "num_nodes"), CASES)
def test_batched_op_equals_the_batch1_op_per_request(op, sizes, past, hq, hkv, num_nodes):
    args, trees, masks = make_batch(sizes, past, hq, hkv, 16, seed=sum(sizes), num_nodes=num_nodes)
    if max(sizes) >= 40:
        assert (masks.packed_mask[:, :, 0] < 0).any(), "the case must exercise bit 31 (negative words)"
    out = op(*args)
    assert out.shape == args[0].shape
    assert torch.isfinite(out).all(), "NaN in padding prefix rows leaked, or a padding row is not finite"
    for i, want in enumerate(per_request(tree_attention, args, trees)):
        n = trees[i].num_nodes
        torch.testing.assert_close(out[i : i + 1, :, :n], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("op", [tree_attention, tree_attention_grouped])
def test_padding_rows_see_only_their_requests_prefix_or_nothing(op):
    """Rows past a request's generation length: prefix-only attention; exactly 0 without a prefix."""
    args, trees, _ = make_batch([3, 10, 6], [5, 0, 8], 4, 2, 16, seed=4, num_nodes=12)
    q, pk, pv = args[:3]
    out = op(*args)
    for i, tree in enumerate(trees):
        n, p = tree.num_nodes, int(args[7][i])
        pad = out[i : i + 1, :, n:]
        if p == 0:
            assert torch.equal(pad, torch.zeros_like(pad))
        else:
            want = prefix_only(q[i : i + 1, :, n:], pk[i : i + 1, :, :p], pv[i : i + 1, :, :p], args[6])
            torch.testing.assert_close(pad, want, atol=ATOL, rtol=0)


def test_past_lengths_really_hide_rows():
    """Changing a padding prefix row changes nothing; shortening a length changes the request's rows."""
    args, _, _ = make_batch([6, 6], [7, 4], 2, 2, 16, seed=9)
    q, pk, pv, k, v, mask, scale, lengths = args
    pk, pv = pk.nan_to_num(0.0), pv.nan_to_num(0.0)
    base = tree_attention(q, pk, pv, k, v, mask, scale, lengths)
    pk2 = pk.clone()
    pk2[1, :, 4:] += 100.0  # request 1's padding rows
    assert torch.equal(tree_attention(q, pk2, pv, k, v, mask, scale, lengths), base)
    shorter = torch.tensor([6, 4], dtype=torch.int32)
    moved = tree_attention(q, pk, pv, k, v, mask, scale, shorter)
    assert not torch.allclose(moved[0], base[0], atol=1e-3)  # request 0 lost its last prefix row
    assert torch.equal(moved[1], base[1])  # request 1 untouched


@pytest.mark.parametrize("op", [tree_attention, tree_attention_grouped])
def test_batch1_forms_agree_and_lengths_are_clamped(op):
    """A shared [N, W] mask == the same mask per request; past_lengths == P == None; > P clamps to P."""
    args, _, _ = make_batch([20, 20, 20], [6, 6, 6], 4, 2, 16, seed=2, pad_past=0)
    q, pk, pv, k, v, mask, scale, lengths = args
    shared = mask[0]
    mask = shared.expand(3, *shared.shape).contiguous()
    want = tree_attention(q, pk, pv, k, v, shared, scale)  # the batch-1 signature, unchanged
    for m in (shared, mask):
        for pl in (None, lengths, lengths + 100):
            torch.testing.assert_close(op(q, pk, pv, k, v, m, scale, pl), want, atol=ATOL, rtol=0)
    none = op(q, pk, pv, k, v, shared, scale, torch.full((3,), -5, dtype=torch.int32))
    want_none = tree_attention(q, pk[:, :, :0], pv[:, :, :0], k, v, shared, scale)
    torch.testing.assert_close(none, want_none, atol=ATOL, rtol=0)


def test_a_row_that_sees_nothing_is_zero_in_every_python_form():
    """P = 0 (or past_lengths 0) and an empty mask row: 0 in eager and in the `attention` decomposition."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.eye(8, dtype=torch.bool)
    dense[3] = False
    q, k, v = torch.randn(3, 1, 2, 8, 16, generator=gen)
    pk = torch.randn(1, 2, 4, 16, generator=gen)
    for op in (tree_attention, tree_attention_grouped, tree_attention_via_masked_attention):
        for lengths in (torch.zeros(1, dtype=torch.int32), None):
            p = 4 if lengths is not None else 0  # without lengths every prefix row is visible
            out = op(q, pk[:, :, :p], pk[:, :, :p], k, v, pack_mask(dense), 0.25, lengths)
            assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
            assert torch.isfinite(out).all()


def test_opcheck_with_per_request_masks_and_lengths():
    args, _, _ = make_batch([9, 4], [3, 0], 4, 2, 16, seed=5)
    q, pk, pv, k, v, mask, scale, lengths = args
    pk, pv = pk.nan_to_num(0.0), pv.nan_to_num(0.0)  # opcheck compares outputs with NaN != NaN
    torch.library.opcheck(torch.ops.jetflow.tree_attention.default, (q, pk, pv, k, v, mask, scale, lengths))
    torch.library.opcheck(torch.ops.jetflow.tree_attention.default, (q, pk, pv, k, v, mask[0], scale))


def test_bad_batched_arguments_are_refused():
    args, _, _ = make_batch([4, 4], [2, 2], 2, 2, 16, seed=1)
    q, pk, pv, k, v, mask, scale, lengths = args
    with pytest.raises(ValueError, match="past_lengths must be int32"):
        tree_attention_reference(q, pk, pv, k, v, mask, scale, lengths.long())
    with pytest.raises(ValueError, match=r"past_lengths must be \[B=2\]"):
        tree_attention_reference(q, pk, pv, k, v, mask, scale, lengths[:1])
    with pytest.raises(ValueError, match="batch is 2"):
        tree_attention_reference(q, pk, pv, k, v, mask[:1].expand(3, -1, -1), scale, lengths)
    with pytest.raises(ValueError, match="rows"):
        tree_attention_reference(q, pk, pv, k, v, mask[:, :3], scale, lengths)
    with pytest.raises(ValueError, match=r"\[N, W\] or \[B, N, W\]"):
        tree_attention_reference(q, pk, pv, k, v, mask[None], scale, lengths)


# ------------------------------------------------------------------------------------- ONNX export


class _Attend(torch.nn.Module):
    """A tiny module around one attention call (the graphs' layers call it the same way)."""

    def __init__(self, fn, with_lengths: bool) -> None:
        super().__init__()
        self.fn, self.with_lengths = fn, with_lengths

    def forward(self, query, past_key, past_value, key, value, packed_mask, past_lengths=None):
        extra = (past_lengths,) if self.with_lengths else ()
        return self.fn(query, past_key, past_value, key, value, packed_mask, 0.25, *extra)


def _export(fn, example, path, opset: int, with_lengths: bool) -> onnx.ModelProto:
    from export.tree_attention_onnx import translation_table

    b, n, w = (torch.export.Dim(s, min=1, max=1024) for s in ("B", "N", "W"))
    p = torch.export.Dim("P", min=0, max=1024)
    dims = [{0: b, 2: n}, {0: b, 2: p}, {0: b, 2: p}, {0: b, 2: n}, {0: b, 2: n}, {0: b, 1: n, 2: w}]
    if with_lengths:
        dims.append({0: b})
    program = torch.onnx.export(
        _Attend(fn, with_lengths),
        example,
        dynamo=True,
        opset_version=opset,
        input_names=["query", "past_key", "past_value", "key", "value", "packed_mask", "past_lengths"][
            : len(example)
        ],
        dynamic_shapes=tuple(dims),
        custom_translation_table=translation_table(),
        optimize=True,
        verbose=False,
    )
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    return model


def _plugin_session(model: onnx.ModelProto):
    """ORT session for a plugin-form graph (TreeAttention nodes with 6 or 7 inputs) through the library's
    loader, which serves both node forms as Python ops (`jetflow_pl.runtime.ort_session`)."""
    return session_from_model(onnx.ModelProto.FromString(model.SerializeToString()))


def _feeds(session, args) -> dict:
    return {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}


@pytest.mark.parametrize(
    ("form", "opset"),
    [("portable", 20), ("attention", 23), ("plugin", 20)],
    ids=["portable", "attention", "plugin"],
)
def test_batched_export_matches_eager_on_onnxruntime(form, opset, tmp_path):
    """Traced at B=2, N=12; run at B=3, N=40 (dynamic axes), padding NaN-free on ORT too."""
    import onnxruntime as ort

    fn = {"portable": tree_attention_grouped, "attention": tree_attention_via_masked_attention}.get(
        form, tree_attention
    )
    example, _, _ = make_batch([12, 5], [3, 0], 4, 2, 16, seed=0)
    model = _export(
        fn, tuple(t for t in example if not isinstance(t, float)), tmp_path / "g.onnx", opset, True
    )
    nodes = [n for n in model.graph.node if n.domain == TREE_ATTENTION_DOMAIN]
    if form == "plugin":
        assert len(nodes) == 1 and list(model.graph.node) == nodes
        node = nodes[0]
        assert node.op_type == TREE_ATTENTION_OP and len(node.input) == 7
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_version"].decode() == PLUGIN_VERSION
        assert attrs["plugin_namespace"].decode() == PLUGIN_NAMESPACE
        assert (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_size"]) == (4, 2, 16)
        assert attrs["scale"] == pytest.approx(0.25)
        session = _plugin_session(model)
    else:
        assert nodes == [] and {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        if form == "attention":
            assert sum(n.op_type == "Attention" for n in model.graph.node) == 1
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    args, _, _ = make_batch([40, 7, 33], [9, 0, 20], 4, 2, 16, seed=7)
    inputs = tuple(t for t in args if not isinstance(t, float))
    got = session.run(None, _feeds(session, inputs))[0]
    want = fn(*args)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)


def test_batch1_plugin_export_keeps_six_inputs_and_runs_on_the_library_loader(tmp_path):
    """Without past_lengths the node is the old 6-input one, and per-request masks run through the
    existing onnxruntime-extensions loader unchanged."""
    example, _, _ = make_batch([6, 6], [4, 4], 2, 2, 16, seed=3, pad_past=0)
    inputs = tuple(example[:6])
    model = _export(tree_attention, inputs, tmp_path / "p.onnx", 20, False)
    (node,) = model.graph.node
    assert node.op_type == TREE_ATTENTION_OP and len(node.input) == 6
    session = make_session(tmp_path / "p.onnx")
    args, _, _ = make_batch([10, 3, 8], [5, 5, 5], 2, 2, 16, seed=8, pad_past=0)
    got = session.run(None, _feeds(session, args[:6]))[0]
    np.testing.assert_allclose(got, tree_attention(*args[:7]).numpy(), atol=ATOL, rtol=0)


def test_portable_export_never_copies_the_cache_into_a_bigger_tensor(tmp_path):
    """The portable graphs' attention (`tree_attention_grouped`) reads the KV prefix in place: no cache
    tensor (past K/V, or what layout/elementwise ops make of them) feeds a Concat, Expand or Tile. Those
    copies of the whole cache per layer, not the arithmetic, were most of a 16-request round on ONNX
    Runtime with the reference's form (see the function's docstring); the reference's own export has them,
    which this check confirms, so it can fail."""
    example, _, _ = make_batch([12, 5], [3, 0], 6, 2, 16, seed=0)
    inputs = tuple(t for t in example if not isinstance(t, float))

    def cache_copies(model: onnx.ModelProto) -> list[str]:
        cache = {"past_key", "past_value"}
        passthrough = {"Where", "Cast", "Transpose", "Reshape", "Identity", "Mul", "Unsqueeze"}
        copies = []
        for node in model.graph.node:  # topological order
            if not cache.intersection(node.input):
                continue
            if node.op_type in {"Concat", "Expand", "Tile"}:
                copies.append(node.op_type)
            elif node.op_type in passthrough:
                cache.update(node.output)
        return copies

    grouped = _export(tree_attention_grouped, inputs, tmp_path / "grouped.onnx", 20, True)
    reference = _export(tree_attention_reference, inputs, tmp_path / "reference.onnx", 20, True)
    assert cache_copies(grouped) == []
    assert cache_copies(reference), "the reference form's export concatenates and expands the cache"
