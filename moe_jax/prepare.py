"""Prepared token datasets: `python -m moe_jax.prepare` writes the token store.

    python -m moe_jax.prepare books/*.txt web.jsonl wiki.parquet --tokenizer byte --out data/d1
    python train.py data.path=data/d1                      # packs its documents into windows

Inputs, each a stream of documents, read in the order given:
- text files: one document per file, or with `--separator S` one per piece between
  separators (e.g. `--separator '<|endoftext|>'`; read block by block, so a file of any size);
- JSONL (`*.jsonl`, `*.ndjson`): one document per line, the string field `--field` (default
  `text`); blank lines are skipped;
- Parquet (`*.parquet`): one document per row, the string column `--column` (default `text`),
  read one record batch at a time.
Empty documents are skipped. Each document is encoded on its own, framed as the tokenizer
frames a sequence (its special tokens, e.g. Llama's BOS), and ended by the tokenizer's
end-of-sequence token when it has one (byte and char have none), so a model trained on packed
windows learns where a document stops.

Streaming and cores: the main process only reads (raw lines, text blocks, Parquet batches) and
writes; chunks of about a MiB of documents go to `--workers` processes (default: every core)
that parse, decode and tokenize them. At most two chunks a worker are in flight and results
are written in input order, so memory stays bounded and the store does not depend on the
number of workers. The `char` tokenizer's alphabet is the corpus's, found in a first pass.

The store's format and its reader: `moe_jax/data/token_store.py`.

Safety: the store is written into a temporary sibling directory and renamed to `--out` only
when complete; an existing `--out` is refused. Bad input (a JSONL line that is not JSON or
lacks the field, a Parquet file without the column, text that is not UTF-8) stops with one
line naming the file and line, exit 2, and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moe_jax.data.inputs import Chunk, check_inputs, chunk_texts, read_chunks
from moe_jax.data.token_store import (
    DOCUMENTS_FILE,
    FORMAT,
    META_FILE,
    TOKENIZER_DIR,
    TOKENS_FILE,
    describe_tokenizer,
    store_dtype,
    tokenizer_hash,
)
from moe_jax.run.door import HelpFormatter, command, writes
from moe_jax.run.output import (
    new_output,
    pid_alive,
    signals_deferred,
    worker_signals,
)
from moe_jax.tokenizer import (
    CharTokenizer,
    DataError,
    Tokenizer,
    load_tokenizer,
    tokenizer_from_dict,
)
from moe_jax.tokenizer.files import write_files


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text as one document: encoded as the tokenizer frames a sequence (its special
    tokens, e.g. a BOS first) by its batch encoder, then ended by EOS unless it ends so."""
    docs = tok.encode_batch(texts, add_special_tokens=True)
    if tok.eos_id is None:
        return docs
    return [d if len(d) and d[-1] == tok.eos_id else np.append(d, tok.eos_id) for d in docs]


# ----------------------------------------------------------------------------- encoding

_worker: dict = {}  # the tokenizer and settings of this worker process (set by the pool)


def _init_worker(tok: Tokenizer, field: str, dtype: np.dtype) -> None:
    _worker.update(tok=tok, field=field, dtype=dtype)


def _recipe(tok: Tokenizer) -> tuple:
    """(function, args) that rebuild `tok` in a worker: a file tokenizer from its files (the
    libraries' objects need not pickle), byte and char from their saved form."""
    if tok.files:
        return type(tok), (tok.files, tok.source)
    return tokenizer_from_dict, (tok.to_dict(),)


def _init_pool_worker(recipe: tuple, field: str, dtype: np.dtype, parent: int) -> None:
    # HF tokenizers would start a thread pool in each worker: the workers already use the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A worker outlives a parent killed with -9 (it waits on its queue for ever, and keeps the
    # fork server and the resource tracker alive): it exits once `parent` is gone.
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    worker_signals()
    make, args = recipe
    _init_worker(make(*args), field, dtype)


def _exit_with(parent: int) -> None:
    while pid_alive(parent):
        time.sleep(0.5)
    os._exit(1)


def encode_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """-> (the chunk's documents' tokens back to back, each document's length)."""
    tok, dtype = _worker["tok"], _worker["dtype"]
    docs = encode_documents(tok, chunk_texts(chunk, _worker["field"]))
    lengths = np.array([len(d) for d in docs], np.int64)
    tokens = np.concatenate(docs).astype(dtype) if docs else np.zeros(0, dtype)
    return tokens, lengths


def _finished(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def _start_quiet_resource_tracker() -> None:
    """multiprocessing's resource tracker outlives a command killed with -9 and frees the
    pool's semaphores, warning once per command on the terminal that it did ('There appear
    to be 5 leaked semaphore objects'): the kill was the user's, the cleanup is expected.
    The tracker is a process of its own that reads its warning filters from the environment
    at start, so it starts here, with the filter, if it does not run yet."""
    before = os.environ.get("PYTHONWARNINGS")
    quiet = "ignore:resource_tracker:UserWarning"
    os.environ["PYTHONWARNINGS"] = f"{before},{quiet}" if before else quiet
    try:
        resource_tracker.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before


@contextlib.contextmanager
def _encoder(tok: Tokenizer, field: str, dtype: np.dtype, workers: int):
    """A function chunk -> Future of `encode_chunk(chunk)`: run by a pool of worker processes,
    or in-process when `workers` is 1 (then a tokenizer's own batch parallelism is the only
    one). A worker that dies or fails to start raises BrokenProcessPool, never hangs."""
    if workers == 1:
        _init_worker(tok, field, dtype)
        yield lambda chunk: _finished(encode_chunk(chunk))
        return
    # Not forked from this process: once JAX runs (a notebook, the tests) it has threads, and
    # a fork can inherit a lock some thread holds. A fork server is a fresh process that has
    # imported this module once; the workers fork from it in milliseconds.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    _start_quiet_resource_tracker()
    # The workers are started before a stopping signal counts: one cut off half-started
    # would not be the pool's to join.
    pool = None
    try:
        with signals_deferred():  # a signal held back is raised as the block ends
            pool = ProcessPoolExecutor(
                workers,
                context,
                initializer=_init_pool_worker,
                initargs=(_recipe(tok), field, dtype, os.getpid()),
            )
            for _ in range(workers):  # each submit with no idle worker starts one
                pool.submit(int)
        yield lambda chunk: pool.submit(encode_chunk, chunk)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


# ----------------------------------------------------------------------------- writing


def char_alphabet(paths: list[Path], field: str, column: str, separator: str | None) -> str:
    """The sorted characters of the corpus (the char tokenizer's vocabulary): a first pass."""
    chars: set[str] = set()
    for chunk in read_chunks(paths, column, separator):
        for text in chunk_texts(chunk, field):
            chars.update(text)
    if not chars:
        raise DataError("the inputs hold no text; nothing to prepare")
    return "".join(sorted(chars))


def prepare(
    inputs: list[str],
    tok: Tokenizer,
    out: str,
    *,
    field: str = "text",
    column: str = "text",
    separator: str | None = None,
    workers: int = 1,
    progress: bool = False,
) -> dict:
    """Tokenize `inputs` into a new store at `out` -> its metadata. DataError on bad input
    (nothing is left on disk then)."""
    out_dir = Path(out)
    refuse_existing(out_dir)
    paths = [Path(p) for p in inputs]
    check_inputs(paths, column)
    dtype = store_dtype(tok.vocab_size)
    with new_output(out_dir, f"--out '{out}'") as tmp:
        meta = _write_store(tmp, paths, tok, dtype, field, column, separator, workers, progress)
        meta["inputs"] = [str(p) for p in paths]
        if tok.files:  # the store is self-contained, like a run directory
            write_files(tok.files, tmp / TOKENIZER_DIR)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        if out_dir.exists():  # made by someone else while this ran
            raise DataError(f"--out '{out}' appeared while preparing; nothing written")
    return meta


def refuse_existing(out_dir: Path) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        raise DataError(f"--out '{out_dir}' already exists; choose a new directory or remove it")


def _write_store(tmp, paths, tok, dtype, field, column, separator, workers, progress) -> dict:
    tokens_digest, docs_digest = hashlib.sha256(), hashlib.sha256()
    n_tokens, n_docs = 0, 0
    total = sum(p.stat().st_size for p in paths)
    # disable=None: shown on a terminal only
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="prepare", disable=None if progress else True
    )
    with (
        open(tmp / TOKENS_FILE, "wb") as tokens_f,
        open(tmp / DOCUMENTS_FILE, "wb") as docs_f,
        _encoder(tok, field, dtype, workers) as submit,
        bar,
    ):

        def write(chunk: Chunk, result) -> None:
            nonlocal n_tokens, n_docs
            tokens, lengths = result.result()
            starts = (n_tokens + np.cumsum(lengths) - lengths).astype("<i8")
            tokens.tofile(tokens_f)
            starts.tofile(docs_f)
            tokens_digest.update(tokens.tobytes())
            docs_digest.update(starts.tobytes())
            n_tokens += len(tokens)
            n_docs += len(lengths)
            bar.update(chunk.n_bytes)

        pending: deque = deque()
        for chunk in read_chunks(paths, column, separator):
            pending.append((chunk, submit(chunk)))
            if len(pending) > 2 * workers:
                write(*pending.popleft())
        while pending:
            write(*pending.popleft())
        if n_docs == 0:
            raise DataError("the inputs hold no non-empty document; nothing to prepare")
        np.array([n_tokens], "<i8").tofile(docs_f)
    fingerprint = hashlib.sha256(tokens_digest.digest() + docs_digest.digest()).hexdigest()
    return {
        "format": FORMAT,
        "tokenizer": tok.to_dict(),
        "tokenizer_kind": tok.kind,
        "tokenizer_hash": tokenizer_hash(tok),
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "dtype": dtype.str,
        "tokens": n_tokens,
        "documents": n_docs,
        "tokens_file": TOKENS_FILE,
        "documents_file": DOCUMENTS_FILE,
        "fingerprint": fingerprint[:16],
    }


# ----------------------------------------------------------------------------- CLI


def make_tokenizer(
    spec: str, paths: list[Path], field: str, column: str, separator: str | None
) -> Tokenizer:
    if spec == "char":
        return CharTokenizer(char_alphabet(paths, field, column, separator))
    return load_tokenizer(spec)


@command
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="moe-jax prepare",
        formatter_class=HelpFormatter,
        description="Tokenize text, JSONL and Parquet files into a prepared dataset directory "
        "that `train.py data.path=DIR` trains on.",
    )
    p.add_argument("inputs", nargs="+", help="text, JSONL (*.jsonl) or Parquet (*.parquet) files")
    p.add_argument(
        "--tokenizer",
        required=True,
        help="byte, char, or a tokenizer: tokenizer.json (Hugging Face), tokenizer.model "
        "(SentencePiece), or a directory holding one",
    )
    p.add_argument("--out", required=True, help="new directory for the prepared dataset")
    p.add_argument("--field", default="text", help="JSONL: the field holding the text")
    p.add_argument("--column", default="text", help="Parquet: the column holding the text")
    p.add_argument(
        "--separator",
        help="text files: split documents at this string (default: one document per file)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="tokenizing processes (default: every core)",
    )
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.separator == "":
        p.error("--separator must not be empty")
    writes(args.out)
    refuse_existing(Path(args.out))  # before the char tokenizer's pass over the inputs
    paths = [Path(i) for i in args.inputs]
    check_inputs(paths, args.column)
    tok = make_tokenizer(args.tokenizer, paths, args.field, args.column, args.separator)
    meta = prepare(
        args.inputs,
        tok,
        args.out,
        field=args.field,
        column=args.column,
        separator=args.separator,
        workers=args.workers,
        progress=True,
    )
    print(
        f"wrote {args.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens "
        f"({meta['dtype']}), tokenizer {describe_tokenizer(tok)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
