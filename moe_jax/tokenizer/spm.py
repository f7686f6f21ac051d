"""SentencePiece tokenizers (a `.model` proto: BPE or Unigram), run by the `sentencepiece`
library itself; batches are encoded by its multi-threaded encoder.

Two things transformers does on top of the library, done here too: special tokens are
matched in the text (the library would spell out "<s>" piece by piece, where a chat template
writes it), and `add_special_tokens` adds BOS / EOS as tokenizer_config.json's `add_bos_token` /
`add_eos_token` say (default: neither, the library's default).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import sentencepiece

from moe_jax.tokenizer.base import FileTokenizer
from moe_jax.tokenizer.files import SP_FILE
from moe_jax.tokenizer.simple import DataError


class SentencePieceTokenizer(FileTokenizer):
    kind = "sentencepiece"

    def __init__(self, files: dict[str, bytes], source: str):
        try:
            sp = sentencepiece.SentencePieceProcessor(model_proto=files[SP_FILE])
        except Exception as e:  # RuntimeError, or TypeError for a proto it cannot even read
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DataError(
                f"'{source}' is not a valid SentencePiece model ({why}); give the .model file "
                "that SentencePieceTrainer wrote"
            ) from None
        self.library, self.vocab_size = sp, sp.get_piece_size()
        # The control pieces (<s>, </s>, ...) the library never produces from text.
        self._control = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i)}
        alternatives = "|".join(map(re.escape, sorted(self._control, key=len, reverse=True)))
        self._split = re.compile(f"({alternatives})") if alternatives else None
        own = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id()}
        super().__init__(files, source, {k: sp.id_to_piece(i) for k, i in own.items() if i >= 0})
        self._wrap = (
            [self.bos_id] if self.config.get("add_bos_token") and self.bos_id is not None else [],
            [self.eos_id] if self.config.get("add_eos_token") and self.eos_id is not None else [],
        )

    def _segments(self, text: str) -> list[str | int]:
        """`text` cut into plain text and control-token ids."""
        if self._split is None:
            return [text]
        parts = self._split.split(text)  # text, token, text, token, ..., text
        return [self._control[p] if i % 2 else p for i, p in enumerate(parts) if p]

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[np.ndarray]:
        segmented = [self._segments(t) for t in texts]
        plain = [s for segments in segmented for s in segments if isinstance(s, str)]
        encoded = iter(self.library.encode(plain, out_type=int))  # one threaded batch
        head, tail = self._wrap if add_special_tokens else ([], [])
        out = []
        for segments in segmented:
            ids = list(head)
            for s in segments:
                ids += [s] if isinstance(s, int) else next(encoded)
            out.append(np.asarray(ids + tail, np.int32))
        return out

    def decode(self, ids) -> str:
        return self.library.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self.library.piece_to_id(token)  # the unknown id for a piece it does not have
        return i if self.library.id_to_piece(i) == token else None
