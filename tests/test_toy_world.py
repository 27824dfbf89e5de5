"""Fast checks of the toy world: generators, splits, tokenizer, example formatting, tiny target."""

from __future__ import annotations

import re

import pytest
import torch

from data_gen.toy import code_corpus, prose_corpus, splits
from data_gen.toy._text import sanitize
from data_gen.toy.math_problems import TEMPLATES, generate_math, parse_final_answer
from data_gen.toy.splits import DOMAINS, heldout_prompts, train_records

STEP_RE = re.compile(r"^[^:]+: (\d+) ([-+*/]) (\d+) = (\d+)$")


# ------------------------------------------------------------------------------------------ math


def test_math_deterministic_per_seed():
    assert generate_math(60, seed=3) == generate_math(60, seed=3)
    assert generate_math(60, seed=3) != generate_math(60, seed=4)


def test_math_answers_consistent():
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}
    for rec in generate_math(300, seed=0):
        assert rec["domain"] == "math" and set(rec) >= {"id", "prompt", "response", "answer"}
        lines = rec["response"].splitlines()
        assert 3 <= len(lines) <= 5
        results = []
        for line in lines[:-1]:
            m = STEP_RE.match(line)
            assert m, line
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            if op == "/":
                assert a % b == 0
            assert ops[op](a, b) == c, line
            results.append(c)
        assert lines[-1] == f"#### {rec['answer']}"
        assert results[-1] == rec["answer"] == parse_final_answer(rec["response"])
        # every step after the first uses the previous result or a number of the prompt
        prompt_numbers = {int(x) for x in re.findall(r"\d+", rec["prompt"])}
        for line in lines[:-1]:
            m = STEP_RE.match(line)
            for operand in (int(m[1]), int(m[3])):
                assert operand in prompt_numbers or operand in results or operand == 4


def test_math_has_at_least_8_templates_all_used():
    assert len(TEMPLATES) >= 8
    used = {r["template"] for r in generate_math(4 * len(TEMPLATES), seed=1)}
    assert used == set(TEMPLATES)


def test_parse_final_answer():
    assert parse_final_answer("a: 1 + 2 = 3\n#### 3") == 3
    assert parse_final_answer("#### 3\nmore text") is None
    assert parse_final_answer("#### three") is None
    assert parse_final_answer("") is None


# ----------------------------------------------------------------------------------- code, prose


def test_code_corpus_deterministic_and_capped():
    recs = code_corpus.generate_code(40, seed=0)
    assert recs == code_corpus.generate_code(40, seed=0)
    assert len(recs) == 40
    for r in recs:
        assert r["domain"] == "code"
        assert r["prompt"].lstrip().startswith(("def ", "async def ", "class ", "@"))
        assert '"""' in r["prompt"] or "'''" in r["prompt"]
        assert len(r["response"]) <= code_corpus.MAX_RESPONSE_CHARS
        assert len(r["prompt"]) <= code_corpus.MAX_PROMPT_CHARS
        assert "/test/" not in r["id"] and "idlelib" not in r["id"]


def test_prose_corpus():
    recs = prose_corpus.generate_prose(30, seed=0)
    assert recs == prose_corpus.generate_prose(30, seed=0)
    assert len(recs) == 30
    for r in recs:
        assert r["domain"] == "prose" and r["topic"] in r["prompt"]
        assert 0 < len(r["response"]) <= prose_corpus.CHUNK_CHARS + 5
    assert any(
        r["prompt"] == "Explain the Python topic 'assert' briefly."
        for r in prose_corpus.all_items(["assert"])
    )


def test_sanitize_escapes_special_literals():
    assert "<|mask|>" not in sanitize("x = '<|mask|>' + '<|endoftext|>'")


# ---------------------------------------------------------------------------------------- splits


@pytest.mark.parametrize("domain", DOMAINS)
def test_heldout_deterministic(domain):
    a = heldout_prompts(domain, 20, seed=0)
    assert a == heldout_prompts(domain, 20, seed=0)
    assert len(a) == 20
    assert all(r["domain"] == domain for r in a)


def test_heldout_disjoint_from_train():
    # math: prompt-hash buckets
    train = {r["prompt"] for r in train_records("math", 3000, seed=0)}
    held = heldout_prompts("math", 200, seed=0)
    assert not train & {r["prompt"] for r in held}
    assert not {r["prompt"] for r in train_records("math", 500, seed=7)} & {r["prompt"] for r in held}
    # code: disjoint top-level modules
    train_mods, held_mods = set(splits.code_modules(False)), set(splits.code_modules(True))
    assert held_mods and train_mods and not train_mods & held_mods
    assert all(code_corpus.top_level(r["module"]) in held_mods for r in heldout_prompts("code", 30))
    assert all(code_corpus.top_level(r["module"]) in train_mods for r in train_records("code", 30, 0))
    # prose: disjoint topics
    train_topics, held_topics = set(splits.prose_topics(False)), set(splits.prose_topics(True))
    assert held_topics and not train_topics & held_topics
    assert {r["topic"] for r in heldout_prompts("prose", 20)} <= held_topics
    assert {r["topic"] for r in train_records("prose", 50, 0)} <= train_topics


# ------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from data_gen.toy.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("toy_tok")
    train_tokenizer(str(out), vocab_size=1024, seed=0, corpus_scale=0.25)
    return AutoTokenizer.from_pretrained(str(out))


def _samples():
    recs = []
    for d in DOMAINS:
        recs += train_records(d, 15, seed=2) + heldout_prompts(d, 5, seed=2)
    return recs


def test_tokenizer_specials(tokenizer):
    from data_gen.toy.tokenizer import mask_token_id

    assert len(tokenizer) <= 4096
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.mask_token == "<|mask|>"
    ids = {tokenizer.pad_token_id, tokenizer.eos_token_id, mask_token_id(tokenizer)}
    assert len(ids) == 3
    assert tokenizer.chat_template
    for t in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(t) in tokenizer.all_special_ids


def test_tokenizer_round_trip_and_no_mask(tokenizer):
    from data_gen.toy.tokenizer import mask_token_id

    mask = mask_token_id(tokenizer)
    for rec in _samples():
        for text in (rec["prompt"], rec["response"]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert mask not in ids
            assert tokenizer.decode(ids) == text
    escaped = sanitize("a <|mask|> b")
    assert mask not in tokenizer(escaped, add_special_tokens=False)["input_ids"]


def test_format_example_loss_mask(tokenizer):
    from data_gen.toy.tokenizer import format_example, prompt_ids

    for rec in _samples()[::3]:
        ids, mask = format_example(tokenizer, rec["prompt"], rec["response"])
        assert len(ids) == len(mask)
        p = prompt_ids(tokenizer, rec["prompt"])
        r = tokenizer(rec["response"], add_special_tokens=False)["input_ids"]
        assert ids == p + r + [tokenizer.eos_token_id]
        assert mask == [False] * len(p) + [True] * (len(r) + 1)
        text = tokenizer.decode(p)
        assert text == f"<|im_start|>user\n{rec['prompt']}<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------- targets


def test_build_tiny_target_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from data_gen.toy.target_trainer import build_tiny_target

    path = build_tiny_target(str(tmp_path / "tiny"), vocab_size=300, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == 300
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()
    again = AutoModelForCausalLM.from_pretrained(
        build_tiny_target(str(tmp_path / "t2"), vocab_size=300, seed=0)
    )
    assert torch.equal(logits, again(torch.tensor([[5, 6, 7]])).logits)


def test_tiny_training_step_decreases_loss(tokenizer, tmp_path):
    """A few optimizer steps of the Lightning module on real batches lower the loss."""
    from data_gen.toy.target_trainer import ToyTargetModule, bucket_batches, collate, encode_records

    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(str(tok_dir))
    module = ToyTargetModule(
        preset="tiny", tokenizer_path=str(tok_dir), lr=3e-3, warmup_steps=1, total_steps=20
    )
    ex = encode_records(tokenizer, train_records("math", 64, 0), 256)
    batch = collate(bucket_batches(ex, 100_000, 0)[0], tokenizer.pad_token_id, 0.2)
    assert batch["loss_mask"].any() and (batch["weights"] > 0).sum() > batch["loss_mask"].sum()
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = _loss(module, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _loss(module, batch):
    logits = module(batch["input_ids"], batch["attention_mask"])
    nll = module.token_losses(logits, batch["input_ids"])
    w = batch["weights"][:, 1:]
    return (nll * w).sum() / w.sum()
