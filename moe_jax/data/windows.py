"""What the datasets share: each process's rows of a global batch, the splits' fit check, the
unigram baseline, packed windows of documents and their batches, and the padded length of a
row (`bucket`), which sampling's prompts, GRPO's prompts and eval's requests share."""

from __future__ import annotations

import math

import grain
import numpy as np

from moe_jax.config import Config
from moe_jax.tokenizer import DataError

MIN_BUCKET = 16  # shortest padded length: shorter rows share its program


def bucket(length: int, limit: int, minimum: int = MIN_BUCKET) -> int:
    """`length` padded up: the next power of two, at least `minimum`, at most `limit`, so that
    a handful of compiled programs serve every length."""
    return min(max(minimum, 1 << math.ceil(math.log2(max(length, 1)))), limit)


def local_rows(global_batch: int, process_index: int, process_count: int) -> slice:
    if global_batch % process_count:
        raise DataError(
            f"train.batch_size ({global_batch}) must be divisible by the number of processes "
            f"({process_count})"
        )
    b = global_batch // process_count
    return slice(process_index * b, (process_index + 1) * b)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats/token) of the unigram distribution of `tokens`."""
    counts = np.bincount(np.ravel(tokens), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def check_split_fits(what: str, n: int, n_train: int, cfg: Config, verb: str, of="") -> None:
    """DataError unless both splits of `n` tokens (`n_train` for training) hold a window."""
    window, f = cfg.train.seq_len + 1, cfg.data.val_fraction
    if min(n_train, n - n_train) < window:
        need = math.ceil(window / min(f, 1 - f))
        raise DataError(
            f"{what} has {n} tokens: too short for one window of train.seq_len+1 = {window} "
            f"tokens in both the train and the validation split (data.val_fraction={f}); "
            f"{verb} at least {need} tokens{' ' + of if of else ''} or lower train.seq_len"
        )


def pack_window(
    tokens: np.ndarray,
    doc_starts: np.ndarray,
    start: int,
    length: int,
    document_mask: bool = True,
    document_positions: bool = True,
) -> dict[str, np.ndarray]:
    """The window tokens[start : start + length] of a packed token stream whose documents begin
    at `doc_starts`, as a dict of int32 [length] arrays: "tokens", and with `document_mask`
    "segments" (1, 2, ... for the documents, or pieces of documents, in the window), with
    `document_positions` "positions" (0 at every document start; a document that began before
    the window counts from 0 at the window's start, as the model sees no more of it)."""
    end = start + length
    first = int(np.searchsorted(doc_starts, start, side="right")) - 1  # holds tokens[start]
    last = int(np.searchsorted(doc_starts, end - 1, side="right"))  # one past tokens[end-1]'s
    cuts = np.asarray(doc_starts[first + 1 : last]) - start  # documents starting inside
    example = {"tokens": np.asarray(tokens[start:end], np.int32)}
    piece_K = np.zeros(length, np.int32)  # piece k of the window: 0, 1, ...
    piece_K[cuts] = 1
    piece_K = np.cumsum(piece_K, dtype=np.int32)
    if document_mask:
        example["segments"] = piece_K + 1
    if document_positions:
        piece_start = np.concatenate([[0], cuts]).astype(np.int32)
        example["positions"] = np.arange(length, dtype=np.int32) - piece_start[piece_K]
    return example


def batch_examples(
    examples: grain.MapDataset, global_batch: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
    """Global batches of consecutive examples (dicts of equal-shape arrays), stacked; process p
    of P reads only its rows [p * B/P, (p+1) * B/P) of each."""
    rows = local_rows(global_batch, process_index, process_count)

    def read(ids_B: np.ndarray) -> dict[str, np.ndarray]:
        picked = [examples[int(i)] for i in ids_B[rows]]
        return {k: np.stack([e[k] for e in picked]) for k in picked[0]}

    return grain.MapDataset.range(len(examples)).batch(global_batch).map(read)
