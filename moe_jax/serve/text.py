"""Tokens to text as they arrive: each new token's text delta, with stop strings cut off.

The whole output is decoded again at each token (a byte-level tokenizer's character may span
tokens, and a BPE's decoder joins pieces), and a delta is only what the text gained; text
that ends in an unfinished character (U+FFFD) or could still grow into a stop string is held
back until the next token settles it, so the streamed deltas always concatenate to the final
text. A stop string ends the text before it (OpenAI's rule: the stop string is not returned).
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = ""  # the text handed out so far
        self.stopped = False  # a stop string was found: the text is final

    def push(self, token: int) -> str:
        """The delta `token` adds (may be empty); sets `stopped` on a stop string."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._advance(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._advance(text[: len(text) - self._held(text)])

    def finish(self) -> str:
        """The rest of the text once the request has ended (what was held back)."""
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.tokens))

    def _held(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # a decoder that rewrote earlier text: send none
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
