"""Corpora and the Grain input pipeline (tokenizers: `moe_jax.tokenizer`).

    data = load_data(cfg)                      # corpus -> tokenizer -> train / validation tokens
    it = data.train_iterator(cfg)              # (process_index, process_count)
    batch = next(it)                           # text: int32 [local batch, seq_len + 1];
                                               # prepared: a dict of such arrays (below)
    state = it.get_state(); it.set_state(state)  # exact position, saved in every checkpoint
    val = data.eval_batches(cfg)               # fixed validation batches, same form

Corpus: the text files named by `data.path` (files or globs, comma separated, read in the order
given, each glob's matches sorted), or, when `data.path` is null, the *embedded* corpus: the
Python standard library's own top-level `.py` sources, whole files in sorted order up to
`data.embedded_max_bytes`. Every Python install has them, so the default run needs no download,
and the same install always yields the same bytes (the SHA-256 fingerprint is logged and saved).

Tokenizers (`moe_jax.tokenizer`): `byte` (UTF-8 bytes, vocabulary 256, any input), `char` (the
sorted set of characters of the corpus), or a path to a Hugging Face tokenizer.json or a
SentencePiece model (or a directory with one). The tokenizer is saved with every checkpoint
(a file tokenizer's files in RUN_DIR/tokenizer/) so sampling decodes exactly as training
encoded.

Split: the last `val_fraction` of the token stream is the validation split.

Training windows (text): every start offset of a `seq_len + 1` window in the train split is one
example; Grain shuffles the offsets with the run's seed (a fresh permutation each epoch) and
batches them into global batches of `batch_size`. Process p of P keeps rows
[p * B/P, (p+1) * B/P) of each global batch, so the global batch (rows included, in order) is
the same whatever the number of processes. The iterator's state is the index of the next
batch, restored exactly by `set_state`.

Validation: a fixed, seed-independent set of evenly spaced windows, so runs with different
seeds are evaluated on the same tokens.

Prepared data (`python -m moe_jax.prepare`, see there for the store): `data.path=DIR` names
one prepared directory (one holding prepared.json), `data.mixture="DIR:W,DIR:W"` several
sampled by weight. Their tokenizer must be the run's: `data.tokenizer` (byte and char by
kind, a tokenizer file by hash), and when resuming the run's saved one; mixed dirs share one.
- Split: per directory, the last `val_fraction` of its token stream (as for text files; the
  document cut there is two documents, one in each split).
- Packing: documents lie back to back in the stream, so a window of `seq_len + 1` tokens
  holds the end of one document, whole ones, the start of another. Train windows start every
  `seq_len` tokens (each train token but the first is a target once an epoch), shuffled with
  the run's seed, a fresh order each epoch. An example is a dict of int32 [seq_len + 1]
  arrays (`pack_window`): "tokens"; "segments" with `data.document_mask` (1, 2, ... for the
  documents of the window: attention and the loss stay within one); "positions" with
  `data.document_positions` (0 at each document start; a document continued from before
  the window counts from 0 too). Batches stack examples into dicts of [local batch,
  seq_len + 1] arrays (`batch_examples`, which any dataset of such examples can use).
- Mixture: Grain's `MapDataset.mix` interleaves the directories' example streams by weight,
  deterministically by index, so the iterator state (the next batch's index) resumes a
  mixture exactly too.
- Validation: each directory's share of the `eval_batches * batch_size` windows (by weight)
  evenly spaced over its validation split; the unigram baseline is that of these windows.
"""

from __future__ import annotations

import glob
import hashlib
import math
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from moe_jax.config import Config
from moe_jax.prepare import META_FILE, TokenStore, describe_tokenizer, is_prepared, tokenizer_hash
from moe_jax.tokenizer import (
    CharTokenizer,
    DataError,
    Tokenizer,
    decode_utf8,
    load_tokenizer,
)

# ----------------------------------------------------------------------------- corpora


@dataclass(frozen=True)
class Source:
    name: str  # file path, or "embedded:stdlib" for the embedded corpus
    raw: bytes


def embedded_sources(max_bytes: int) -> list[Source]:
    """The standard library's top-level `.py` files, sorted by name, whole, up to `max_bytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        raw = path.read_bytes()
        if total + len(raw) > max_bytes:
            break
        sources.append(Source(f"embedded:stdlib/{path.name}", raw))
        total += len(raw)
    if not sources:
        raise DataError(
            f"no Python standard-library source under {stdlib} fits in "
            f"data.embedded_max_bytes={max_bytes}; raise it, or pass text with data.path=..."
        )
    return sources


def file_sources(path_spec: str) -> list[Source]:
    """Files named by a comma-separated list of paths or globs, in order."""
    sources = []
    for spec in (s.strip() for s in path_spec.split(",")):
        if not spec:
            continue
        matches = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matches:
            raise DataError(f"data.path glob '{spec}' matches no file; check the pattern")
        for name in matches:
            p = Path(name)
            if not p.is_file():
                what = f"is a directory without {META_FILE}" if p.is_dir() else "does not exist"
                raise DataError(
                    f"data file '{name}' {what}; pass text files or globs in data.path, a "
                    "directory made by `python -m moe_jax.prepare`, or data.path=null for the "
                    "embedded corpus"
                )
            try:
                raw = p.read_bytes()
            except OSError as e:
                raise DataError(f"cannot read data file '{name}': {e.strerror}") from None
            if not raw:
                raise DataError(f"data file '{name}' is empty; give it some text or drop it")
            sources.append(Source(name, raw))
    if not sources:
        raise DataError(f"data.path '{path_spec}' names no file")
    return sources


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Data:
    tokenizer: Tokenizer
    train: np.ndarray  # int32 tokens of the train split
    val: np.ndarray  # int32 tokens of the validation split
    description: str  # where the text came from, for the log
    fingerprint: str  # SHA-256 prefix of the raw corpus bytes

    @property
    def val_unigram_entropy(self) -> float:
        """Entropy (nats/token) of the validation split's own unigram distribution.

        No model that ignores context can reach a lower validation loss, so a model that
        learned anything must end clearly below it.
        """
        return unigram_entropy(self.val, self.tokenizer.vocab_size)

    @property
    def n_train_tokens(self) -> int:
        return len(self.train)

    @property
    def n_val_tokens(self) -> int:
        return len(self.val)

    def train_iterator(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """`train_iterator` over the train split with `cfg`'s shapes, seed and threads."""
        t = cfg.train
        return train_iterator(
            self.train,
            t.seq_len,
            t.batch_size,
            cfg.seed,
            process_index,
            process_count,
            cfg.data.num_workers,
        )

    def eval_batches(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """`eval_batches` of the validation split with `cfg`'s shapes."""
        t = cfg.train
        return eval_batches(
            self.val, t.seq_len, t.batch_size, t.eval_batches, process_index, process_count
        )


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


def load_data(cfg: Config, tokenizer: Tokenizer | None = None) -> Data | PreparedData:
    """Read the corpus, tokenize it (with `tokenizer`, e.g. a run's saved one, else a new one
    of kind `data.tokenizer`) and split it; or open the prepared dataset(s) (`load_prepared`).
    Raises DataError with the fix on bad input."""
    d = cfg.data
    if d.mixture is not None:
        return load_prepared(cfg, d.mixture_entries, tokenizer)
    if d.path is not None and is_prepared(d.path.strip()):
        return load_prepared(cfg, [(d.path.strip(), 1.0)], tokenizer)
    if d.path is None:
        sources = embedded_sources(d.embedded_max_bytes)
        description = (
            f"embedded corpus: {len(sources)} Python standard-library files "
            f"({sources[0].name.split('/')[-1]} .. {sources[-1].name.split('/')[-1]})"
        )
    else:
        sources = file_sources(d.path)
        description = ", ".join(s.name for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
    if tokenizer is None:
        if d.tokenizer == "char":
            tokenizer = CharTokenizer.from_text(
                "".join(decode_utf8(s.raw, f"data file '{s.name}'") for s in sources)
            )
        else:
            tokenizer = load_tokenizer(d.tokenizer)  # byte, or a tokenizer file / directory
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the {tokenizer.kind} tokenizer has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size="
            f"{tokenizer.vocab_size} (or larger)"
        )
    tokens = np.concatenate(
        [tokenizer.encode_bytes(s.raw, f"data file '{s.name}'") for s in sources]
    )
    digest = hashlib.sha256()
    for s in sources:
        digest.update(s.raw)

    n_val = math.ceil(len(tokens) * d.val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    check_split_fits(f"corpus ({description})", len(tokens), len(train), cfg, "use", "of text")
    return Data(
        tokenizer, train, val, f"{description}, {len(tokens):,} tokens", digest.hexdigest()[:16]
    )


# ----------------------------------------------------------------------------- pipelines


def _local_rows(global_batch: int, process_index: int, process_count: int) -> slice:
    if global_batch % process_count:
        raise DataError(
            f"train.batch_size ({global_batch}) must be divisible by the number of processes "
            f"({process_count})"
        )
    b = global_batch // process_count
    return slice(process_index * b, (process_index + 1) * b)


def train_dataset(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """Infinite Grain dataset of this process's rows of each global batch: int32 [b, seq_len+1]."""
    rows = _local_rows(global_batch, process_index, process_count)
    offsets = np.arange(seq_len + 1)

    def windows(starts_B: np.ndarray) -> np.ndarray:
        return tokens[starts_B[rows, None] + offsets]  # [b, seq_len + 1]

    n_starts = len(tokens) - seq_len  # window start offsets 0 .. len - (seq_len + 1)
    # A fresh order every epoch. Not `repeat()`: its sys.maxsize length overflows Grain's
    # length arithmetic in `batch(1)`; 2^62 start offsets are as good as endless.
    epochs = 2**62 // n_starts
    starts = grain.MapDataset.range(n_starts).shuffle(seed=seed % 2**32).repeat(epochs)
    # Batch the start offsets (cheap ints) globally, then cut out this process's rows.
    return starts.batch(global_batch).map(windows)


def train_iterator(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    num_threads: int = 0,
) -> grain.DatasetIterator:
    """Iterator over `train_dataset`; `num_threads` > 0 prefetches batches in that many threads."""
    ds = train_dataset(tokens, seq_len, global_batch, seed, process_index, process_count)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4 * num_threads)
    return iter(ds.to_iter_dataset(options))


def eval_batches(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    n_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[np.ndarray]:
    """Fixed validation batches: n_batches * global_batch evenly spaced windows, this
    process's rows of each. Windows overlap only if the split is too short to avoid it."""
    rows = _local_rows(global_batch, process_index, process_count)
    n_starts = len(tokens) - seq_len
    starts = np.linspace(0, n_starts - 1, n_batches * global_batch).round().astype(np.int64)
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)]
    return [w[rows] for w in windows.reshape(n_batches, global_batch, seq_len + 1)]


# ----------------------------------------------------------------------------- prepared data


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


@dataclass(frozen=True)
class Part:
    """One prepared dataset of a run: its store, mixture weight and train/validation split."""

    store: TokenStore
    weight: float
    split: int  # tokens[:split] train, tokens[split:] validation

    def train_windows(self, seq_len: int) -> int:
        """Windows of seq_len + 1 tokens at stride seq_len: every train token but the first is
        a target exactly once an epoch."""
        return (self.split - 1) // seq_len


@dataclass(frozen=True)
class PreparedData:
    """Prepared dataset(s) (`data.path=DIR` or `data.mixture`), packed into windows."""

    tokenizer: Tokenizer
    parts: tuple[Part, ...]
    description: str
    fingerprint: str
    val_unigram_entropy: float  # of the validation windows' tokens (those evaluated)

    @property
    def n_train_tokens(self) -> int:
        return sum(p.split for p in self.parts)

    @property
    def n_val_tokens(self) -> int:
        return sum(len(p.store.tokens) - p.split for p in self.parts)

    def train_iterator(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        ds = prepared_train_dataset(self.parts, cfg, process_index, process_count)
        n = cfg.data.num_workers
        return iter(
            ds.to_iter_dataset(grain.ReadOptions(num_threads=n, prefetch_buffer_size=4 * n))
        )

    def eval_batches(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        t = cfg.train
        windows = prepared_eval_windows(self.parts, cfg)
        rows = _local_rows(t.batch_size, process_index, process_count)
        return [
            {k: v[i * t.batch_size : (i + 1) * t.batch_size][rows] for k, v in windows.items()}
            for i in range(t.eval_batches)
        ]


def _part_seed(seed: int, part: int) -> int:
    """Independent shuffle seeds for the mixture's parts, all from the run's seed."""
    return int(np.random.SeedSequence([seed, part]).generate_state(1)[0])


def part_examples(part: Part, cfg: Config, seed: int) -> grain.MapDataset:
    """Endless dataset of one part's train windows (dict examples, see `pack_window`), in a
    fresh seeded order each epoch."""
    seq_len, d = cfg.train.seq_len, cfg.data
    n_windows = part.train_windows(seq_len)
    # 2^40 windows are as good as endless, and leave room in Grain's length arithmetic for
    # the mixture (which scales lengths by 1 / weight) and the batching.
    ids = grain.MapDataset.range(n_windows).shuffle(seed=seed).repeat(2**40 // n_windows)
    tokens, starts = part.store.tokens, part.store.doc_starts
    return ids.map(
        lambda i: pack_window(
            tokens, starts, i * seq_len, seq_len + 1, d.document_mask, d.document_positions
        )
    )


def batch_examples(
    examples: grain.MapDataset, global_batch: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
    """Global batches of consecutive examples (dicts of equal-shape arrays), stacked; process p
    of P reads only its rows [p * B/P, (p+1) * B/P) of each."""
    rows = _local_rows(global_batch, process_index, process_count)

    def read(ids_B: np.ndarray) -> dict[str, np.ndarray]:
        picked = [examples[int(i)] for i in ids_B[rows]]
        return {k: np.stack([e[k] for e in picked]) for k in picked[0]}

    return grain.MapDataset.range(len(examples)).batch(global_batch).map(read)


def prepared_train_dataset(
    parts: Sequence[Part], cfg: Config, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
    """Endless batches of packed windows, the parts mixed by weight: Grain's index mixing
    gives example k to part j by a fixed interleave of the weights (every prefix of the
    stream is within one example per part of the exact proportions), so the stream and its
    resume position are a pure function of the seed and the batch index."""
    examples = [part_examples(p, cfg, _part_seed(cfg.seed, j)) for j, p in enumerate(parts)]
    if len(examples) > 1:
        examples = [grain.MapDataset.mix(examples, [p.weight for p in parts])]
    return batch_examples(examples[0], cfg.train.batch_size, process_index, process_count)


def prepared_eval_windows(parts: Sequence[Part], cfg: Config) -> dict[str, np.ndarray]:
    """The fixed, seed-independent validation windows, [eval_batches * batch_size, seq_len + 1]
    per key: each part's share (by weight, largest remainder) evenly spaced over its
    validation split, in part order."""
    t, d = cfg.train, cfg.data
    total = t.eval_batches * t.batch_size
    share = np.array([p.weight for p in parts]) / sum(p.weight for p in parts) * total
    counts = np.floor(share).astype(int)
    counts[np.argsort(counts - share, kind="stable")[: total - counts.sum()]] += 1
    windows = []
    for part, n in zip(parts, counts, strict=True):
        last = len(part.store.tokens) - (t.seq_len + 1)
        for start in np.linspace(part.split, last, n).round().astype(np.int64):
            windows.append(
                pack_window(
                    part.store.tokens,
                    part.store.doc_starts,
                    int(start),
                    t.seq_len + 1,
                    d.document_mask,
                    d.document_positions,
                )
            )
    return {k: np.stack([w[k] for w in windows]) for k in windows[0]}


def load_prepared(
    cfg: Config, entries: Sequence[tuple[str, float]], tokenizer: Tokenizer | None = None
) -> PreparedData:
    """Open the prepared dataset(s) `entries` ((dir, weight) pairs) for `cfg`; `tokenizer` is
    the run's when resuming. DataError when one is not a prepared dir, their tokenizers
    differ from each other, from the run's or from `data.tokenizer`, or one is too short."""
    d = cfg.data
    stores = [TokenStore.open(path) for path, _ in entries]
    first = stores[0]
    for s in stores[1:]:
        if s.meta["tokenizer_hash"] != first.meta["tokenizer_hash"]:
            raise DataError(
                f"data.mixture: '{first.path}' and '{s.path}' were prepared with different "
                f"tokenizers ({first.meta['tokenizer_kind']} sha256 "
                f"{first.meta['tokenizer_hash'][:12]}, {s.meta['tokenizer_kind']} sha256 "
                f"{s.meta['tokenizer_hash'][:12]}); prepare them with the same --tokenizer"
            )
    made_with = first.tokenizer
    if d.tokenizer in ("byte", "char"):  # char: the alphabet is the prepared corpus's
        same = first.meta["tokenizer_kind"] == d.tokenizer
    else:
        same = tokenizer_hash(load_tokenizer(d.tokenizer)) == first.meta["tokenizer_hash"]
    if not same:
        raise DataError(
            f"prepared dataset '{first.path}' was made with tokenizer "
            f"{describe_tokenizer(made_with)}, not data.tokenizer '{d.tokenizer}'; set "
            "data.tokenizer to the one it was prepared with, or prepare the data again with "
            f"--tokenizer {d.tokenizer}"
        )
    if tokenizer is not None and tokenizer_hash(tokenizer) != first.meta["tokenizer_hash"]:
        raise DataError(
            f"prepared dataset '{first.path}' was made with tokenizer "
            f"{describe_tokenizer(made_with)}, but run_dir '{cfg.run_dir}' trains with "
            f"{describe_tokenizer(tokenizer)}; prepare the data with the run's tokenizer, or "
            "train in a new run_dir"
        )
    tokenizer = tokenizer or made_with
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the {tokenizer.kind} tokenizer of '{first.path}' has {tokenizer.vocab_size} tokens "
            f"but model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size="
            f"{tokenizer.vocab_size} (or larger)"
        )
    parts = []
    for s, (_, weight) in zip(stores, entries, strict=True):
        n = len(s.tokens)
        split = n - math.ceil(n * d.val_fraction)
        check_split_fits(f"prepared dataset '{s.path}'", n, split, cfg, "prepare")
        parts.append(Part(s, weight, split))
    if len(parts) == 1:
        s = parts[0].store
        description = f"prepared {s.path}: {s.meta['documents']:,} documents"
        fingerprint = s.meta["fingerprint"]
    else:
        total = sum(p.weight for p in parts)
        description = "mixture of " + ", ".join(
            f"{p.store.path} ({p.weight / total:.0%})" for p in parts
        )
        ids = ",".join(f"{p.store.meta['fingerprint']}:{p.weight!r}" for p in parts)
        fingerprint = hashlib.sha256(ids.encode()).hexdigest()[:16]
    tokens = sum(len(p.store.tokens) for p in parts)
    val_windows = prepared_eval_windows(parts, cfg)["tokens"]
    return PreparedData(
        tokenizer,
        tuple(parts),
        f"{description}, {tokens:,} tokens",
        fingerprint,
        unigram_entropy(val_windows, tokenizer.vocab_size),
    )
