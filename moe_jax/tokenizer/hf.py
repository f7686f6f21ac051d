"""Hugging Face `tokenizers` tokenizers (tokenizer.json: BPE, byte-level BPE, WordPiece,
Unigram, ...), run by the library itself; batches are encoded by its parallel encoder."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer as _Library

from moe_jax.tokenizer.base import FileTokenizer
from moe_jax.tokenizer.files import HF_FILE
from moe_jax.tokenizer.simple import DataError


class HFTokenizer(FileTokenizer):
    kind = "hf"

    def __init__(self, files: dict[str, bytes], source: str):
        try:
            self.library = _Library.from_str(files[HF_FILE].decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DataError(
                f"'{source}' is not a valid Hugging Face tokenizer.json ({why}); give the "
                "tokenizer.json that `tokenizer.save()` or `save_pretrained()` wrote"
            ) from None
        # Ids may skip numbers (added tokens placed anywhere): the largest id bounds them.
        self.vocab_size = max(self.library.get_vocab(with_added_tokens=True).values()) + 1
        super().__init__(files, source, default_special={})

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[np.ndarray]:
        encodings = self.library.encode_batch_fast(
            list(texts), add_special_tokens=add_special_tokens
        )
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self.library.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        return self.library.token_to_id(token)
