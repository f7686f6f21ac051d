"""Tokenizers: text <-> int32 token ids, and the form a run saves them in.

tok = ByteTokenizer()                       # UTF-8 bytes, vocabulary 256
ids_T = tok.encode("text"); tok.decode(ids_T)
tokenizer_from_dict(tok.to_dict())          # the form saved in every checkpoint's meta
"""

from __future__ import annotations

import json

import numpy as np


class DataError(ValueError):
    """Unusable input data; the message names the problem and the fix."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, encodes any text."""

    kind = "byte"
    vocab_size = 256

    def encode_bytes(self, raw: bytes, source: str = "text") -> np.ndarray:
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A window may cut a multi-byte character; show it as U+FFFD rather than fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": self.kind}


class CharTokenizer:
    """One token per character of a fixed alphabet (the sorted characters of a corpus)."""

    kind = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def encode_bytes(self, raw: bytes, source: str = "text") -> np.ndarray:
        return self.encode(decode_utf8(raw, source))

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.fromiter((self._index[c] for c in text), np.int32, len(text))
        except KeyError:
            unknown = sorted(set(text) - set(self._index))
            shown = ", ".join(repr(c) for c in unknown[:10])
            raise DataError(
                f"{len(unknown)} character(s) not in the char tokenizer's vocabulary: {shown}; "
                "use only characters of the training corpus, or train with data.tokenizer=byte"
            ) from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


Tokenizer = ByteTokenizer | CharTokenizer


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """Inverse of `tokenizer.to_dict()` (the form saved in checkpoints)."""
    if d.get("kind") == "byte":
        return ByteTokenizer()
    if d.get("kind") == "char":
        return CharTokenizer(d["chars"])
    raise DataError(f"unknown tokenizer {json.dumps(d)[:80]}; expected kind 'byte' or 'char'")


def decode_utf8(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{source} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); the "
            "char tokenizer needs UTF-8 text: fix the file or use data.tokenizer=byte"
        ) from None
