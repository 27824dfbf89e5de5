"""A head as each engine's DFlash loader reads it: vLLM, SGLang, the JetSpec reference loader, llama.cpp.

Why one folder per engine (`jetflow-export --format ENGINE`), not one saved format for all: the engines'
rules conflict, and two of them cannot express what our head is.

- **vLLM** (0.32, `qwen3_dflash.py`) takes `architectures: ["DFlashDraftModel"]`; causality from top-level
  `is_causal`, then `dflash_config.causal`, then `layer_types[i] == "sliding_attention"` (never our
  `causal_head`); the `fc` width from top-level `target_hidden_size`; a draft vocabulary only as an int64
  `d2t` offset tensor (`target_id = draft_id + d2t[draft_id]`) with `draft_vocab_size` and the head's own
  `lm_head.weight` rows, in draft-id order (without those rows it keeps the first `draft_vocab_size` rows
  of the target's lm_head: the wrong tokens, silently). Any other tensor (our `draft_vocab` buffer) fails
  the load. `draft_vocab_size: 0` (ours for "full vocabulary") builds a zero-row lm_head.
- **SGLang** (`models/dflash.py`) reads no causal key at all: a `full_attention` layer attends
  bidirectionally inside the block, a `sliding_attention` one causally, with window `sliding_window - 1`
  over the context too. A causal head is therefore written with `sliding_attention` layers and a window
  wider than any context (the workaround); vLLM would read those as real sliding windows, which is why
  the formats are separate. SGLang checks that the tokenizer maps `dflash_config.mask_token` (default
  `"<|MASK|>"`) to `mask_token_id`, so the folder names the mask token's text. It ignores any draft
  vocabulary (drafts over the target's full lm_head).
- **JetSpec** (reference `load_draft_head`, transformers 4.x) reads `dflash_config.{causal_head,
  target_layer_ids, target_hidden_size, mask_token_id}`, top-level `block_size` and `rope_theta`: our saved
  format. It always scores with the target's full lm_head (no draft vocabulary).
- **llama.cpp** (`convert_hf_to_gguf.py` of llama.cpp 0c1e57098, then `--spec-type draft-dflash`) reads
  causality as vLLM does (`is_causal`, then `dflash_config.causal`; else bidirectional), adds 1 to
  `target_layer_ids` (same meaning as ours), and refuses any tensor it cannot map (`draft_vocab`). Its
  `DFlashDraftModel` class cannot map `d2t` either; `DSparkDraftModel` converts `d2t` + `lm_head.weight`
  to its draft vocabulary (and, without its extra tensors, runs plain DFlash drafting). So a head with a
  draft vocabulary is written under that name.

Where an engine cannot honour the head it is refused in one line (`EngineFormatError`), never written:
a head with a draft vocabulary for SGLang or JetSpec would draft tokens it was never trained to rank
against; `full_vocab=True` (`--full-vocab`) is the explicit opt-in to draft over every id there.
Our own loader reads every folder written here (a `d2t` folder too: `draft_vocab_from_d2t`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from jetflow_pl.errors import UserInputError
from jetflow_pl.head.configuration import legacy_rope_fields

ENGINES = ("vllm", "sglang", "jetspec", "llamacpp")

#: the architecture name vLLM's and SGLang's registries map to their DFlash drafter
DFLASH_ARCHITECTURE = "DFlashDraftModel"
#: llama.cpp's converter maps this name to its DFlash class that reads `d2t` (its plain DFlash one cannot)
LLAMACPP_D2T_ARCHITECTURE = "DSparkDraftModel"


class EngineFormatError(UserInputError):
    """The head cannot be written for that engine without being misread there; the message says why."""


@dataclass(frozen=True)
class LoaderRule:
    """One thing an engine's loader reads: `where` (a config path like `dflash_config.causal`, or a tensor
    name), and `rule`, what it does with it. The table below is the contract the tests check."""

    engine: str
    where: str
    rule: str


LOADER_RULES: tuple[LoaderRule, ...] = (
    LoaderRule("vllm", "architectures", 'must name "DFlashDraftModel" (else: architecture not supported)'),
    LoaderRule(
        "vllm", "is_causal", "in-block causality, read first; then dflash_config.causal, then layer_types"
    ),
    LoaderRule("vllm", "dflash_config.causal", "in-block causality when is_causal is absent"),
    LoaderRule("vllm", "layer_types", 'all "full_attention": no sliding window on any layer'),
    LoaderRule("vllm", "target_hidden_size", "top level: the fc input width per tapped layer"),
    LoaderRule(
        "vllm", "dflash_config.target_layer_ids", "0-based decoder layers tapped (vLLM adds 1 internally)"
    ),
    LoaderRule("vllm", "dflash_config.mask_token_id", "the id fed at every masked block slot"),
    LoaderRule("vllm", "draft_vocab_size", "rows of the draft lm_head; 0 would build an empty head"),
    LoaderRule("vllm", "d2t", "int64 [draft_vocab_size]: target id = draft id + d2t[draft id]"),
    LoaderRule("vllm", "lm_head.weight", "[draft_vocab_size, hidden]: the target's rows in draft-id order"),
    LoaderRule("sglang", "architectures", 'must name "DFlashDraftModel"'),
    LoaderRule(
        "sglang", "layer_types", '"sliding_attention" = causal in the block; "full_attention" = bidirectional'
    ),
    LoaderRule(
        "sglang",
        "sliding_window",
        "window + 1 of a sliding layer over context and block: wider than any context",
    ),
    LoaderRule("sglang", "block_size", "the draft block (num_draft_tokens)"),
    LoaderRule("sglang", "dflash_config.target_layer_ids", "0-based decoder layers tapped"),
    LoaderRule("sglang", "dflash_config.mask_token_id", "the id fed at every masked block slot"),
    LoaderRule(
        "sglang",
        "dflash_config.mask_token",
        "the mask token's text; the tokenizer must map it to mask_token_id",
    ),
    LoaderRule("jetspec", "dflash_config.causal_head", "in-block causality"),
    LoaderRule("jetspec", "dflash_config.target_layer_ids", "0-based decoder layers tapped"),
    LoaderRule(
        "jetspec", "dflash_config.target_hidden_size", "must equal hidden_size (else a random adapter)"
    ),
    LoaderRule("jetspec", "dflash_config.mask_token_id", "the id fed at every masked block slot"),
    LoaderRule("jetspec", "block_size", "the draft block"),
    LoaderRule("jetspec", "rope_theta", "transformers 4.x RoPE base (default 1e4 without it)"),
    LoaderRule(
        "llamacpp",
        "architectures",
        "DSparkDraftModel with a draft vocabulary (maps d2t), else DFlashDraftModel",
    ),
    LoaderRule(
        "llamacpp", "is_causal", "dflash.attention.causal (then dflash_config.causal; else bidirectional)"
    ),
    LoaderRule(
        "llamacpp", "dflash_config.target_layer_ids", "written + 1 as dflash.target_layers (same meaning)"
    ),
    LoaderRule("llamacpp", "dflash_config.mask_token_id", "tokenizer.ggml.mask_token_id"),
    LoaderRule("llamacpp", "block_size", "dflash.block_size (drafts at most block_size - 1)"),
    LoaderRule("llamacpp", "draft_vocab_size", "the d2t length check"),
    LoaderRule("llamacpp", "d2t", "int64 offsets -> absolute target ids (range and uniqueness checked)"),
    LoaderRule(
        "llamacpp", "lm_head.weight", "[draft_vocab_size, hidden]: the target's rows in draft-id order"
    ),
)


def rules_for(engine: str) -> list[LoaderRule]:
    """The rules of `engine`'s loader (see `LOADER_RULES`)."""
    if engine not in ENGINES:
        raise EngineFormatError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    return [r for r in LOADER_RULES if r.engine == engine]


def read_path(config: Mapping[str, Any], where: str) -> Any:
    """`config["a"]["b"]` for `where="a.b"`; KeyError when any part is missing."""
    value: Any = config
    for part in where.split("."):
        value = value[part]
    return value


# ---- the draft vocabulary as vLLM's d2t offsets ------------------------------------------------------


def d2t_from_draft_vocab(vocab: Tensor) -> Tensor:
    """Sorted target ids of a draft vocabulary -> vLLM/EAGLE-3's int64 offsets (`vocab[i] - i`)."""
    ids = torch.as_tensor(vocab, dtype=torch.int64).reshape(-1)
    return ids - torch.arange(ids.numel(), dtype=torch.int64)


def draft_vocab_from_d2t(d2t: Tensor) -> Tensor:
    """vLLM's `d2t` offsets -> the draft vocabulary's target ids (`i + d2t[i]`); the inverse of
    `d2t_from_draft_vocab`."""
    offsets = torch.as_tensor(d2t, dtype=torch.int64).reshape(-1)
    return torch.arange(offsets.numel(), dtype=torch.int64) + offsets


# ---- config and weights per engine -------------------------------------------------------------------


def check_engine(config: Mapping[str, Any], engine: str, full_vocab: bool = False) -> None:
    """Raise `EngineFormatError` (one line) where `engine` would misread the head of our saved `config`
    dict; cheap, so callers run it before loading the target. `full_vocab`: see `engine_config`."""
    rules_for(engine)  # validates the name
    dflash = dict(config.get("dflash_config") or {})
    vocab = int(config["vocab_size"])
    draft = int(config.get("draft_vocab_size") or 0)
    hidden = int(config["hidden_size"])
    target_hidden = int(dflash.get("target_hidden_size") or hidden)
    if dflash.get("mask_token_id") is None:
        raise EngineFormatError("the head has no dflash_config.mask_token_id: every engine feeds that id")
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        raise EngineFormatError(
            f"layer_types {config.get('layer_types')}: a jetflow head attends over its whole context on "
            "every layer; a config naming other layer types was not written by it"
        )
    if engine in ("sglang", "jetspec") and 0 < draft < vocab and not full_vocab:
        raise EngineFormatError(
            f"{engine} cannot honour a draft vocabulary ({draft} of {vocab} ids): it ignores it and drafts "
            "over the target's full lm_head, ranking ids the head was never trained on; export for vllm or llamacpp, "
            "train a head without draft_vocab_size, or pass --full-vocab to accept that"
        )
    if engine == "jetspec" and target_hidden != hidden:
        raise EngineFormatError(
            f"JetSpec builds fc as taps x hidden_size and adds a random adapter when target_hidden_size "
            f"({target_hidden}) != hidden_size ({hidden}): the head's fc would not load"
        )


def engine_config(
    config: Mapping[str, Any], engine: str, *, mask_token: str | None = None, full_vocab: bool = False
) -> dict[str, Any]:
    """The `config.json` dict of a head for `engine`, from our saved `config` dict.

    `mask_token` (SGLang): the text the target's tokenizer maps to `mask_token_id`. `full_vocab`: write a
    head with a draft vocabulary for an engine that cannot honour one (it drafts over every id).
    Raises `EngineFormatError` where the engine would misread the head (`check_engine`).
    """
    check_engine(config, engine, full_vocab)
    out = copy.deepcopy(dict(config))
    dflash = dict(out.get("dflash_config") or {})
    causal = bool(dflash.get("causal_head", True))
    vocab = int(out["vocab_size"])
    draft = int(out.get("draft_vocab_size") or 0)
    target_hidden = int(dflash.get("target_hidden_size") or out["hidden_size"])
    layers = int(out["num_hidden_layers"])
    out["layer_types"] = ["full_attention"] * layers
    # transformers-4.x loaders (JetSpec's) read the RoPE base only at the top level, and a head saved
    # before the saved format carried it there would otherwise draft at base 1e4
    out.update(legacy_rope_fields(out.get("rope_parameters")))
    if engine in ("vllm", "llamacpp"):
        has_draft_vocab = 0 < draft < vocab
        d2t_name = LLAMACPP_D2T_ARCHITECTURE if engine == "llamacpp" else DFLASH_ARCHITECTURE
        out["architectures"] = [d2t_name if has_draft_vocab else DFLASH_ARCHITECTURE]
        out["is_causal"] = causal
        dflash["causal"] = causal
        out["target_hidden_size"] = target_hidden
        out["draft_vocab_size"] = draft if has_draft_vocab else vocab
    elif engine == "sglang":
        out["architectures"] = [DFLASH_ARCHITECTURE]
        if mask_token is None:
            raise EngineFormatError("SGLang checks the mask token's text: pass the target's tokenizer")
        dflash["mask_token"] = mask_token
        dflash["block_size"] = int(out.get("block_size", 16))
        if causal:  # the only way SGLang attends causally in the block: a window wider than any context
            out["layer_types"] = ["sliding_attention"] * layers
            out["sliding_window"] = int(out.get("max_position_embeddings", 32768)) + int(
                out.get("block_size", 16)
            )
            out["use_sliding_window"] = True
    else:  # jetspec: our own format is what its loader reads
        dflash["causal"] = causal
    if full_vocab and engine in ("sglang", "jetspec"):
        out["draft_vocab_size"] = 0
    out["dflash_config"] = dflash
    return out


def engine_weights(
    state: Mapping[str, Tensor], engine: str, lm_head_weight: Tensor | None = None, full_vocab: bool = False
) -> dict[str, Tensor]:
    """The tensors of a head for `engine`, from our saved `state` (`model.safetensors`).

    vLLM and llama.cpp: the `draft_vocab` buffer becomes `d2t` plus `lm_head.weight`, the rows
    `lm_head_weight` (the target's `[V, H]` lm_head) holds at the draft ids, in the head's dtype. Elsewhere
    the buffer is dropped (only with `full_vocab`, see `engine_config`).
    """
    out = {k: v.contiguous() for k, v in state.items() if k != "draft_vocab"}
    vocab = state.get("draft_vocab")
    if vocab is None:
        return out
    if engine not in ("vllm", "llamacpp"):
        if not full_vocab:
            raise EngineFormatError(f"{engine} cannot honour a draft vocabulary (see engine_config)")
        return out
    if lm_head_weight is None:
        raise EngineFormatError(f"{engine} needs the draft vocabulary's lm_head rows: pass the target")
    ids = vocab.to(torch.int64)
    dtype = next(iter(out.values())).dtype if out else lm_head_weight.dtype
    out["d2t"] = d2t_from_draft_vocab(ids)
    out["lm_head.weight"] = lm_head_weight.index_select(0, ids).to(dtype).contiguous()
    return out


def engine_serve_command(engine: str, engine_dir: str | Path, target_dir: str | Path, block_size: int) -> str:
    """The shell line that serves `target_dir` with the head folder `engine_dir` written for `engine`
    (vLLM and SGLang draft chains: `block_size - 1` draft tokens after the anchor)."""
    k = int(block_size) - 1
    if engine == "vllm":
        spec = json.dumps({"method": "dflash", "model": str(engine_dir), "num_speculative_tokens": k})
        return f"vllm serve {target_dir} --speculative-config '{spec}'"
    if engine == "sglang":
        return (
            f"python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {engine_dir} --speculative-num-draft-tokens {int(block_size)}"
        )
    if engine == "llamacpp":  # llama.cpp's own converter, for the target and (with its tokenizer) the head
        return (
            f"python convert_hf_to_gguf.py {target_dir} --outfile target.gguf && "
            f"python convert_hf_to_gguf.py {engine_dir} --target-model-dir {target_dir} --outfile head.gguf && "
            f"llama-server -m target.gguf -md head.gguf --spec-type draft-dflash --spec-draft-n-max {k}"
        )
    # jetspec's folder is our own format: the tree runtime here serves it
    return f"jetflow-serve --target {target_dir} --head {engine_dir}"


def serve_commands(head_dir: str | Path, target_dir: str | Path, block_size: int) -> dict[str, str]:
    """How to serve the head in `head_dir` (our saved format): with the tree runtime here (`jetflow`), and
    on vLLM and SGLang (the export into `<head_dir>-<engine>`, then the engine's server), one line each."""
    lines = {"jetflow": engine_serve_command("jetspec", head_dir, target_dir, block_size)}
    for engine in ("vllm", "sglang"):
        out = f"{str(head_dir).rstrip('/')}-{engine}"
        lines[engine] = (
            f"jetflow-export --format {engine} --head {head_dir} --target {target_dir} --out {out} && "
            + engine_serve_command(engine, out, target_dir, block_size)
        )
    return lines
