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


def row_conversation(
    row: dict,
    where: str,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    system_prompt: str | None = None,
    max_turns: int = 1,
) -> tuple[list[dict], list[str], str | None]:
    """One data row as a conversation: `(first-turn chat, later user turns, system text)`.

    - A `turns` row (a list of user texts, as `jetflow_pl.prompt_sets` gives; an optional `system`): its
      first turn, and its next `max_turns - 1` turns as later turns.
    - A chat row with `max_turns` > 1: its leading system message and its user turns in order (the source's
      assistant and tool turns are dropped: the model answers every turn itself), at most `max_turns`.
    - Otherwise `row_messages` (a prompt, or a chat minus a final assistant turn) with no later turns.

    `system_prompt` is used where the row brings no system text. Raises one `UserInputError` line naming
    the row for a malformed row.
    """
    if max_turns < 1:
        raise UserInputError(f"max_turns must be >= 1, got {max_turns}")
    turns = row.get("turns")
    if turns is not None or (max_turns > 1 and row.get(messages_field) is not None):
        system = row.get("system") if turns is not None else None
        if turns is None:
            # validated as a chat first (roles, text contents, ends with a user turn once a final
            # assistant turn is dropped), then reduced to its system text and user turns
            msgs = row_messages({messages_field: row[messages_field]}, where, prompt_field, messages_field)
            if msgs[0]["role"] == "system":
                system = msgs[0]["content"]
            turns = [m["content"] for m in msgs if m["role"] == "user"]
        if (
            not isinstance(turns, (list, tuple))
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise UserInputError(
                f"{where}: malformed conversation: 'turns' must be a non-empty list of texts"
            )
        if system is not None and not isinstance(system, str):
            raise UserInputError(f"{where}: malformed conversation: 'system' must be a string")
        system = system or system_prompt
        first = [{"role": "system", "content": system}] if system else []
        first.append({"role": "user", "content": turns[0]})
        return first, list(turns[1:max_turns]), system
    msgs = row_messages(row, where, prompt_field, messages_field, system_prompt)
    return msgs, [], None


#: a string no chat template writes or alters, marking where an assistant answer sits in a rendering
_ANSWER_MARK = "\u2063JETFLOW_ANSWER\u2063"


def next_turn_ids(
    tokenizer: Any,
    user_text: str,
    answer_ended_with: int | None = None,
    system: str | None = None,
) -> list[int]:
    """The ids that follow an assistant answer to close it and open the next turn: the template's text
    from the end of the answer's content through the next user turn to the opened assistant turn.

    `answer_ended_with` is the answer's last id when it was a stop id the model generated (e.g.
    `<|im_end|>`): when the template's text after the content starts with that token's text, it is not
    written twice. An answer cut at a length limit (None) gets the template's end-of-turn text.

    The template is rendered once with a marker as the earlier answer and the suffix after the marker is
    tokenized on its own. Chat templates end a turn with a special token, so the boundary is a token
    boundary; `tests/test_multiturn.py` checks that the ids equal a rendering of the whole conversation
    where the answer's text round-trips.
    """
    require_chat_template(tokenizer)
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _ANSWER_MARK},
        {"role": "user", "content": user_text},
    ]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if text.count(_ANSWER_MARK) != 1:
        raise UserInputError(
            "the chat template does not keep an earlier assistant answer verbatim, so a conversation "
            "cannot be continued with the model's own answers"
        )
    suffix = text.split(_ANSWER_MARK, 1)[1]
    if answer_ended_with is not None:
        stop_text = tokenizer.convert_ids_to_tokens(int(answer_ended_with))
        if isinstance(stop_text, str) and stop_text and suffix.startswith(stop_text):
            suffix = suffix[len(stop_text) :]
    return list(tokenizer(suffix, add_special_tokens=False)["input_ids"])


def continue_chat(
    tokenizer: Any,
    context_ids: Sequence[int],
    answer_ids: Sequence[int],
    user_text: str,
    stop_ids: Sequence[int] = (),
    system: str | None = None,
) -> list[int]:
    """The prompt ids of a conversation's next turn: the previous turn's prompt ids, the model's own
    answer ids exactly as generated, then `next_turn_ids` (the user's next turn, an opened assistant turn).

    The one way every stage continues a conversation (multi-turn regeneration, in process and through an
    endpoint, and `evaluate`'s MT-Bench second turns), so a head is trained and measured on the ids a
    multi-turn session really feeds the target.
    """
    last = int(answer_ids[-1]) if len(answer_ids) else None
    ended = last if last is not None and last in {int(s) for s in stop_ids} else None
    return [
        *map(int, context_ids),
        *map(int, answer_ids),
        *next_turn_ids(tokenizer, user_text, ended, system),
    ]
