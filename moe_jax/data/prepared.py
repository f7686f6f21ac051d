"""Prepared token stores as training data: one directory or a weighted mixture.

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

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import grain
import numpy as np

from moe_jax.config import Config
from moe_jax.data.token_store import TokenStore, describe_tokenizer, tokenizer_hash
from moe_jax.data.windows import (
    batch_examples,
    check_split_fits,
    local_rows,
    pack_window,
    unigram_entropy,
)
from moe_jax.tokenizer import DataError, Tokenizer, load_tokenizer


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
        rows = local_rows(t.batch_size, process_index, process_count)
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
