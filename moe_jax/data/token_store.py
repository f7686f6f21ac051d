"""The prepared token store (`python -m moe_jax.prepare` writes it): its format and reader.

    store = TokenStore.open("data/d1")                     # memory-mapped, random access
    store.tokens[a:b]; store.doc_starts; store.meta

The store (a directory):
    tokens.bin       every document's tokens back to back, in input order; dtype the smallest
                     unsigned integer that holds the vocabulary (uint8 for bytes, else uint16
                     or uint32), little-endian
    documents.bin    int64 start offset of each document in tokens.bin, then the token count
                     (documents + 1 values): the document boundaries
    prepared.json    metadata: format, tokenizer (its saved form, kind and hash), dtype, token
                     and document counts, inputs, and a SHA-256 fingerprint of both files
    tokenizer/       a file tokenizer's files (as in a run directory), so the store is
                     self-contained and `train.py` checks it against the run's tokenizer

Why a memory-mapped token file and not ArrayRecord: training packs documents into windows of
`seq_len + 1` tokens that start anywhere in the token stream and cross document boundaries.
In one flat token file a window is one slice (a copy out of the page cache) and its segment
ids follow from a binary search in the document index. ArrayRecord stores records (here:
documents) in compressed chunks, so a window would decode and join every record it touches,
and finding the record that holds token n needs an index of our own anyway. The flat file
needs no serialisation (it is the array), is written append-only while streaming and is read
by numpy with no extra package; what ArrayRecord adds (records of any type, compression) a
fixed-width token stream does not need. The cost: no compression (1-4 bytes a token).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_jax.tokenizer import DataError, Tokenizer, tokenizer_from_dict

FORMAT = "moe_jax.prepared/1"
META_FILE = "prepared.json"
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"
TOKENIZER_DIR = "tokenizer"  # a file tokenizer's files, as in a run directory


def tokenizer_hash(tok: Tokenizer) -> str:
    """SHA-256 of the tokenizer's saved form (byte, char: the whole tokenizer; file tokenizers:
    the SHA-256 of each file, as a run's checkpoints record them): equal hashes, equal ids."""
    return hashlib.sha256(json.dumps(tok.to_dict(), sort_keys=True).encode()).hexdigest()


def describe_tokenizer(tok: Tokenizer) -> str:
    return f"{tok.kind} (vocabulary {tok.vocab_size}, sha256 {tokenizer_hash(tok)[:12]})"


def store_dtype(vocab_size: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype).newbyteorder("<")
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit 32-bit token ids")


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


@dataclass(frozen=True)
class TokenStore:
    """A prepared directory, memory-mapped: `tokens` [N] and `doc_starts` [D + 1] (int64)."""

    path: Path
    meta: dict
    tokens: np.ndarray
    doc_starts: np.ndarray

    @classmethod
    def open(cls, path: str | Path) -> TokenStore:
        path = Path(path)
        if not is_prepared(path):
            raise DataError(
                f"'{path}' is not a prepared dataset (no {META_FILE}); make one with "
                f"`python -m moe_jax.prepare FILES... --tokenizer SPEC --out {path}`"
            )
        try:
            meta = json.loads((path / META_FILE).read_text())
            dtype = np.dtype(meta["dtype"])
            tokens = np.memmap(path / meta["tokens_file"], dtype, mode="r")
            doc_starts = np.memmap(path / meta["documents_file"], "<i8", mode="r")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"prepared dataset '{path}' is damaged ({type(e).__name__}: {e}); prepare it again"
            ) from None
        if (
            meta.get("format") != FORMAT
            or len(tokens) != meta["tokens"]
            or len(doc_starts) != meta["documents"] + 1
        ):
            raise DataError(
                f"prepared dataset '{path}' is damaged or of another format (its files do not "
                f"match {META_FILE}); prepare it again"
            )
        return cls(path, meta, tokens, doc_starts)

    @property
    def tokenizer(self) -> Tokenizer:
        try:
            return tokenizer_from_dict(self.meta["tokenizer"], self.path / TOKENIZER_DIR)
        except DataError as e:
            raise DataError(f"prepared dataset '{self.path}': {e}") from None
