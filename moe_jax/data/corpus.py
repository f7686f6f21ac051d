"""Text corpora: the files of `data.path`, or the embedded one, tokenized, split and windowed.

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
"""

from __future__ import annotations

import glob
import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from moe_jax.config import Config
from moe_jax.data.token_store import META_FILE
from moe_jax.data.windows import check_split_fits, local_rows, unigram_entropy
from moe_jax.tokenizer import CharTokenizer, DataError, Tokenizer, decode_utf8, load_tokenizer


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


def load_corpus(cfg: Config, tokenizer: Tokenizer | None = None) -> Data:
    """Read the text corpus, tokenize it (with `tokenizer`, e.g. a run's saved one, else a new
    one of kind `data.tokenizer`) and split it. Raises DataError with the fix on bad input."""
    d = cfg.data
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


def train_dataset(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """Infinite Grain dataset of this process's rows of each global batch: int32 [b, seq_len+1]."""
    rows = local_rows(global_batch, process_index, process_count)
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
    rows = local_rows(global_batch, process_index, process_count)
    n_starts = len(tokens) - seq_len
    starts = np.linspace(0, n_starts - 1, n_batches * global_batch).round().astype(np.int64)
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)]
    return [w[rows] for w in windows.reshape(n_batches, global_batch, seq_len + 1)]
