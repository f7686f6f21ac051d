"""What the file tokenizers (Hugging Face, SentencePiece) share: their files, the special
tokens and chat template their config files name, the saved form, and the calls on top of
`encode` / `encode_batch`.

Special tokens and the chat template are read as transformers reads them: the named tokens
(`bos_token`, `eos_token`, ...; a string or an `{"content": ...}` object) from
tokenizer_config.json, overridden by special_tokens_map.json only when the config lacks
`added_tokens_decoder` (transformers' legacy rule); the template from chat_template.jinja,
else tokenizer_config.json's `chat_template` (a string, or named templates of which
"default" is used), else chat_template.json.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from moe_jax.tokenizer.chat import render
from moe_jax.tokenizer.files import hashes
from moe_jax.tokenizer.simple import DataError, decode_utf8

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class FileTokenizer(ABC):
    """Base of the tokenizers made from files. A subclass sets `kind` and, before calling
    this `__init__`, whatever its `token_to_id` needs."""

    kind: str
    vocab_size: int  # every id is below it

    def __init__(self, files: dict[str, bytes], source: str, default_special: dict[str, str]):
        """`default_special`: the special tokens the model file itself names (SentencePiece's
        <s>, </s>, <unk>), under the config files' ones."""
        self.files, self.source = files, source
        self.config = self._json("tokenizer_config.json")
        named = {k: v for k, v in self.config.items() if k in SPECIAL_TOKEN_NAMES and v}
        if "added_tokens_decoder" not in self.config:
            legacy = self._json("special_tokens_map.json")
            named |= {k: v for k, v in legacy.items() if k in SPECIAL_TOKEN_NAMES and v}
        self.special_tokens = default_special | {k: self._content(k, v) for k, v in named.items()}
        self.chat_template = self._template()
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")

    def _json(self, name: str) -> dict:
        if name not in self.files:
            return {}
        try:
            value = json.loads(self.files[name])
        except ValueError as e:
            raise DataError(f"{name} next to '{self.source}' is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise DataError(f"{name} next to '{self.source}' must hold a JSON object")
        return value

    def _content(self, key: str, value) -> str:
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            raise DataError(
                f"{key} in the config next to '{self.source}' must be a string or an object "
                f"with a string 'content', got {value!r:.60}"
            )
        return value

    def _template(self) -> str | None:
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"].decode("utf-8", errors="replace")
        template = self.config.get("chat_template")
        if template is None:
            template = self._json("chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise DataError(
                f"the chat template next to '{self.source}' must be a string, got "
                f"{type(template).__name__}"
            )
        return template

    def _special_id(self, key: str) -> int | None:
        """The id of the special token `key` names (None where it names none)."""
        token = self.special_tokens.get(key)
        if token is None:
            return None
        i = self.token_to_id(token)
        if i is None:
            raise DataError(
                f"{key} '{token}' of the config next to '{self.source}' is not in the "
                "tokenizer's vocabulary; fix that token in tokenizer_config.json"
            )
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """int32 ids of `text`; `add_special_tokens`: what the tokenizer wraps a sequence in
        (e.g. a BOS first), as transformers' `tokenizer(text)` adds them."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_bytes(self, raw: bytes, source: str = "text") -> np.ndarray:
        return self.encode(decode_utf8(raw, source, self.kind))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation (`[{"role": ..., "content": ...}, ...]`) as the chat template
        renders it; encode the result with `encode(text)` (the template writes its special
        tokens itself). DataError if the tokenizer has no template."""
        if self.chat_template is None:
            raise DataError(
                f"the tokenizer from '{self.source}' has no chat template (no "
                "chat_template.jinja, none in tokenizer_config.json); prompt with plain text"
            )
        return render(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "files": hashes(self.files)}

    @abstractmethod
    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[np.ndarray]:
        """int32 ids of each text, encoded in parallel by the library."""

    @abstractmethod
    def decode(self, ids) -> str:
        """The text of `ids`, special tokens left out (both libraries' default)."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a token's exact string, None if it has none."""
