"""Supervised fine-tuning data: JSONL examples, encoded, packed whole and batched.

    data = load_sft(cfg, tokenizer)                # the interface of `data.load_data`'s result

SFT examples (`data.sft`, the JSONL files of `data.path`, one JSON object a line, blank lines
skipped):
- prompt_completion, `{"prompt": P, "completion": C}`: tokens = encode(P, with the special
  tokens the tokenizer adds to a sequence, as sample.py encodes a prompt) + encode(C) + EOS
  (where the tokenizer has one); the loss covers C's tokens and the EOS.
- chat, `{"messages": [{"role": R, "content": T}, ...]}`: the conversation rendered with the
  tokenizer's chat template. The loss covers the assistant turns: for assistant message i,
  the text that rendering messages[:i + 1] adds to rendering messages[:i] with the
  generation prompt (i.e. what the model writes after `sample.py --chat`'s prompt: the
  content and the template's end of turn), or, for a template whose generation prompt is not
  how it starts an assistant turn, all that messages[:i + 1] adds to messages[:i]. This needs
  a template that renders each prefix of a conversation as a prefix of the whole (most do;
  one that rewrites earlier turns, e.g. dropping their reasoning, is refused by line). The
  text is encoded piece by piece at these boundaries, so the tokens before an assistant turn
  are exactly the prompt sample.py would give; text after the last assistant turn is dropped
  (it teaches nothing).
Each example is packed whole: the examples, in file order, fill windows of seq_len + 1 tokens
one after another (a new window when the next does not fit; the rest of a window is padding,
segment 0), each with its own segment id and positions from 0, so attention and the loss stay
inside it. An example longer than a window is an error naming its line. The window order is
shuffled with the run's seed, a fresh order each epoch, and batched like prepared data
(`data.batch_examples`); the iterator's state is the next batch's index, saved in every
checkpoint.
Split: the last `val_fraction` of the examples (at least one, and one left to train on) are
the validation split, packed the same way; `eval_batches * batch_size` of its windows are
evaluated (evenly spaced when it has more; when fewer, the rest are empty windows, which
count no target), so the validation loss is the mean over the completion tokens of those
windows.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import grain
import numpy as np

from moe_jax.config import Config
from moe_jax.data.corpus import file_sources
from moe_jax.data.windows import batch_examples, local_rows, unigram_entropy
from moe_jax.tokenizer import DataError, Tokenizer, load_tokenizer


@dataclass(frozen=True)
class Record:
    where: str  # "data file 'x.jsonl' line 3", for messages
    value: dict


FORMS = {
    "prompt_completion": '{"prompt": "...", "completion": "..."}',
    "chat": '{"messages": [{"role": "user", "content": "..."}, ...]}',
    # DPO's pairs (moe_jax/data/preference.py), or with messages: see there
    "preference": '{"prompt": "...", "chosen": "...", "rejected": "..."}',
    "prompts": '{"prompt": "...", ...}',  # GRPO's (moe_jax/data/prompts.py)
}


def read_records(path_spec: str, form: str, check=None) -> tuple[list[Record], str]:
    """The JSONL lines of the files `path_spec` names (`data.file_sources`), checked for
    `form`'s fields (by `check(value, where)` where given), and the SHA-256 of the files'
    bytes. DataError names file and line."""
    records, digest = [], hashlib.sha256(form.encode())
    for source in file_sources(path_spec):
        digest.update(source.raw)
        try:
            text = source.raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"data file '{source.name}' is not valid UTF-8 (byte 0x{source.raw[e.start]:02x} "
                f"at offset {e.start}); JSONL is UTF-8 text: fix the file"
            ) from None
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            where = f"data file '{source.name}' line {number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where} is not JSON ({e.msg} at column {e.colno}); data.sft={form} reads "
                    f"one JSON object a line: {FORMS[form]}"
                ) from None
            check(value, where) if check else _check_fields(value, form, where)
            records.append(Record(where, value))
    return records, digest.hexdigest()[:16]


def _check_fields(value, form: str, where: str) -> None:
    def fail(what: str):
        raise DataError(f"{where} {what}; data.sft={form} reads lines {FORMS[form]}")

    if not isinstance(value, dict):
        fail(f"holds a JSON {type(value).__name__}, not an object")
    fields = ("prompt", "completion") if form == "prompt_completion" else ("messages",)
    for name in fields:
        if name not in value:
            fail(f"has no '{name}' field")
    if form == "prompt_completion":
        for name in fields:
            if not isinstance(value[name], str):
                fail(f"has a '{name}' that is not a string")
        return
    messages = value["messages"]
    if not isinstance(messages, list) or not messages:
        fail("has a 'messages' that is not a non-empty list")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            fail(f"has a message {k} without a string 'role'")
        if not isinstance(m.get("content"), str):
            fail(f"has a message {k} without a string 'content'")


def chat_pieces(tokenizer: Tokenizer, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, learned) pieces, learned = an assistant turn
    (see the module doc), up to the end of the last one. DataError names `where`."""
    render = lambda msgs, prompt: tokenizer.apply_chat_template(msgs, add_generation_prompt=prompt)
    try:
        whole = render(messages, False)
        pieces, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            through = render(messages[: i + 1], False)
            start = render(messages[:i], True)
            if not through.startswith(start):  # the generation prompt is not the turn's start
                start = render(messages[:i], False)
            if not (whole.startswith(through) and through.startswith(start)):
                raise DataError(
                    f"the chat template renders the conversation up to message {i} otherwise "
                    "than as the start of the whole, so its assistant turns cannot be found; "
                    "end each example at its assistant turn to learn (one example per turn)"
                )
            pieces += [(whole[done : len(start)], False), (whole[len(start) : len(through)], True)]
            done = len(through)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if not pieces:
        raise DataError(f"{where} has no assistant message, so nothing to learn; drop it")
    return pieces


def encode_examples(
    records: list[Record], tokenizer: Tokenizer, form: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(int32 tokens, int32 loss mask: 1 on the tokens to learn) of every record."""
    if form == "prompt_completion":
        prompts = tokenizer.encode_batch([r.value["prompt"] for r in records], True)
        completions = tokenizer.encode_batch([r.value["completion"] for r in records], False)
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        examples = []
        for p, c in zip(prompts, completions, strict=True):
            learned = np.concatenate([c, eos]).astype(np.int32)
            examples.append(
                (
                    np.concatenate([p, learned]).astype(np.int32),
                    np.repeat(np.int32([0, 1]), [len(p), len(learned)]),
                )
            )
        return examples
    per_record = [chat_pieces(tokenizer, r.value["messages"], r.where) for r in records]
    # One batch for the library's parallel encoder, then cut back into the records' pieces.
    encoded = iter(tokenizer.encode_batch([text for ps in per_record for text, _ in ps], False))
    examples = []
    for ps in per_record:
        ids = [next(encoded) for _ in ps]
        masks = [np.full(len(i), learn, np.int32) for i, (_, learn) in zip(ids, ps, strict=True)]
        examples.append((np.concatenate(ids).astype(np.int32), np.concatenate(masks)))
    return examples


@dataclass(frozen=True)
class Packed:
    """Examples packed whole into windows of `length` tokens, in order: window w holds the
    examples bounds[w] .. bounds[w + 1] - 1, back to back, then padding."""

    tokens: np.ndarray  # int32: the examples back to back
    loss_mask: np.ndarray  # int32, 1 on the tokens to learn
    starts: np.ndarray  # int64 [n + 1]: example i is tokens[starts[i] : starts[i + 1]]
    bounds: np.ndarray  # int64 [windows + 1]: the first example of each window, then n
    length: int
    positions: bool  # give each window "positions" (0 at every example's start)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def window(self, w: int) -> dict[str, np.ndarray]:
        """Window `w` as a dict of int32 [length] arrays: "tokens", "segments" (1, 2, ... per
        example, 0 on padding), "loss_mask" and, with `positions`, "positions"."""
        first, last = int(self.bounds[w]), int(self.bounds[w + 1])
        begin, end = int(self.starts[first]), int(self.starts[last])
        sizes = np.diff(self.starts[first : last + 1])
        n = end - begin
        example = {
            "tokens": self.tokens[begin:end],
            "segments": np.repeat(np.arange(1, last - first + 1, dtype=np.int32), sizes),
            "loss_mask": self.loss_mask[begin:end],
        }
        if self.positions:
            offsets = np.repeat(self.starts[first:last] - begin, sizes)
            example["positions"] = np.arange(n) - offsets
        return {k: np.pad(v, (0, self.length - n)).astype(np.int32) for k, v in example.items()}

    def empty(self) -> dict[str, np.ndarray]:
        """A window of padding only: it counts no target."""
        keys = ("tokens", "segments", "loss_mask", *(("positions",) if self.positions else ()))
        return {k: np.zeros(self.length, np.int32) for k in keys}


def pack(
    examples: list[tuple[np.ndarray, np.ndarray]],
    where: list[str],
    length: int,
    positions: bool = True,
) -> Packed:
    """Pack `examples` (tokens, loss mask) whole, in order, into windows of `length` tokens:
    each fills the current window, or starts the next where it does not fit. DataError
    names (by `where`) an example longer than a window."""
    sizes = np.array([len(t) for t, _ in examples], np.int64)
    bounds, fill = [0], 0
    for i, size in enumerate(sizes):
        if size > length:
            raise DataError(
                f"{where[i]} is {size} tokens, longer than a window of train.seq_len+1 = "
                f"{length}; raise train.seq_len to at least {size - 1} (and model.max_seq_len "
                "with it), or shorten or drop that example"
            )
        if fill + size > length:
            bounds.append(i)
            fill = 0
        fill += size
    bounds.append(len(examples))
    return Packed(
        np.concatenate([t for t, _ in examples]).astype(np.int32),
        np.concatenate([m for _, m in examples]).astype(np.int32),
        np.concatenate([[0], np.cumsum(sizes)]),
        np.array(bounds, np.int64),
        length,
        positions,
    )


@dataclass(frozen=True)
class SFTData:
    """SFT examples (`load_sft`), packed: the interface of `data.load_data`'s result."""

    tokenizer: Tokenizer
    train: Packed
    val: Packed
    description: str
    fingerprint: str

    # what an epoch (train.epochs) passes over: a packed window (several examples) a row
    row_unit = "windows"

    @property
    def rows_per_epoch(self) -> int:
        return len(self.train)

    @property
    def n_train_tokens(self) -> int:
        return len(self.train.tokens)

    @property
    def n_val_tokens(self) -> int:
        return len(self.val.tokens)

    @property
    def val_unigram_entropy(self) -> float:
        """Entropy (nats/token) of the validation split's tokens to learn: the loss of a
        model that ignores context."""
        learned = self.val.tokens[self.val.loss_mask == 1]
        return unigram_entropy(learned, self.tokenizer.vocab_size)

    def eval_windows(self, n: int) -> list[dict[str, np.ndarray]]:
        """`n` validation windows: evenly spaced ones when the split has more, else all of
        them and empty ones."""
        val = self.val
        if len(val) <= n:
            return [val.window(w) for w in range(len(val))] + [val.empty()] * (n - len(val))
        return [val.window(int(w)) for w in np.linspace(0, len(val) - 1, n).round()]

    def train_iterator(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        """Endless batches of this process's rows of the train windows, in a fresh seeded
        order each epoch; `get_state` / `set_state` give the exact position."""
        n = len(self.train)
        # 2^40 windows are as good as endless and keep Grain's length arithmetic in range.
        ids = grain.MapDataset.range(n).shuffle(seed=cfg.seed).repeat(2**40 // n)
        batches = batch_examples(
            ids.map(self.train.window), cfg.train.batch_size, process_index, process_count
        )
        k = cfg.data.num_workers
        return iter(
            batches.to_iter_dataset(grain.ReadOptions(num_threads=k, prefetch_buffer_size=4 * k))
        )

    def eval_batches(self, cfg: Config, process_index: int = 0, process_count: int = 1):
        t = cfg.train
        rows = local_rows(t.batch_size, process_index, process_count)
        windows = self.eval_windows(t.eval_batches * t.batch_size)
        batches = []
        for i in range(t.eval_batches):
            picked = windows[i * t.batch_size : (i + 1) * t.batch_size][rows]
            batches.append({k: np.stack([w[k] for w in picked]) for k in picked[0]})
        return batches


def load_sft(cfg: Config, tokenizer: Tokenizer | None = None) -> SFTData:
    """Read, tokenize (with `tokenizer`, the run's or init_from's, else `data.tokenizer`),
    split and pack the JSONL examples of `cfg.data.path` (`data.sft` form). DataError names
    the problem (file and line where there is one) and the fix."""
    d, window = cfg.data, cfg.train.seq_len + 1
    records, fingerprint = read_records(d.path, d.sft)
    if len(records) < 2:
        raise DataError(
            f"data.path '{d.path}' holds {len(records)} example(s); SFT needs at least 2, one "
            "to train on and one to validate on"
        )
    if tokenizer is None:
        if d.tokenizer == "char":
            raise DataError(
                "data.sft with data.tokenizer=char: a char alphabet is made from a text corpus; "
                "fine-tune a char run with init_from=RUN (its alphabet), or use data.tokenizer="
                "byte or a tokenizer file"
            )
        tokenizer = load_tokenizer(d.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the {tokenizer.kind} tokenizer has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size="
            f"{tokenizer.vocab_size} (or larger)"
        )
    if d.sft == "chat" and tokenizer.chat_template is None:
        raise DataError(
            f"data.sft=chat renders conversations with the tokenizer's chat template, and the "
            f"{tokenizer.kind} tokenizer has none; use a tokenizer with one (data.tokenizer=PATH,"
            " or init_from a run that has one), or write the examples as prompt/completion "
            "lines (data.sft=prompt_completion)"
        )
    examples = encode_examples(records, tokenizer, d.sft)
    for r, (_, mask) in zip(records, examples, strict=True):
        if not mask.any():
            raise DataError(f"{r.where} has no token to learn (an empty completion); drop it")
    n_val = min(max(math.ceil(len(records) * d.val_fraction), 1), len(records) - 1)
    cut = len(records) - n_val
    where = [r.where for r in records]
    train = pack(examples[:cut], where[:cut], window, d.document_positions)
    val = pack(examples[cut:], where[cut:], window, d.document_positions)
    learned = int(train.loss_mask.sum() + val.loss_mask.sum())
    padding = 1 - (len(train.tokens) + len(val.tokens)) / (window * (len(train) + len(val)))
    names = [s.strip() for s in d.path.split(",")]
    description = (
        f"SFT {d.sft} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: "
        f"{cut:,} train / {n_val:,} val examples in {len(train):,} / {len(val):,} windows "
        f"({padding:.0%} padding), {learned:,} tokens to learn"
    )
    return SFTData(tokenizer, train, val, description, fingerprint)
