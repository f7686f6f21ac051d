"""DPO's preference pairs (`data.sft=preference`, `train.objective=dpo`): JSONL, encoded,
one pair a batch row.

    data = load_preference(cfg, tokenizer)   # the interface of `data.load_data`'s result

A line (the JSONL files of `data.path`, blank lines skipped) is one of
- text: `{"prompt": P, "chosen": C, "rejected": R}`: each answer is encoded as SFT's
  prompt_completion encodes a pair: encode(P, with the tokenizer's special tokens) +
  encode(answer) + EOS, the answer's tokens and the EOS counted;
- messages (TRL's conversational form): `{"prompt": [messages], "chosen": [messages],
  "rejected": [messages]}`: prompt + answer rendered with the chat template, and the
  answer's assistant turns counted (SFT's chat rule, `sft.chat_pieces`, for the turns
  after the prompt).
A batch row is a pair: int32 [2, train.seq_len + 1] arrays "tokens", "segments" (1 on the
sequence, 0 on padding), "loss_mask" (the answer's tokens) and "positions", chosen first.
A pair longer than a window, or an answer with nothing to count, is refused by its line.
Validation: the last val_fraction of the pairs (at least one), both answers of each as
rows of their own, so the validation loss is the cross-entropy of all their answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grain
import numpy as np

from moe_jax.config import Config
from moe_jax.data.sft import Record, chat_pieces, read_records
from moe_jax.data.windows import batch_examples, local_rows, unigram_entropy
from moe_jax.tokenizer import DataError, Tokenizer, load_tokenizer

ANSWERS = ("chosen", "rejected")
FORM = '{"prompt": "...", "chosen": "...", "rejected": "..."} (or lists of messages)'


def check_record(value, where: str) -> None:
    def fail(what: str):
        raise DataError(f"{where} {what}; data.sft=preference reads lines {FORM}")

    if not isinstance(value, dict):
        fail(f"holds a JSON {type(value).__name__}, not an object")
    for name in ("prompt", *ANSWERS):
        if name not in value:
            fail(f"has no '{name}' field")
    kinds = {type(value[n]) for n in ("prompt", *ANSWERS)}
    if kinds not in ({str}, {list}):
        fail(
            "mixes text and messages: give prompt, chosen and rejected all as strings or all "
            "as lists"
        )
    if str in kinds:
        return
    for name in ("prompt", *ANSWERS):
        for k, m in enumerate(value[name]):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                fail(f"has a {name} message {k} without a string 'role' and 'content'")
    if not value["chosen"] or not value["rejected"]:
        fail("has an empty answer")


def encode_pair(record: Record, tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(tokens, loss mask) of prompt + chosen, of prompt + rejected]."""
    v = record.value
    if isinstance(v["prompt"], str):
        prompt = tokenizer.encode(v["prompt"], add_special_tokens=True)
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        out = []
        for name in ANSWERS:
            answer = np.concatenate([tokenizer.encode(v[name]), eos]).astype(np.int32)
            mask = np.repeat(np.int32([0, 1]), [len(prompt), len(answer)])
            out.append((np.concatenate([prompt, answer]).astype(np.int32), mask))
        return out
    # the answer's turns start after the prompt's own rendering (their learned pieces begin
    # there or, with the generation prompt, after it; the prompt's turns end before it)
    start = len(tokenizer.apply_chat_template(v["prompt"], add_generation_prompt=False))
    out = []
    for name in ANSWERS:
        pieces, done, ids, masks = (
            chat_pieces(tokenizer, v["prompt"] + v[name], record.where),
            0,
            [],
            [],
        )
        for text, learned in pieces:
            ids.append(tokenizer.encode(text))
            masks.append(np.full(len(ids[-1]), learned and done >= start, np.int32))
            done += len(text)
        out.append((np.concatenate(ids).astype(np.int32), np.concatenate(masks)))
    return out


def pair_rows(pair, length: int) -> dict[str, np.ndarray]:
    """A pair as one batch row: int32 [2, length] arrays (module doc)."""
    rows = {
        k: np.zeros((2, length), np.int32) for k in ("tokens", "segments", "loss_mask", "positions")
    }
    for i, (tokens, mask) in enumerate(pair):
        n = len(tokens)
        rows["tokens"][i, :n], rows["loss_mask"][i, :n] = tokens, mask
        rows["segments"][i, :n], rows["positions"][i, :n] = 1, np.arange(n)
    return rows


@dataclass(frozen=True)
class PreferenceData:
    """Encoded pairs (`load_preference`): the interface of `data.load_data`'s result."""

    tokenizer: Tokenizer
    train: list  # [(chosen (tokens, mask), rejected (tokens, mask))]
    val: list
    length: int
    description: str
    fingerprint: str

    row_unit = "pairs"  # what an epoch (train.epochs) passes over: one pair a batch row

    @property
    def rows_per_epoch(self) -> int:
        return len(self.train)

    @property
    def n_train_tokens(self) -> int:
        return sum(len(t) for pair in self.train for t, _ in pair)

    @property
    def n_val_tokens(self) -> int:
        return sum(len(t) for pair in self.val for t, _ in pair)

    @property
    def val_unigram_entropy(self) -> float:
        learned = [t[m == 1] for pair in self.val for t, m in pair]
        return unigram_entropy(np.concatenate(learned), self.tokenizer.vocab_size)

    def train_iterator(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """Endless batches of this process's pairs, a fresh seeded order each epoch; the
        iterator's state is the next batch's index (saved in every checkpoint)."""
        n = len(self.train)
        ids = grain.MapDataset.range(n).shuffle(seed=cfg.seed).repeat(2**40 // n)
        rows = ids.map(lambda i: pair_rows(self.train[i], self.length))
        batches = batch_examples(rows, cfg.train.batch_size, process_index, process_count)
        return iter(batches.to_iter_dataset())

    def eval_batches(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """`eval_batches` batches of train.batch_size pairs' answers as single rows (empty
        rows past the split's end count nothing): the LM loss of the answers."""
        t = cfg.train
        seqs = [s for pair in self.val for s in pair]
        n = t.eval_batches * t.batch_size
        rows = [pair_rows([s, s], self.length) for s in seqs[:n]]
        rows = [{k: a[0] for k, a in r.items()} for r in rows]
        empty = {k: np.zeros(self.length, np.int32) for k in rows[0]}
        rows += [empty] * (n - len(rows))
        mine = local_rows(t.batch_size, process_index, process_count)
        return [
            {k: np.stack([r[k] for r in rows[i * t.batch_size : (i + 1) * t.batch_size][mine]])
             for k in empty}
            for i in range(t.eval_batches)
        ]  # fmt: skip

    def eval_pairs(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """The validation pairs as batches of train.batch_size pairs (as training reads them;
        at most eval_batches of them), the last one filled with empty pairs, which count
        nothing: DPO's held-out loss, reward accuracy and margin (`posttrain.dpo.eval_sums`)."""
        t = cfg.train
        n = min(math.ceil(len(self.val) / t.batch_size), t.eval_batches) * t.batch_size
        rows = [pair_rows(p, self.length) for p in self.val[:n]]
        empty = {k: np.zeros_like(a) for k, a in rows[0].items()}
        rows += [empty] * (n - len(rows))
        mine = local_rows(t.batch_size, process_index, process_count)
        return [
            {k: np.stack([r[k] for r in rows[i : i + t.batch_size][mine]]) for k in empty}
            for i in range(0, n, t.batch_size)
        ]


def load_preference(cfg: Config, tokenizer: Tokenizer | None = None) -> PreferenceData:
    """Read, check and encode the pairs of `cfg.data.path` (module doc), with `tokenizer`
    (the run's or init_from's) or `data.tokenizer`. DataError names the line and the fix."""
    d, length = cfg.data, cfg.train.seq_len + 1
    records, fingerprint = read_records(d.path, "preference", check_record)
    if len(records) < 2:
        raise DataError(
            f"data.path '{d.path}' holds {len(records)} pair(s); DPO needs at least 2, one to "
            "train on and one to validate on"
        )
    tokenizer = tokenizer or load_tokenizer(d.tokenizer)
    chat = isinstance(records[0].value["prompt"], list)
    if chat and tokenizer.chat_template is None:
        raise DataError(
            f"{records[0].where} holds messages, and the {tokenizer.kind} tokenizer has no "
            "chat template to render them; use a tokenizer with one or text pairs"
        )
    pairs = []
    for r in records:
        pair = encode_pair(r, tokenizer)
        for name, (tokens, mask) in zip(ANSWERS, pair, strict=True):
            if len(tokens) > length:
                raise DataError(
                    f"{r.where}: prompt + {name} is {len(tokens)} tokens, longer than a row of "
                    f"train.seq_len+1 = {length}; raise train.seq_len or shorten that pair"
                )
            if not mask.any():
                raise DataError(f"{r.where} has a {name} answer with no token to count; drop it")
        pairs.append(pair)
    n_val = min(max(math.ceil(len(pairs) * d.val_fraction), 1), len(pairs) - 1)
    cut = len(pairs) - n_val
    description = f"DPO pairs {d.path}: {cut:,} train / {n_val:,} val pairs"
    return PreferenceData(tokenizer, pairs[:cut], pairs[cut:], length, description, fingerprint)
