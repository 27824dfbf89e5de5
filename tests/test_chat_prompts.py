"""Chat formatting and prompt files live in the library; the toy world and regeneration use them, and a
real tokenizer (SmolLM2's, when materialized) works wherever the toy one does."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

import data_gen.toy
from data_gen.regenerate.prompts import PromptSourceError, chat_prompt_ids
from data_gen.toy.heldout_files import DEFAULT_DIR, heldout_rows, jsonl_text
from data_gen.toy.splits import heldout_prompts
from data_gen.toy.tokenizer import prompt_ids as toy_prompt_ids
from jetflow_pl.chat import chat_ids, encode_prompt, prompt_ids, row_messages
from jetflow_pl.errors import UserInputError
from jetflow_pl.prompt_files import load_local_rows
from jetflow_pl.training.callbacks import AcceptanceLengthCallback

REPO = Path(__file__).resolve().parents[1]
SMALL = data_gen.toy.SMALL_TARGET_DIR
REAL = REPO / "models" / "SmolLM2-135M-Instruct"
needs_small = pytest.mark.skipif(not (SMALL / "tokenizer.json").is_file(), reason=f"no toy target at {SMALL}")
needs_real = pytest.mark.skipif(
    not (REAL / "tokenizer.json").is_file(),
    reason=f"real target not materialized at {REAL} (python -m data_gen.real_target)",
)


@pytest.fixture(scope="module")
def toy_tok():
    return AutoTokenizer.from_pretrained(SMALL, local_files_only=True)


@pytest.fixture(scope="module")
def templateless(toy_tok, tmp_path_factory):
    """The toy tokenizer saved without its chat template (as a base, non-chat model's would be)."""
    out = tmp_path_factory.mktemp("no_template")
    tok = AutoTokenizer.from_pretrained(SMALL, local_files_only=True)
    tok.chat_template = None
    tok.save_pretrained(out)
    for f in out.glob("chat_template*"):
        f.unlink()
    loaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert not loaded.chat_template
    return loaded


# ------------------------------------------------------------------------------------------ chat
@needs_small
def test_chat_ids_are_the_template_text_tokenized_once(toy_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ann has 3 cats."}]
    text = toy_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert chat_ids(toy_tok, msgs) == toy_tok(text, add_special_tokens=False)["input_ids"]
    one = prompt_ids(toy_tok, "Ann has 3 cats.")
    assert one == chat_ids(toy_tok, [{"role": "user", "content": "Ann has 3 cats."}])
    assert toy_prompt_ids is prompt_ids  # the toy world re-exports the one implementation
    assert encode_prompt(toy_tok, "hi", chat=False) == toy_tok("hi")["input_ids"]


@needs_small
def test_no_chat_template_is_one_line_suggesting_raw_prompts(templateless):
    with pytest.raises(UserInputError, match="has no chat template") as info:
        prompt_ids(templateless, "hi")
    assert "\n" not in str(info.value) and "--no-chat-template" in str(info.value)
    assert encode_prompt(templateless, "hi", chat=False)  # raw still works
    with pytest.raises(PromptSourceError, match="has no chat template"):  # regeneration: its own error
        chat_prompt_ids(templateless, [{"role": "user", "content": "hi"}])


@needs_real
def test_the_real_tokenizer_formats_like_its_own_chat_template():
    tok = AutoTokenizer.from_pretrained(REAL, local_files_only=True)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    expected = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert prompt_ids(tok, "What is 2+3?") == list(expected["input_ids"])
    assert tok.decode(prompt_ids(tok, "What is 2+3?")).endswith("<|im_start|>assistant\n")


def test_row_messages_prompt_chat_and_errors():
    assert row_messages({"prompt": "x"}, "row 0") == [{"role": "user", "content": "x"}]
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert row_messages(chat, "row 1") == [{"role": "user", "content": "q"}]  # final answer dropped
    for bad, msg in [
        ({"text": "x"}, "has no 'prompt' field"),
        ({"messages": [{"who": 1}]}, "malformed chat"),
    ]:
        with pytest.raises(UserInputError, match=msg):
            row_messages(bad, "row 2")


# ------------------------------------------------------------------------------------------ prompt files
def test_shipped_heldout_files_are_what_the_toy_world_generates():
    """The committed files are the callback's former prompts (`heldout_prompts(d, 20, 0)`), byte for byte;
    the code domain comes from the stdlib of the Python that wrote them (recorded in the README)."""
    written_with = (DEFAULT_DIR / "README.md").read_text()
    for domain in ("math", "prose", "code"):
        if domain == "code" and f"Python {platform.python_version()}" not in written_with:
            continue  # another interpreter's stdlib: the file pins the old one, which is the point
        assert (DEFAULT_DIR / f"{domain}.jsonl").read_text() == jsonl_text(heldout_rows(domain)), domain
    rows = load_local_rows(DEFAULT_DIR / "math.jsonl")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in heldout_prompts("math", 20, 0)]


def test_prompt_files_every_format_and_bad_paths(tmp_path):
    rows = [{"id": "a", "prompt": "p1"}, {"id": "b", "prompt": "p2"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_local_rows(tmp_path / "p.jsonl") == rows
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_local_rows(tmp_path / "ds") == rows
    with pytest.raises(UserInputError, match="does not exist"):
        load_local_rows(tmp_path / "none.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(UserInputError, match="unsupported prompt file type"):
        load_local_rows(tmp_path / "x.txt")


# ------------------------------------------------------------------------------------------ val/tau callback
def fake_module(target_path: Path, target=None, head=None):
    """What the callback reads from a DistillationModule: hparams.target_path, target, head."""
    return SimpleNamespace(hparams=SimpleNamespace(target_path=str(target_path)), target=target, head=head)


@needs_small
def test_callback_reads_the_same_prompts_it_used_to_encode(toy_tok):
    cb = AcceptanceLengthCallback(prompts_file=str(DEFAULT_DIR / "math.jsonl"))
    got = cb._load_prompts(fake_module(SMALL))
    expected = [toy_prompt_ids(toy_tok, r["prompt"]) for r in heldout_prompts("math", 20, 0)]
    assert got == expected and cb._eos == toy_tok.eos_token_id


@needs_small
def test_callback_reads_chats_from_a_datasets_folder_and_limits_rows(toy_tok, tmp_path):
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(5)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    cb = AcceptanceLengthCallback(prompts_file=str(tmp_path / "ds"), num_prompts=3)
    got = cb._load_prompts(fake_module(SMALL))
    assert got == [toy_prompt_ids(toy_tok, f"q{i}") for i in range(3)]


@needs_small
def test_callback_takes_the_first_rows_of_each_listed_source(toy_tok, tmp_path):
    # a head selected on math and code must see both: num_prompts applies per source, in list order
    cb = AcceptanceLengthCallback(
        prompts_file=[str(DEFAULT_DIR / "math.jsonl"), str(DEFAULT_DIR / "code.jsonl")], num_prompts=2
    )
    got = cb._load_prompts(fake_module(SMALL))
    expected = [toy_prompt_ids(toy_tok, r["prompt"]) for r in heldout_prompts("math", 2, 0)]
    expected += [toy_prompt_ids(toy_tok, r["prompt"]) for r in heldout_prompts("code", 2, 0)]
    assert got == expected
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cb = AcceptanceLengthCallback(prompts_file=[str(DEFAULT_DIR / "math.jsonl"), str(empty)])
    with pytest.raises(UserInputError, match="empty.jsonl"):
        cb._load_prompts(fake_module(SMALL))
    with pytest.raises(UserInputError, match="empty list"):
        AcceptanceLengthCallback(prompts_file=[])


@needs_small
def test_callback_errors_are_one_line(templateless, tmp_path):
    with pytest.raises(UserInputError, match="exactly one of prompts_file"):
        AcceptanceLengthCallback()
    cb = AcceptanceLengthCallback(prompts_file=str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserInputError, match="missing.jsonl"):
        cb._load_prompts(fake_module(SMALL))
    cb = AcceptanceLengthCallback(prompts_file=str(DEFAULT_DIR / "math.jsonl"))
    with pytest.raises(UserInputError, match="no chat template"):
        cb._load_prompts(fake_module(Path(templateless.name_or_path)))


@needs_small
def test_callback_measures_tau_with_the_shipped_head():
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.target import TargetModel

    target = TargetModel.from_pretrained(SMALL)
    head = load_draft_head(data_gen.toy.SMALL_HEAD_DIR)
    cb = AcceptanceLengthCallback(
        prompts_file=str(DEFAULT_DIR / "math.jsonl"), num_prompts=2, budget=16, max_new_tokens=16
    )
    head.train()
    stats = cb.measure(fake_module(SMALL, target, head))
    assert stats["rounds"] > 0 and stats["tau"] > 1.0  # a trained head accepts drafts on held-out math
    assert head.training  # the callback decodes in eval mode and puts the head back as it found it


@needs_real
def test_callback_works_with_the_real_tokenizer():
    cb = AcceptanceLengthCallback(prompts_file=str(DEFAULT_DIR / "math.jsonl"), num_prompts=2)
    got = cb._load_prompts(fake_module(REAL))
    tok = AutoTokenizer.from_pretrained(REAL, local_files_only=True)
    rows = load_local_rows(DEFAULT_DIR / "math.jsonl")[:2]
    assert got == [prompt_ids(tok, r["prompt"]) for r in rows]
    assert cb._eos == tok.eos_token_id == 2
