"""Tokenizers: text <-> int32 token ids, and the form a run saves them in.

    tok = load_tokenizer("byte")                 # UTF-8 bytes, vocabulary 256
    tok = load_tokenizer("models/qwen3")         # a directory with tokenizer.json (+ config)
    tok = load_tokenizer("spm/tokenizer.model")  # a SentencePiece model
    ids_T = tok.encode("text"); tok.decode(ids_T)
    ids = tok.encode_batch(texts)                # the library's parallel batch encoder
    ids_T = tok.encode(prompt, add_special_tokens=True)       # + BOS etc., as transformers adds
    tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))  # a chat prompt
    tok.eos_id, tok.bos_id                       # None where it has none
    tokenizer_from_dict(tok.to_dict(), RUN_DIR / "tokenizer")  # as saved with a checkpoint

Kinds (`tok.kind`):
- byte: UTF-8 bytes, vocabulary 256, any text (`simple.py`).
- char: the sorted characters of a corpus (`load_data` builds it from the corpus).
- hf: a Hugging Face `tokenizers` tokenizer.json (`hf.py`).
- sentencepiece: a SentencePiece .model (`spm.py`).
The file kinds read their special tokens and chat template from tokenizer_config.json,
special_tokens_map.json and chat_template.jinja/.json beside the model file (`base.py`); the
template renders as transformers renders it (`chat.py`). Tokenizing is the libraries' own
work: nothing here splits words into tokens.

Saved form: byte and char are wholly described by `to_dict()` (in every checkpoint's meta).
A file tokenizer's `to_dict()` is its kind and the SHA-256 of each file; the files are kept
in the run directory (RUN_DIR/tokenizer/, see `files.py` and moe_jax/run/checkpoints.py), and
`tokenizer_from_dict` reads them from there and checks them.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_jax.tokenizer.files import SPEC_HELP, find_files, read_saved
from moe_jax.tokenizer.hf import HFTokenizer
from moe_jax.tokenizer.simple import ByteTokenizer, CharTokenizer, DataError, decode_utf8
from moe_jax.tokenizer.spm import SentencePieceTokenizer

__all__ = [
    "ByteTokenizer",
    "CharTokenizer",
    "DataError",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "decode_utf8",
    "load_tokenizer",
    "tokenizer_from_dict",
]

Tokenizer = ByteTokenizer | CharTokenizer | HFTokenizer | SentencePieceTokenizer
FILE_KINDS = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer}


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names: "byte", or a path (a directory with tokenizer.json or
    tokenizer.model, or such a file). DataError naming the problem if it cannot be read."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        raise DataError("the char tokenizer is made from a corpus, not loaded; " + SPEC_HELP)
    kind, files, source = find_files(spec)
    return FILE_KINDS[kind](files, source)


def tokenizer_from_dict(d: dict, directory: str | Path | None = None) -> Tokenizer:
    """Inverse of `tokenizer.to_dict()` (the form saved in checkpoints); a file tokenizer's
    files are read from `directory` and must have the SHA-256s `d` records (DataError)."""
    kind = d.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind in FILE_KINDS and directory is not None:
        directory = Path(directory)
        return FILE_KINDS[kind](read_saved(directory, d["files"]), str(directory))
    raise DataError(
        f"unknown tokenizer {json.dumps(d)[:80]}; expected kind 'byte', 'char', 'hf' or "
        "'sentencepiece' (the last two with their files' directory)"
    )
