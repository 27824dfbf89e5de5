"""`jetflow-export --format vllm|sglang|jetspec|llamacpp`: a head folder that engine's DFlash loader reads as we mean it.

The rules per engine, and why there is one folder per engine, are in `jetflow_pl.head.engine_formats`.
This module only does the I/O: load the head and the target with the ONNX export's load-and-check
(`load_pair`: the head must fit the target), take the draft vocabulary's lm_head rows from the target
(vLLM, llama.cpp) and the mask token's text from its tokenizer (SGLang), write `config.json` and
`model.safetensors` atomically (a staging folder renamed into place), plus a `SERVE.md` with the command.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from export.onnx_export import load_pair
from jetflow_pl.errors import UserInputError
from jetflow_pl.head.engine_formats import (
    ENGINES,
    check_engine,
    engine_config,
    engine_serve_command,
    engine_weights,
)


@dataclass
class EngineFolderSettings:
    head: Path
    target: Path
    out: Path
    engine: str
    full_vocab: bool = False
    overwrite: bool = False


def _saved_config(head_dir: Path) -> dict:
    """The head's `config.json` as saved (what the engine's config is derived from)."""
    path = head_dir / "config.json"
    if not path.is_file():
        raise UserInputError(f"draft head folder {head_dir} has no config.json")
    return json.loads(path.read_text())


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
    config = _saved_config(s.head)
    check_engine(config, s.engine, s.full_vocab)  # refuse before loading the target (seconds to minutes)
    # the export's one load-and-check: the head (its stored dtype, a d2t folder too) fits the target
    head, target = load_pair(s.head, s.target)
    mask_id = config["dflash_config"]["mask_token_id"]
    mask_token = _mask_token(s.target, mask_id) if s.engine == "sglang" else None
    out_config = engine_config(config, s.engine, mask_token=mask_token, full_vocab=s.full_vocab)
    lm_head = target.model.get_output_embeddings().weight.detach()
    tensors = engine_weights(head.state_dict(), s.engine, lm_head, full_vocab=s.full_vocab)
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
