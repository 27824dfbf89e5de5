"""Byte-level BPE tokenizer for the toy world, and the one place that formats (prompt, response) pairs.

Special tokens: ``<|pad|>`` (pad), ``<|endoftext|>`` (EOS), ``<|mask|>`` (reserved mask token of the
draft-head blocks; an additional special token, never produced on corpus text because corpus text has
special-token literals escaped), ``<|im_start|>`` / ``<|im_end|>`` (chat template). Digits are split
individually, which makes the arithmetic of the math domain easier for small models.
"""

from __future__ import annotations

import os

# chat formatting is the library's (one implementation for every stage); re-exported for toy callers
from jetflow_pl.chat import chat_ids, prompt_ids  # noqa: F401

PAD, EOS, MASK, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, MASK, IM_START, IM_END]

# ChatML-like: every turn is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens
# an assistant turn. Assistant answers end with EOS (not <|im_end|>) in this toy world.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_corpus(seed: int = 0, n_math: int = 4000, n_code: int = 3000, n_prose: int = 2000) -> list[str]:
    """Training-split texts used to learn the BPE merges (prompts and responses)."""
    from data_gen.toy.splits import train_records

    texts: list[str] = []
    for domain, n in (("math", n_math), ("code", n_code), ("prose", n_prose)):
        for r in train_records(domain, n, seed):
            texts.append(r["prompt"])
            texts.append(r["response"])
    texts.append("user\nassistant\nsystem\n")
    return texts


def train_tokenizer(
    out_dir: str,
    vocab_size: int = 2048,
    seed: int = 0,
    model_max_length: int = 1024,
    corpus_scale: float = 1.0,
):
    """Train the BPE on the toy corpora, save it as an HF fast tokenizer in ``out_dir``, return it.

    ``corpus_scale`` shrinks the training corpus (tests use a fraction for speed).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size > 4096:
        raise ValueError("toy tokenizers keep vocab_size <= 4096")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sizes = [max(50, int(n * corpus_scale)) for n in (4000, 3000, 2000)]
    tok.train_from_iterator(tokenizer_corpus(seed, *sizes), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=None,
        unk_token=None,
        mask_token=MASK,
        additional_special_tokens=[MASK, IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def mask_token_id(tokenizer) -> int:
    """Id of the reserved ``<|mask|>`` token."""
    tid = tokenizer.convert_tokens_to_ids(MASK)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError("tokenizer has no <|mask|> token")
    return int(tid)


def format_example(tokenizer, prompt: str, response: str) -> tuple[list[int], list[bool]]:
    """``(input_ids, loss_mask)`` for one example: chat-formatted prompt, then response ids and EOS.

    ``loss_mask`` is True exactly on the response tokens and the final EOS.
    """
    p_ids = prompt_ids(tokenizer, prompt)
    r_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return p_ids + r_ids, [False] * len(p_ids) + [True] * len(r_ids)
