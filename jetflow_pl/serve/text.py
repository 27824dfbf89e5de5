"""Token ids -> text as they arrive, and the `stop` strings of an OpenAI request.

The engine stops on token ids; a client's `stop` is text, and a stop string can span several tokens or
end inside one. So the request's text is decoded from all its tokens so far (a byte-level BPE piece may
be half a UTF-8 character until the next token arrives, which decodes as U+FFFD), and only text that can
no longer change is released: nothing after an incomplete character, nothing that might be the start of
a stop string. When a stop string appears the text is cut before it and the request is over (the server
cancels the engine request: the tokens drawn after it are never sent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenization of one request with OpenAI `stop` semantics.

    `push(tokens)` returns the text delta that is safe to send; `stopped` tells whether a stop string
    was found (then `text` ends just before it and `tokens` ends with the token that completed it: the
    tokens drawn after it are dropped); `finish()` releases what was held back once the request has
    ended for another reason.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far (cut at a stop string)
        self.sent = 0  # characters of `text` already returned
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int:
        """Where the earliest stop string starts in `text` (-1: none)."""
        return min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` that may still change or start a stop string."""
        hold = 0
        if text.endswith(_REPLACEMENT):  # an incomplete multi-byte character: the next token completes it
            hold = len(text) - len(text.rstrip(_REPLACEMENT))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def push(self, tokens: Sequence[int]) -> str:
        """Add the request's new tokens; return the new text that can be sent now."""
        if self.stopped:
            return ""
        before = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        text = self._decode()
        cut = self._find_stop(text)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            # keep the tokens up to the one that completed the stop string (what usage counts)
            for k in range(before + 1, len(self.tokens)):
                if self._find_stop(self.tokenizer.decode(self.tokens[:k], skip_special_tokens=True)) >= 0:
                    del self.tokens[k:]
                    break
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._held_back(text))

    def finish(self) -> str:
        """The request ended (EOS, length, stop string): release everything still held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out
