"""GRPO's prompts (`data.sft=prompts`, `train.objective=grpo`): JSONL, encoded, and the
reward functions that score their completions (`rl.rewards`).

    data = load_prompts(cfg, tokenizer)   # the interface of `data.load_data`'s result

A line (the JSONL files of `data.path`, blank lines skipped) is `{"prompt": P, ...}`: P text
(encoded with the tokenizer's special tokens) or a list of messages (rendered with the chat
template and its generation prompt). Every other field is the reward functions' (as TRL
passes a dataset's columns): e.g. `{"prompt": "12+7=", "answer": "19"}`.
A training batch is train.batch_size prompts' indices ({"index": int32 [B]}; the rollouts
are sampled from them each step, `rl.collect`), a fresh seeded order each epoch; its
position is saved in every checkpoint. Validation: the last val_fraction of the prompts (at
least one), scored as language-model rows (the cross-entropy of the prompts' tokens: a
drift check).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import grain
import numpy as np

from moe_jax.config import Config, ConfigError
from moe_jax.data.sft import Record, read_records
from moe_jax.data.windows import batch_examples, bucket, local_rows, unigram_entropy
from moe_jax.tokenizer import DataError, Tokenizer, load_tokenizer

FORM = '{"prompt": "...", ...} (or a list of messages; other fields go to the rewards)'


def check_record(value, where: str) -> None:
    def fail(what: str):
        raise DataError(f"{where} {what}; data.sft=prompts reads lines {FORM}")

    if not isinstance(value, dict):
        fail(f"holds a JSON {type(value).__name__}, not an object")
    if "prompt" not in value:
        fail("has no 'prompt' field")
    prompt = value["prompt"]
    if isinstance(prompt, list):
        for k, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                fail(f"has a prompt message {k} without a string 'role' and 'content'")
    elif not isinstance(prompt, str):
        fail("has a 'prompt' that is neither a string nor a list of messages")
    if not prompt:
        fail("has an empty prompt")


def prompt_text(value: dict, tokenizer: Tokenizer) -> str:
    """The prompt as the reward functions read it (a chat prompt as rendered)."""
    p = value["prompt"]
    return p if isinstance(p, str) else tokenizer.apply_chat_template(p, add_generation_prompt=True)


def load_rewards(cfg: Config) -> list[tuple[str, Callable, float]]:
    """rl.rewards imported: (name, function, weight) each. ConfigError names the one that
    does not import or is not callable."""
    rl = cfg.rl
    weights = rl.reward_weights or (1.0,) * len(rl.rewards)
    out = []
    for spec, weight in zip(rl.rewards, weights, strict=True):
        module, name = spec.split(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"rl.rewards: cannot import {spec} ({e})") from None
        if not callable(fn):
            raise ConfigError(f"rl.rewards: {spec} is a {type(fn).__name__}, not a function")
        out.append((spec, fn, float(weight)))
    return out


@dataclass(frozen=True)
class PromptData:
    """Encoded prompts and their records (`load_prompts`): the interface of
    `data.load_data`'s result, and what the rollouts read."""

    tokenizer: Tokenizer
    records: list  # [Record]: train then val
    ids: list  # [int32 array]: each record's prompt tokens
    n_train: int
    length: int  # the validation rows' width, train.seq_len + 1
    bucket: int  # the sampler's prompt bucket of the longest prompt: rows are bucket + N
    rewards: list  # load_rewards
    description: str
    fingerprint: str

    row_unit = "prompts"  # what an epoch (train.epochs) passes over: a prompt a batch row

    @property
    def rows_per_epoch(self) -> int:
        return self.n_train

    @property
    def n_train_tokens(self) -> int:
        return sum(len(t) for t in self.ids[: self.n_train])

    @property
    def n_val_tokens(self) -> int:
        return sum(len(t) for t in self.ids[self.n_train :])

    @property
    def val_unigram_entropy(self) -> float:
        val = np.concatenate(self.ids[self.n_train :])
        return unigram_entropy(val, self.tokenizer.vocab_size)

    def train_iterator(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """Endless batches of this process's prompt indices, a fresh seeded order each epoch;
        the iterator's state is the next batch's index (saved in every checkpoint)."""
        n = self.n_train
        ids = grain.MapDataset.range(n).shuffle(seed=cfg.seed).repeat(2**40 // n)
        rows = ids.map(lambda i: {"index": np.int32(i)})
        batches = batch_examples(rows, cfg.train.batch_size, process_index, process_count)
        return iter(batches.to_iter_dataset())

    def eval_batches(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """`eval_batches` batches of train.batch_size validation prompts as LM rows (empty
        rows past the split's end count nothing)."""
        t, L = cfg.train, self.length
        n = t.eval_batches * t.batch_size
        rows = []
        for ids in (self.ids[self.n_train :] + [np.zeros(0, np.int32)] * n)[:n]:
            ids = ids[:L]
            row = {k: np.zeros(L, np.int32) for k in ("tokens", "segments", "positions")}
            row["tokens"][: len(ids)], row["segments"][: len(ids)] = ids, 1
            row["positions"][: len(ids)] = np.arange(len(ids))
            rows.append(row)
        mine = local_rows(t.batch_size, process_index, process_count)
        return [
            {k: np.stack([r[k] for r in rows[i * t.batch_size : (i + 1) * t.batch_size][mine]])
             for k in rows[0]}
            for i in range(t.eval_batches)
        ]  # fmt: skip


def load_prompts(cfg: Config, tokenizer: Tokenizer | None = None) -> PromptData:
    """Read, check and encode the prompts of `cfg.data.path` (module doc) and import the
    reward functions. DataError names the line and the fix; ConfigError the reward."""
    d, N = cfg.data, cfg.rl.max_new_tokens
    rewards = load_rewards(cfg)
    records, fingerprint = read_records(d.path, "prompts", check_record)
    if len(records) < 2:
        raise DataError(
            f"data.path '{d.path}' holds {len(records)} prompt(s); GRPO needs at least 2, one "
            "to train on and one to validate on"
        )
    tokenizer = tokenizer or load_tokenizer(d.tokenizer)
    if any(isinstance(r.value["prompt"], list) for r in records) and not tokenizer.chat_template:
        raise DataError(
            f"data.path '{d.path}' holds message prompts, and the {tokenizer.kind} tokenizer "
            "has no chat template to render them; use a tokenizer with one or text prompts"
        )
    ids, limit = [], cfg.model.max_seq_len - N
    longest = min(cfg.rl.max_prompt_len or limit, limit)
    for r in records:
        encoded = np.asarray(
            tokenizer.encode(prompt_text(r.value, tokenizer), add_special_tokens=True), np.int32
        )
        if not 0 < len(encoded) <= longest:
            bound = (
                f"rl.max_prompt_len = {longest}"
                if longest < limit
                else (f"model.max_seq_len - {N} = {limit} with rl.max_new_tokens={N}")
            )
            raise DataError(
                f"{r.where}: its prompt is {len(encoded)} tokens; a prompt takes 1 to {bound}: "
                "shorten it"
            )
        ids.append(encoded)
    n_val = min(max(math.ceil(len(records) * d.val_fraction), 1), len(records) - 1)
    cut = len(records) - n_val
    padded = bucket(cfg.rl.max_prompt_len or max(map(len, ids)), limit)
    description = f"GRPO prompts {d.path}: {cut:,} train / {n_val:,} val prompts"
    return PromptData(
        tokenizer, records, ids, cut, cfg.train.seq_len + 1, padded, rewards, description,
        fingerprint,
    )  # fmt: skip


__all__ = ["PromptData", "Record", "load_prompts", "load_rewards"]
