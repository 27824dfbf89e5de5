"""Lossless on the shipped `small` toy target with an untrained head: >= 20 real prompts, every budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data_gen.toy
from data_gen.toy.splits import heldout_prompts
from data_gen.toy.tokenizer import mask_token_id, prompt_ids
from jetflow_pl.decoding import SpeculativeGenerator
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

SMALL = Path(data_gen.toy.__file__).parent / "assets" / "small"
MAX_NEW = 32

pytestmark = pytest.mark.skipif(
    not (SMALL / "model.safetensors").is_file(),
    reason=f"shipped toy target missing at {SMALL}; rebuild with `python -m data_gen.toy.build --preset small`",
)


@pytest.fixture(scope="module")
def small():
    tokenizer = AutoTokenizer.from_pretrained(SMALL)
    target = TargetModel.from_pretrained(SMALL)
    hf = AutoModelForCausalLM.from_pretrained(SMALL).eval()
    records = heldout_prompts("math", 10) + heldout_prompts("code", 5) + heldout_prompts("prose", 5)
    prompts = [prompt_ids(tokenizer, r["prompt"]) for r in records]
    eos = tokenizer.eos_token_id
    refs = [
        hf.generate(
            torch.tensor([p]),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    return target, tokenizer, prompts, refs


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_greedy_lossless_small_target_untrained_head(small, causal):
    target, tokenizer, prompts, refs = small
    assert len(prompts) >= 20
    torch.manual_seed(1)
    cfg = DraftHeadConfig.for_target(target.config, causal=causal, mask_token_id=mask_token_id(tokenizer))
    backend = TorchBackend(target, DraftHead(cfg).eval())
    mismatches = []
    for budget in (1, 4, 16, 64, 256):
        gen = SpeculativeGenerator(backend, budget=budget, width=4, eos_token_id=tokenizer.eos_token_id)
        for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
            if gen.generate(p, MAX_NEW).tokens != ref:
                mismatches.append((budget, i))
    assert mismatches == []
