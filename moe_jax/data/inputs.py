"""`moe_jax.prepare`'s inputs read as chunks of documents: text files (whole, or split at a
separator, read in blocks), JSONL and Parquet; UTF-8 and field errors as one-line DataErrors.

    check_inputs(paths, column)                      # before any work: they exist, the column
    for chunk in read_chunks(paths, column, sep):    # ~CHUNK_BYTES of documents each
        texts = chunk_texts(chunk, field)
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moe_jax.tokenizer import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_BYTES = 1 << 20  # documents per task: ~1 MiB of input, enough to amortise the IPC
TEXT_BLOCK = 1 << 20  # text files with a separator are read in blocks of this many bytes


@dataclass(frozen=True)
class Chunk:
    """Raw documents of one input, for a worker: `kind` says how to turn `items` into text."""

    kind: str  # text | jsonl | parquet
    source: str  # the input file, for error messages
    first_line: int  # JSONL: line number of items[0]
    items: list  # text: bytes; jsonl: raw lines (bytes); parquet: str
    n_bytes: int  # input bytes the chunk covers (the progress bar's unit)


def input_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def check_inputs(paths: list[Path], column: str) -> None:
    """Fail before any work on inputs that cannot be read (Parquet: a missing column)."""
    for p in paths:
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise DataError(f"input '{p}' {what}; pass text, JSONL or Parquet files")
        if input_kind(p) == "parquet":
            _parquet_schema_column(p, column)


def _parquet_schema_column(path: Path, column: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"input '{path}' is not a readable Parquet file ({e})") from None
    if column not in schema.names:
        names = ", ".join(schema.names[:10])
        raise DataError(
            f"Parquet file '{path}' has no column '{column}' (columns: {names}); pass --column NAME"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"column '{column}' of Parquet file '{path}' holds {kind}, not strings; "
            "pass --column with a text column"
        )


def _text_chunks(path: Path, separator: str | None) -> Iterator[Chunk]:
    source = str(path)
    if separator is None:  # one document: the whole file
        raw = path.read_bytes()
        yield Chunk("text", source, 0, [raw], len(raw))
        return
    # Blocks cut anywhere: split on the separator in decoded text, keep the tail for the next.
    decoder = codecs.getincrementaldecoder("utf-8")()
    tail, pieces, n_bytes, offset = "", [], 0, 0
    with open(path, "rb") as f:
        while block := f.read(TEXT_BLOCK):
            try:
                text = tail + decoder.decode(block)
            except UnicodeDecodeError as e:
                raise _not_utf8(source, block, e, offset) from None
            offset += len(block)
            *done, tail = text.split(separator)
            pieces += [d.encode("utf-8") for d in done]
            n_bytes += len(block)
            if n_bytes >= CHUNK_BYTES:
                yield Chunk("text", source, 0, pieces, n_bytes)
                pieces, n_bytes = [], 0
        try:
            tail += decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise _not_utf8(source, b"", e, offset) from None
    yield Chunk("text", source, 0, [*pieces, tail.encode("utf-8")], n_bytes)


def _jsonl_chunks(path: Path) -> Iterator[Chunk]:
    lines, n_bytes, first = [], 0, 1
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            lines.append(line)
            n_bytes += len(line)
            if n_bytes >= CHUNK_BYTES:
                yield Chunk("jsonl", str(path), first, lines, n_bytes)
                lines, n_bytes, first = [], 0, number + 1
    yield Chunk("jsonl", str(path), first, lines, n_bytes)


def _parquet_chunks(path: Path, column: str) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        size, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
        for batch in f.iter_batches(batch_size=1024, columns=[column]):
            texts = batch.column(0).to_pylist()
            yield Chunk("parquet", str(path), 0, texts, size * len(texts) // rows)


def read_chunks(paths: list[Path], column: str, separator: str | None) -> Iterator[Chunk]:
    for p in paths:
        kind = input_kind(p)
        if kind == "jsonl":
            yield from _jsonl_chunks(p)
        elif kind == "parquet":
            yield from _parquet_chunks(p, column)
        else:
            yield from _text_chunks(p, separator)


def _not_utf8(source: str, raw: bytes, e: UnicodeDecodeError, offset: int = 0) -> DataError:
    byte = f"byte 0x{raw[e.start]:02x} " if e.start < len(raw) else ""
    return DataError(
        f"input '{source}' is not valid UTF-8 ({byte}at offset {offset + e.start}); "
        "convert it to UTF-8 first"
    )


def chunk_texts(chunk: Chunk, field: str) -> list[str]:
    """The chunk's documents as text, empty ones dropped; DataError names file and line."""
    if chunk.kind == "parquet":
        return [t for t in chunk.items if t]  # None (a null) and "" are empty documents
    if chunk.kind == "text":
        texts = []
        for raw in chunk.items:
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise _not_utf8(chunk.source, raw, e) from None
        return [t for t in texts if t]
    texts = []
    for number, line in enumerate(chunk.items, chunk.first_line):
        if not line.strip():
            continue
        where = f"{chunk.source} line {number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            detail = str(e) if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise DataError(f"{where} is not JSON ({detail}); fix or remove the line") from None
        if not isinstance(record, dict) or field not in record:
            has = f"fields: {', '.join(list(record)[:10])}" if isinstance(record, dict) else ""
            raise DataError(
                f"{where} has no field '{field}' ({has or 'not a JSON object'}); pass --field NAME"
            )
        text = record[field]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field '{field}' is {type(text).__name__}, not a string; pass --field "
                "with a text field"
            )
        if text:
            texts.append(text)
    return texts
