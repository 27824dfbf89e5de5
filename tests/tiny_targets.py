"""Tiny random targets of each supported family, with sliding windows (8 positions) that every test crosses.

Built in about a second, seeded, saved as real HF folders with the toy tokenizer (so export, ORT decoding
and the CLIs run on them as on any checkpoint). Norm weights are moved off their init so a graph that
skipped a norm would be caught.

* `gemma3`: Gemma 3's pattern in miniature: local layers around one global layer, two RoPE bases,
  sandwich norms, one KV head, `query_pre_attn_scalar`.
* `qwen2`: Qwen2 with `use_sliding_window` (its upper layers slide), attention biases.
* `mistral`: Mistral with `sliding_window` on every layer.
* `llama`: Llama, every layer global.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from data_gen.toy import SMALL_TARGET_DIR

#: the window of the tiny model's local layers (prompts plus 60 new tokens cross it many times)
TINY_WINDOW = 8
TINY_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


#: the sizes every tiny target shares (the toy tokenizer's 2,048 ids, its pad 0 and EOS 1)
_COMMON = dict(
    vocab_size=2048,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)


def build_tiny_gemma3(out: Path, seed: int = 0) -> Path:
    """Save the tiny Gemma 3 (vocabulary of the toy tokenizer, 2,048) with the toy tokenizer into `out`."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": len(TINY_LAYER_TYPES)},
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=TINY_WINDOW,
        layer_types=list(TINY_LAYER_TYPES),
        query_pre_attn_scalar=16,
    )
    return _save(Gemma3ForCausalLM(cfg), out)


def build_tiny(family: str, out: Path, seed: int = 0) -> Path:
    """A tiny random target of `family` (module docstring) saved into `out`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if family == "gemma3":
        return build_tiny_gemma3(out, seed)
    torch.manual_seed(seed)
    common = dict(_COMMON, num_key_value_heads=2, tie_word_embeddings=False)
    if family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=2)
        return _save(Qwen2ForCausalLM(cfg), out)
    if family == "mistral":
        return _save(MistralForCausalLM(MistralConfig(**common, sliding_window=TINY_WINDOW)), out)
    if family == "llama":
        return _save(LlamaForCausalLM(LlamaConfig(**common)), out)
    raise ValueError(f"unknown family {family!r}")


def _save(model, out: Path) -> Path:
    model = model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMALL_TARGET_DIR / name, out / name)
    return out
