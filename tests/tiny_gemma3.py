"""A tiny random Gemma 3 target whose sliding window (8 positions) is crossed many times by every test.

Built in about a second, seeded, saved as a real HF folder with the toy tokenizer (so export, ORT decoding
and the CLIs run on it as on any checkpoint). Layer kinds follow Gemma 3's pattern in miniature: local
layers around one global layer, two RoPE bases, sandwich norms, one KV head, `query_pre_attn_scalar`.
Norm weights are moved off their init so a graph that skipped one of the four norms would be caught.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from data_gen.toy import SMALL_TARGET_DIR

#: the window of the tiny model's local layers (prompts plus 60 new tokens cross it many times)
TINY_WINDOW = 8
TINY_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def build_tiny_gemma3(out: Path, seed: int = 0) -> Path:
    """Save the tiny Gemma 3 (vocabulary of the toy tokenizer, 2,048) with the toy tokenizer into `out`."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(TINY_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=TINY_WINDOW,
        layer_types=list(TINY_LAYER_TYPES),
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMALL_TARGET_DIR / name, out / name)
    return out
