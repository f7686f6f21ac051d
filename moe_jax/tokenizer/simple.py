"""The built-in tokenizers, which need no files: `byte` (UTF-8 bytes) and `char` (the sorted
characters of a corpus); and DataError (data_error.py), the error of unusable input data."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_jax.tokenizer.data_error import DataError  # noqa: F401 (imported from here too)

# The built-in tokenizers' chat template: plain text, a turn a line ("user: Hi"), the reply
# after "assistant: ", so that a chat request or chat SFT rows work on the default model. No
# special tokens (these tokenizers have none): a reply ends at max_tokens, or at a stop string.
# Only letters, ":", " " and newlines: a char tokenizer's alphabet may lack anything else.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


class _Builtin:
    """What the built-in tokenizers lack next to the file tokenizers: special tokens and files
    (`add_special_tokens` is accepted for the same calls, and adds none); their chat template
    is BUILTIN_CHAT_TEMPLATE."""

    bos_id: int | None = None
    eos_id: int | None = None
    chat_template: str = BUILTIN_CHAT_TEMPLATE
    files: dict[str, bytes] = {}  # nothing to keep beside the checkpoint meta (never mutated)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False):
        return [self.encode(t) for t in texts]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from moe_jax.tokenizer.chat import render  # chat.py imports this module

        return render(self.chat_template, messages, add_generation_prompt, {})


class ByteTokenizer(_Builtin):
    """UTF-8 bytes as tokens: vocabulary 256, encodes any text."""

    kind = "byte"
    vocab_size = 256

    def encode_bytes(self, raw: bytes, source: str = "text") -> np.ndarray:
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A window may cut a multi-byte character; show it as U+FFFD rather than fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": self.kind}


class CharTokenizer(_Builtin):
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

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
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


def decode_utf8(raw: bytes, source: str, kind: str = "char") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{source} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); the "
            f"{kind} tokenizer needs UTF-8 text: fix the file or use data.tokenizer=byte"
        ) from None
