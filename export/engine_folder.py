"""`jetflow-export --format vllm|sglang|jetspec|llamacpp`: a head folder that engine's DFlash loader reads as we mean it.

The rules per engine, and why there is one folder per engine, are in `jetflow_pl.head.engine_formats`.
This module only does the I/O: read our head folder, take the draft vocabulary's lm_head rows from the
target (vLLM, llama.cpp) and the mask token's text from its tokenizer (SGLang), write `config.json` and
`model.safetensors` atomically (a staging folder renamed into place), plus a `SERVE.md` with the command.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jetflow_pl.checkpoints import check_safetensors_dir
from jetflow_pl.errors import UserInputError
from jetflow_pl.head.engine_formats import ENGINES, engine_config, engine_serve_command, engine_weights


@dataclass
class EngineFolderSettings:
    head: Path
    target: Path
    out: Path
    engine: str
    full_vocab: bool = False
    overwrite: bool = False


def _read_head(head_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    files = check_safetensors_dir(head_dir, "draft head")
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise UserInputError(f"draft head folder {head_dir} has no config.json")
    config = json.loads(config_path.read_text())
    state: dict[str, torch.Tensor] = {}
    for file in files:  # one file, or the shards of an index
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return config, state


def _target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's `[V, H]` lm_head weight (its tied embedding where it has no own lm_head), read
    through the one model loader."""
    from jetflow_pl.target import TargetModel

    target = TargetModel.from_pretrained(target_dir)
    return target.model.get_output_embeddings().weight.detach()


def _mask_token(target_dir: Path, mask_id: int) -> str:
    from jetflow_pl.decode_options import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    token = tokenizer.convert_ids_to_tokens(int(mask_id))
    if token is None or tokenizer.convert_tokens_to_ids(token) != int(mask_id):
        raise UserInputError(
            f"the target's tokenizer has no token text that maps back to mask_token_id {mask_id}: "
            "SGLang checks dflash_config.mask_token against it"
        )
    return token


def write_engine_folder(s: EngineFolderSettings) -> str:
    """Write the head of `s.head` for `s.engine` into `s.out`; returns the shell line that serves it.
    Nothing is written when the engine would misread the head (`EngineFormatError`) or `s.out` exists
    without `s.overwrite`."""
    if s.engine not in ENGINES:
        raise UserInputError(f"--format {s.engine!r}: choose one of {', '.join(ENGINES)} (or onnx)")
    if s.out.exists() and not s.overwrite:
        raise UserInputError(f"output folder {s.out} already exists; pass --overwrite to replace it")
    config, state = _read_head(s.head)
    # check what the engine can honour before loading the target (seconds to minutes)
    dflash = config.get("dflash_config") or {}
    mask_id = dflash.get("mask_token_id")
    engine_config(config, s.engine, mask_token="" if s.engine == "sglang" else None, full_vocab=s.full_vocab)
    needs_rows = s.engine in ("vllm", "llamacpp") and "draft_vocab" in state
    lm_head = _target_lm_head(s.target) if needs_rows else None
    mask_token = _mask_token(s.target, mask_id) if s.engine == "sglang" and mask_id is not None else None
    if lm_head is not None and int(lm_head.shape[0]) != int(config["vocab_size"]):
        raise UserInputError(
            f"the target's lm_head has {lm_head.shape[0]} rows, the head's vocab_size is {config['vocab_size']}"
        )
    out_config = engine_config(config, s.engine, mask_token=mask_token, full_vocab=s.full_vocab)
    tensors = engine_weights(state, s.engine, lm_head, full_vocab=s.full_vocab)
    stage = s.out.with_name(s.out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    (stage / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
    command = engine_serve_command(s.engine, s.out, s.target, int(config.get("block_size", 16)))
    (stage / "SERVE.md").write_text(
        f"# {s.head.name} for {s.engine}\n\nWritten by `jetflow-export --format {s.engine}` from `{s.head}` "
        f"(target `{s.target}`).\n\n```\n{command}\n```\n"
    )
    if s.out.exists():
        shutil.rmtree(s.out)
    stage.rename(s.out)
    return command
