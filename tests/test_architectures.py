"""Each target family the README lists, on tiny random weights, through decode and export (docs: "Use your
own model"): greedy speculative output equals HF `generate()` on torch and on the exported graphs (ONNX
Runtime), crossing the sliding windows Qwen2 (upper layers) and Mistral (every layer) have here. Qwen3 is
the toy target (tests/test_decoding.py, tests/test_export.py); Gemma 3 has its own file
(tests/test_gemma3.py). Anything else is refused in one line before any weight loads.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_decoding import hf_greedy
from tiny_heads import perturbed_head
from tiny_targets import build_tiny
from transformers import AutoModelForCausalLM

from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_thread")

MASK_ID = 2  # the toy tokenizer's <|mask|>
NEW_TOKENS = 40


def _prompts_and_refs(path):
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (4, 13)]
    return prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]  # no EOS (tiny_targets)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama"])
def test_family_decodes_and_exports_losslessly(family, tmp_path):
    pytest.importorskip("onnxruntime")
    from export.onnx_export import ExportSettings, export_engine
    from jetflow_pl.runtime.loader import load_backend

    path = build_tiny(family, tmp_path / family)
    prompts, refs = _prompts_and_refs(path)
    target = TargetModel.from_pretrained(path)
    head = perturbed_head(target, MASK_ID, block_size=8).eval()
    backend = TorchBackend(target, head)
    assert [ARGenerator(backend).generate(p, NEW_TOKENS).tokens for p in prompts] == refs
    for budget in (4, 32):
        gen = SpeculativeGenerator(backend, budget=budget, width=4)
        assert [gen.generate(p, NEW_TOKENS).tokens for p in prompts] == refs, budget
    head.save_pretrained(tmp_path / "head")
    out = export_engine(ExportSettings(head=tmp_path / "head", target=path, out=tmp_path / "engine"))
    windows = json.loads((out / "config.json").read_text())["target"]["sliding_windows"]
    assert windows == [w or 0 for w in target.windows]
    graphs = load_backend("onnxruntime", engine_dir=out)
    gen = SpeculativeGenerator(graphs, budget=16, width=4)
    assert [gen.generate(p, NEW_TOKENS).tokens for p in prompts] == refs


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
            "unsupported target architecture 'gpt2'",
        ),
        (
            {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
            "unsupported target architecture 'qwen3_moe'",
        ),
        (
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            "unsupported target architecture 'gemma3'",
        ),
    ],
    ids=["unknown", "moe", "multimodal"],
)
def test_other_architectures_are_refused_in_one_line(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError, match=message):
        TargetModel.from_pretrained(tmp_path)
