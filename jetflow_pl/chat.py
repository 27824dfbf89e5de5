"""Chat formatting: the one place a prompt (or a chat) becomes the token ids a chat model expects.

Every stage formats prompts the same way (regeneration, the val/tau callback, `generate`, the benches):
the tokenizer's own chat template with `add_generation_prompt=True`, so the ids end with an opened
assistant turn, exactly what the target saw when it produced its responses. The template text is
tokenized with `add_special_tokens=False` because a template writes its special tokens (BOS, turn
markers) itself; adding them again would double a BOS on tokenizers that have one.

A tokenizer without a chat template cannot do this; asking it to is a `UserInputError` with one line
saying how to feed the prompts raw instead, never a silent fallback to raw text (the model would see
prompts formatted unlike its training data and the measured tau would not be the one users get).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jetflow_pl.errors import UserInputError

#: roles a chat message may carry (the union of what common chat templates accept)
ROLES = ("system", "user", "assistant", "tool")
#: what a user without a chat template can do instead (the `generate` flag)
RAW_HINT = "pass --no-chat-template to feed the prompts raw"


def has_chat_template(tokenizer: Any) -> bool:
    """True when `tokenizer` carries a chat template (HF tokenizers keep it in `chat_template`)."""
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer: Any, hint: str = RAW_HINT) -> None:
    """Raise one `UserInputError` line (ending with `hint`) unless `tokenizer` has a chat template."""
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserInputError(
            f"the tokenizer {name!r} has no chat template, so prompts cannot be chat-formatted; {hint}"
        )


def chat_ids(tokenizer: Any, messages: Sequence[dict], hint: str = RAW_HINT) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with an opened assistant turn."""
    require_chat_template(tokenizer, hint)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, prompt: str, hint: str = RAW_HINT) -> list[int]:
    """Token ids of one user prompt, chat-formatted (a single user turn + the assistant generation prompt)."""
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}], hint)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[dict], chat: bool = True) -> list[int]:
    """Ids of a prompt string or a chat (list of messages); `chat=False` tokenizes a string as it is."""
    if not isinstance(prompt, str):
        if not chat:
            raise UserInputError("a chat (list of messages) can only be encoded with the chat template")
        return chat_ids(tokenizer, prompt)
    if chat:
        return prompt_ids(tokenizer, prompt)
    return list(tokenizer(prompt)["input_ids"])


def row_messages(
    row: dict,
    where: str,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    system_prompt: str | None = None,
) -> list[dict]:
    """The chat to format for one data row: its prompt (one user turn) or its chat minus a final
    assistant turn (that turn is what gets regenerated / generated).

    `where` names the row in error messages (`row 3 (id 'x')`). Raises one `UserInputError` line for a
    row with neither field, a malformed chat, or a chat that does not end with a user (or tool) turn.
    """
    msgs = row.get(messages_field)
    if msgs is not None:
        if not isinstance(msgs, (list, tuple)) or not msgs:
            raise UserInputError(
                f"{where}: malformed chat: '{messages_field}' must be a non-empty list of "
                f"{{'role', 'content'}} messages, got {type(msgs).__name__}"
            )
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise UserInputError(
                    f"{where}: malformed chat: message {j} must be {{'role': one of {ROLES}, 'content': str}}, "
                    f"got {m!r}"[:400]
                )
            out.append({"role": m["role"], "content": m["content"]})
        if out[-1]["role"] == "assistant":
            out = out[:-1]
        if not out or out[-1]["role"] not in ("user", "tool"):
            raise UserInputError(
                f"{where}: malformed chat: after dropping a final assistant turn the chat must end with a "
                "user (or tool) message"
            )
        if system_prompt and out[0]["role"] != "system":
            out = [{"role": "system", "content": system_prompt}, *out]
        return out
    prompt = row.get(prompt_field)
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserInputError(
            f"{where} has no '{prompt_field}' field (or it is empty / not a string) and no "
            f"'{messages_field}' chat: set prompt_field or messages_field to the column holding the prompt"
        )
    msgs = [{"role": "user", "content": prompt}]
    return [{"role": "system", "content": system_prompt}, *msgs] if system_prompt else msgs
