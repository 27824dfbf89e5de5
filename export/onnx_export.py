"""Export a (head, target) pair to an engine directory of two ONNX graphs, checked before it is published.

Steps: validate every input (before any work) -> load the frozen target and the head -> export both
graphs with the torch.onnx dynamo exporter into a temporary sibling directory -> `onnx.checker` full
check -> compare ONNX Runtime with the eager torch graphs through polygraphy's runners under the parity
rule of `export/parity.py` (row-wise norm-relative error, exact ids) -> copy the tokenizer, write
`config.json` -> a short greedy decode through the exported graphs on ONNX Runtime must give the torch
backend's tokens -> record the parity report in `config.json` -> rename the temporary directory into place. Any failure removes the
temporary directory, so a half-written engine directory never appears under the requested name.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from export.parity import (
    DECODE_CHECK_TEXT,
    OutputCheck,
    compare_graph_with_torch,
    greedy_decode_check,
    head_tolerance,
    parity_report,
    raise_on_failure,
    target_tolerance,
)
from export.tree_attention_onnx import translation_table
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding.budget import ACCEPTANCE_PROFILE_FILE
from jetflow_pl.errors import UserInputError
from jetflow_pl.head import DraftHead
from jetflow_pl.masks import pack_tree_batch
from jetflow_pl.runtime.contract import (
    CONFIG_FILE,
    HEAD_GRAPH,
    MIN_OPSET,
    TARGET_GRAPH,
    TOKENIZER_DIR,
    VARIANTS,
    graph_io,
)
from jetflow_pl.runtime.engine_config import FORMAT, FORMAT_VERSION, write_engine_config
from jetflow_pl.runtime.graphs import decode_graphs, pair_config
from jetflow_pl.target import TargetModel, check_supported, read_config
from jetflow_pl.tree import DraftTree, pack_mask

log = logging.getLogger(__name__)

#: files copied from the target directory into `<engine>/tokenizer`
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass
class ExportSettings:
    """What `jetflow-export` was asked to do."""

    head: Path
    target: Path
    out: Path
    variant: str = "portable"  # standard ops: the fast path on ONNX Runtime (plugin: for TensorRT)
    opset: int | None = None  # None: 20, or 23 for the `attention` variant
    topk: int = 8
    overwrite: bool = False
    max_batch: int = 1  # > 1: the batched graphs (dynamic batch axis, per-request KV lengths)

    @property
    def batched(self) -> bool:
        return self.max_batch > 1


# ---------------------------------------------------------------------------------------------------
# validation (before any work)
# ---------------------------------------------------------------------------------------------------


def validate_settings(s: ExportSettings) -> None:
    """Raise one `UserInputError` per bad input, before anything is loaded or written."""
    if s.variant not in VARIANTS:
        raise UserInputError(f"--variant must be one of {', '.join(VARIANTS)}, got {s.variant!r}")
    if s.opset is None:
        s.opset = max(20, MIN_OPSET[s.variant])
    if s.opset < MIN_OPSET[s.variant]:
        raise UserInputError(
            f"--opset must be >= {MIN_OPSET[s.variant]} for the {s.variant!r} variant, got {s.opset}"
        )
    if s.topk < 1:
        raise UserInputError(f"--topk must be >= 1, got {s.topk}")
    if s.max_batch < 1:
        raise UserInputError(f"--max-batch must be >= 1, got {s.max_batch}")
    out = Path(s.out)
    if out.exists() and not s.overwrite:
        raise UserInputError(f"output folder {out} already exists; pass --overwrite to replace it")
    for name, path in (("--head", s.head), ("--target", s.target)):
        if not Path(path).is_dir():
            raise UserInputError(f"{name} {path} is not a directory")
    if not (Path(s.head) / "config.json").is_file():
        raise UserInputError(f"--head {s.head} has no config.json: not a draft head directory")
    try:
        target_config = read_config(Path(s.target))
        check_supported(target_config)
    except (ValueError, FileNotFoundError) as err:
        raise UserInputError(str(err)) from err
    if not (Path(s.target) / "tokenizer.json").is_file():
        raise UserInputError(
            f"--target {s.target} has no tokenizer.json: the engine directory must carry the tokenizer"
        )


# ---------------------------------------------------------------------------------------------------
# example inputs and dynamic shapes
# ---------------------------------------------------------------------------------------------------


def _dims(max_positions: int) -> dict[str, torch.export.Dim]:
    limit = max(max_positions, 64)
    words = (limit + 31) // 32 + 1
    return {
        "N": torch.export.Dim("N", min=1, max=limit),
        "W": torch.export.Dim("W", min=1, max=words),
        "P": torch.export.Dim("P", min=0, max=limit),
        "T": torch.export.Dim("T", min=1, max=limit),
        "Q": torch.export.Dim("Q", min=1, max=limit),
        "Wq": torch.export.Dim("Wq", min=1, max=words),
        "B": torch.export.Dim("B", min=1, max=MAX_BATCH_DIM),
    }


#: the largest batch the batched graphs' dynamic axis admits (a runtime opens `max_batch` slots of it)
MAX_BATCH_DIM = 1024


def target_example(target: TargetModel, n: int = 40, past: int = 3) -> OrderedDict[str, torch.Tensor]:
    """Verify-graph inputs: a random tree-like mask over `n` rows after `past` cached rows."""
    gen = torch.Generator().manual_seed(0)
    cfg = target.config
    head_dim = int(target.layers[0].self_attn.head_dim)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    dense = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        dense[i] |= dense[parents[i]]
    kv = (target.num_layers, 1, int(cfg.num_key_value_heads), past, head_dim)
    return OrderedDict(
        input_ids=torch.randint(0, target.vocab_size, (1, n), generator=gen),
        position_ids=(past + dense.sum(-1) - 1).unsqueeze(0),
        tree_mask=pack_mask(dense),
        past_keys=torch.randn(kv, generator=gen),
        past_values=torch.randn(kv, generator=gen),
    )


def head_example(head: DraftHead, target: TargetModel, q: int = 33, t: int = 5, past: int = 3):
    """Head-graph inputs: `t` new context rows after `past` cached rows, a causal block of `q` rows."""
    gen = torch.Generator().manual_seed(1)
    attn = head.layers[0].self_attn
    kv = (len(head.layers), 1, int(attn.num_kv_heads), past, int(attn.head_dim))
    features = head.config.num_taps * head.config.target_hidden_size
    return OrderedDict(
        context_taps=torch.randn(1, t, features, generator=gen),
        context_positions=(past + torch.arange(t)).unsqueeze(0),
        block_ids=torch.randint(0, target.vocab_size, (1, q), generator=gen),
        block_positions=(past + t + torch.arange(q)).unsqueeze(0),
        block_mask=pack_mask(torch.ones(q, q, dtype=torch.bool).tril()),
        past_keys=torch.randn(kv, generator=gen),
        past_values=torch.randn(kv, generator=gen),
    )


#: the batched examples: three requests of different KV lengths (padding in the caches), tree sizes
#: (padding rows in the masks) and new context rows; traced at B = 3 so no axis specializes to 0 or 1
BATCH_PAST = (3, 1, 0)
BATCH_TREES = (40, 17, 1)
BATCH_CONTEXT = (5, 2, 3)


def _random_tree(n: int, gen: torch.Generator, vocab: int) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree.from_parents(torch.randint(0, vocab, (n,), generator=gen), torch.tensor(parents))


def batched_target_example(target: TargetModel) -> OrderedDict[str, torch.Tensor]:
    """Batched verify-graph inputs: `BATCH_TREES` trees after `BATCH_PAST` cached rows (padded)."""
    gen = torch.Generator().manual_seed(2)
    cfg = target.config
    head_dim = int(target.layers[0].self_attn.head_dim)
    trees = [_random_tree(n, gen, target.vocab_size) for n in BATCH_TREES]
    masks = pack_tree_batch(trees)
    b, n = masks.batch_size, masks.num_nodes
    ids = torch.stack([torch.cat([t.tokens, t.tokens[:1].expand(n - t.num_nodes)]) for t in trees])
    past = torch.tensor(BATCH_PAST, dtype=torch.int32)
    kv = (target.num_layers, b, int(cfg.num_key_value_heads), max(BATCH_PAST), head_dim)
    return OrderedDict(
        input_ids=ids,
        position_ids=masks.position_ids(past),
        tree_mask=masks.packed_mask,
        past_lengths=past,
        past_keys=torch.randn(kv, generator=gen),
        past_values=torch.randn(kv, generator=gen),
    )


def batched_head_example(head: DraftHead, target: TargetModel, q: int = 33):
    """Batched head-graph inputs: `BATCH_CONTEXT` new context rows (zero padding) after `BATCH_PAST`
    cached rows (padded), a causal block of `q` rows per request."""
    gen = torch.Generator().manual_seed(3)
    attn = head.layers[0].self_attn
    b, t, p = len(BATCH_PAST), max(BATCH_CONTEXT), max(BATCH_PAST)
    kv = (len(head.layers), b, int(attn.num_kv_heads), p, int(attn.head_dim))
    features = head.config.num_taps * head.config.target_hidden_size
    past = torch.tensor(BATCH_PAST, dtype=torch.int32)
    ctx = torch.tensor(BATCH_CONTEXT, dtype=torch.int32)
    taps = torch.randn(b, t, features, generator=gen)
    taps[torch.arange(t).unsqueeze(0) >= ctx.unsqueeze(1)] = 0.0
    positions = (past.long().unsqueeze(1) + torch.arange(t).unsqueeze(0)).minimum(
        (past.long() + ctx.long() - 1).unsqueeze(1)
    )
    block_start = (past + ctx).long().unsqueeze(1)
    return OrderedDict(
        context_taps=taps,
        context_positions=positions,
        context_lengths=ctx,
        block_ids=torch.randint(0, target.vocab_size, (b, q), generator=gen),
        block_positions=block_start + torch.arange(q).unsqueeze(0),
        block_mask=pack_mask(torch.ones(q, q, dtype=torch.bool).tril()),
        past_lengths=past,
        past_keys=torch.randn(kv, generator=gen),
        past_values=torch.randn(kv, generator=gen),
    )


def _dynamic_shapes(role: str, dims: dict[str, torch.export.Dim], batched: bool) -> dict[str, dict[int, Any]]:
    _, _, axes_of = graph_io(role, batched)
    return {name: {axis: dims[sym] for axis, sym in axes.items()} for name, axes in axes_of.items()}


# ---------------------------------------------------------------------------------------------------
# export, check, compare
# ---------------------------------------------------------------------------------------------------


def _export_graph(module, example, role: str, path: Path, opset: int, dims, batched: bool = False) -> None:
    inputs, outputs, _ = graph_io(role, batched)
    inputs, outputs = list(inputs), list(outputs)
    program = torch.onnx.export(
        module,
        tuple(example.values()),
        dynamo=True,
        opset_version=opset,
        input_names=inputs,
        output_names=outputs,
        dynamic_shapes=_dynamic_shapes(role, dims, batched),
        custom_translation_table=translation_table(),
        optimize=True,
        verbose=False,
    )
    big = sum(p.numel() * p.element_size() for p in module.parameters()) > 1_500_000_000
    program.save(str(path), external_data=big)


def check_graph(path: Path) -> onnx.ModelProto:
    """`onnx.checker` full check (with shape inference, TreeAttention's schema included)."""
    onnx.checker.check_model(str(path), full_check=True)
    return onnx.load(str(path), load_external_data=False)


def decode_check_prompt(target_dir: Path) -> list[int]:
    """Token ids of the greedy decode check's fixed text, in the target's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    ids = tok(DECODE_CHECK_TEXT, add_special_tokens=True)["input_ids"]
    if not ids:
        raise UserInputError(f"the tokenizer in {target_dir} encodes the check text to no tokens")
    return list(ids)


def _engine_config(s: ExportSettings, head: DraftHead, target: TargetModel) -> dict[str, Any]:
    graphs = {}
    for role, file in (("head", HEAD_GRAPH), ("target", TARGET_GRAPH)):
        inputs, outputs, _ = graph_io(role, s.batched)
        graphs[role] = {"file": file, "inputs": list(inputs), "outputs": list(outputs)}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "variant": s.variant,
        "opset": s.opset,
        "graphs": graphs,
        "batched": s.batched,
        "max_batch": int(s.max_batch),
        **pair_config(head, target, s.topk),
        "tokenizer": TOKENIZER_DIR,
        "engines": {},
        "source": {"head": str(Path(s.head).resolve()), "target": str(Path(s.target).resolve())},
    }


def load_pair(head_dir: Path, target_dir: Path) -> tuple[DraftHead, TargetModel]:
    """Load the head and the frozen target (fp32, CPU) and check that they fit; errors are user errors."""
    head = load_draft_head(head_dir)  # safetensors only; a corrupt file is named
    target = TargetModel.from_pretrained(target_dir)
    try:
        head.check_compatible(target.config)
    except ValueError as err:
        raise UserInputError(str(err)) from err
    target.set_taps(head.config.target_layer_ids)
    head.eval()
    return head, target


def export_engine(s: ExportSettings) -> Path:
    """Write the engine directory `s.out` (see module docstring); return its path."""
    validate_settings(s)
    out = Path(s.out)
    head, target = load_pair(Path(s.head), Path(s.target))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        dims = _dims(int(target.config.max_position_embeddings))
        target_graph, head_graph = decode_graphs(head, target, s.topk, s.variant, s.batched)
        if s.batched:
            examples = batched_target_example(target), batched_head_example(head, target)
        else:
            examples = target_example(target), head_example(head, target)
        graphs = [
            ("target", target_graph.eval(), examples[0], TARGET_GRAPH),
            ("head", head_graph.eval(), examples[1], HEAD_GRAPH),
        ]
        tolerances = {"target": target_tolerance(target), "head": head_tolerance(head)}
        checks: list[OutputCheck] = []
        for role, module, example, file in graphs:
            t0 = time.perf_counter()
            log.info("exporting the %s graph (%s variant)", role, s.variant)
            _export_graph(module, example, role, tmp / file, s.opset, dims, s.batched)
            check_graph(tmp / file)
            names = list(graph_io(role, s.batched)[1])
            graph_checks = compare_graph_with_torch(
                module, example, tmp / file, names, role, tolerances[role]
            )
            for c in graph_checks:
                log.info(
                    "  parity %s %s: %s %.3g (tolerance %.3g)", file, c.output, c.kind, c.error, c.tolerance
                )
            raise_on_failure(graph_checks)
            checks += graph_checks
            log.info("%s graph exported, checked and compared in %.1fs", role, time.perf_counter() - t0)
        tok_dir = tmp / TOKENIZER_DIR
        tok_dir.mkdir()
        for name in TOKENIZER_FILES:
            if (Path(s.target) / name).is_file():
                shutil.copy2(Path(s.target) / name, tok_dir / name)
        # the head's acceptance prior travels with the engine: `--budget auto` on an engine directory
        # starts from it as it does beside the head
        prior = Path(s.head) / ACCEPTANCE_PROFILE_FILE
        if prior.is_file():
            shutil.copy2(prior, tmp / ACCEPTANCE_PROFILE_FILE)
        config = _engine_config(s, head, target)
        write_engine_config(tmp, config)
        t0 = time.perf_counter()
        decode = greedy_decode_check(
            tmp, head, target, decode_check_prompt(Path(s.target)), tolerances["target"]
        )
        log.info(
            "greedy decode through the exported graphs: %d/%d tokens equal to torch (tau %.2f) in %.1fs",
            decode.matched,
            decode.tokens,
            decode.tau,
            time.perf_counter() - t0,
        )
        config["parity"] = parity_report(checks, decode)
        write_engine_config(tmp, config)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert (out / CONFIG_FILE).is_file()
    return out
