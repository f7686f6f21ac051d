"""What a run trains on: a text corpus (`corpus`), prepared token stores (`prepared`), or
supervised fine-tuning examples (`sft`), behind one interface (`RunData`).

    data = load_run_data(cfg)                  # SFT with data.sft, else load_data's
    data = load_data(cfg)                      # a corpus or prepared store(s): tokenizer,
                                               # train / validation split
    it = data.train_iterator(cfg)              # (process_index, process_count)
    batch = next(it)                           # text: int32 [local batch, seq_len + 1];
                                               # prepared: a dict of such arrays (below)
    state = it.get_state(); it.set_state(state)  # exact position, saved in every checkpoint
    val = data.eval_batches(cfg)               # fixed validation batches, same form
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from moe_jax.config import Config
from moe_jax.data.corpus import load_corpus
from moe_jax.data.prepared import load_prepared
from moe_jax.data.sft import load_sft
from moe_jax.data.token_store import is_prepared
from moe_jax.tokenizer import Tokenizer


class RunData(Protocol):
    """The interface the trainer reads data through (`corpus.Data`, `prepared.PreparedData`,
    `sft.SFTData`)."""

    tokenizer: Tokenizer
    description: str  # where the data came from, for the log
    fingerprint: str  # SHA-256 prefix of the data, saved with every checkpoint

    @property
    def val_unigram_entropy(self) -> float: ...

    def train_iterator(self, cfg: Config, process_index: int = 0, process_count: int = 1): ...

    def eval_batches(
        self, cfg: Config, process_index: int = 0, process_count: int = 1
    ) -> list[np.ndarray | dict[str, np.ndarray]]: ...


def load_data(cfg: Config, tokenizer: Tokenizer | None = None) -> RunData:
    """The corpus (`corpus.load_corpus`) or the prepared dataset(s) (`prepared.load_prepared`)
    that `data.path` / `data.mixture` name. Raises DataError with the fix on bad input."""
    d = cfg.data
    if d.mixture is not None:
        return load_prepared(cfg, d.mixture_entries, tokenizer)
    if d.path is not None and is_prepared(d.path.strip()):
        return load_prepared(cfg, [(d.path.strip(), 1.0)], tokenizer)
    return load_corpus(cfg, tokenizer)


def load_run_data(cfg: Config, tokenizer: Tokenizer | None = None):
    """What a run trains on: the SFT examples with `data.sft`, else `data.load_data`'s corpus
    or prepared dataset(s). The same interface either way (train_iterator, eval_batches...)."""
    if cfg.data.sft == "preference":  # DPO's pairs
        from moe_jax.data.preference import load_preference

        return load_preference(cfg, tokenizer)
    if cfg.data.sft == "prompts":  # GRPO's prompts (and its reward functions)
        from moe_jax.data.prompts import load_prompts

        return load_prompts(cfg, tokenizer)
    if cfg.data.sft != "none":
        return load_sft(cfg, tokenizer)
    return load_data(cfg, tokenizer)
