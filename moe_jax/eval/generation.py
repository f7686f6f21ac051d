"""The harness's `generate_until`: continuations from the run's jitted sampler, cut at stop
strings.

    generator = Generator(sampler, tokenizer, batch_size=8, max_length=1024)
    generator.generate([(context_ids, GenOptions(until=("\\n",), max_gen_toks=32)), ...])

Requests with the same options are sorted by length and generated `batch_size` at a time (a
short last batch is filled up with copies of its last prompt, so every batch shares one
compiled program per prompt bucket: `moe_jax.sampling`). A context longer than
`max_length - max_gen_toks` loses its oldest tokens, as in the harness's Hugging Face
backend; a sequence stops at the tokenizer's EOS, and its text (the continuation's tokens
decoded on their own, special tokens left out, as the harness decodes them) is cut at the
first stop string. The sampler stops on tokens, not strings, so generation runs on past a
stop string unless the string is a single token of its own (a newline in a byte, char or
byte-level BPE vocabulary): such a token is passed as a stop token, which changes no text
(the cut would fall at or before it) and ends the batch as soon as every row has met one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from moe_jax.eval import EvalError
from moe_jax.eval.buckets import batches
from moe_jax.sampling import Sampler, prompt_bucket
from moe_jax.tokenizer import DataError, Tokenizer


@dataclass(frozen=True)
class GenOptions:
    """One request's generation settings (the harness's normalised `gen_kwargs`)."""

    until: tuple[str, ...] = ()
    max_gen_toks: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any non-empty stop string."""
    ends = [i for s in stops if s and (i := text.find(s)) >= 0]
    return text[: min(ends)] if ends else text


class Generator:
    """Continues token contexts with a sampler, as the harness's `generate_until` asks."""

    def __init__(self, sampler: Sampler, tokenizer: Tokenizer, batch_size: int, max_length: int):
        self.sampler, self.tokenizer = sampler, tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self.programs: set[tuple] = set()  # (rows, prompt bucket, max_gen_toks, mode) compiled
        self.seconds = 0.0  # spent in `generate`, compiling included
        self.requests = 0  # generated so far

    def stop_tokens(self, until: Sequence[str]) -> list[int]:
        """The tokenizer's EOS and the stop strings that are single tokens of their own."""
        stops = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        for s in until:
            try:
                ids = self.tokenizer.encode(s).tolist()
            except DataError:  # a char vocabulary without these characters: a string stop only
                continue
            if len(ids) == 1 and self.tokenizer.decode(ids) == s and ids[0] not in stops:
                stops.append(ids[0])
        return stops

    def generate(
        self, requests: Sequence[tuple[Sequence[int], GenOptions]], progress: bool = True
    ) -> list[str]:
        """The continuation text of each (context ids, options) request."""
        t0 = time.perf_counter()
        out = [""] * len(requests)
        groups: dict[GenOptions, list[int]] = {}
        for i, (_, options) in enumerate(requests):
            groups.setdefault(options, []).append(i)
        with tqdm(total=len(requests), desc="generating", disable=not progress or None) as bar:
            for options, members in groups.items():
                room = self.max_length - options.max_gen_toks
                if room < 1:
                    raise EvalError(
                        f"max_gen_toks {options.max_gen_toks} leaves no room for a prompt in "
                        f"the model's context of {self.max_length} tokens; lower max_gen_toks"
                    )
                prompts = [list(requests[i][0])[-room:] for i in members]
                for n, batch in enumerate(batches([len(p) for p in prompts], self.batch_size)):
                    texts = self._batch([prompts[j] for j in batch], options, n)
                    for j, text in zip(batch, texts, strict=True):
                        out[members[j]] = text
                    bar.update(len(batch))
        self.seconds += time.perf_counter() - t0
        self.requests += len(requests)
        return out

    def _batch(self, prompts: list[list[int]], options: GenOptions, n: int) -> list[str]:
        """One batch's texts; batch `n` of its group samples with seed + n."""
        filled = prompts + [prompts[-1]] * (self.batch_size - len(prompts))
        out = self.sampler.generate(
            filled,
            options.max_gen_toks,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=(options.seed + n) % 2**32,
            stop_tokens=self.stop_tokens(options.until),
            vocab_size=self.tokenizer.vocab_size,
        )
        limit = self.sampler.cfg.model.max_seq_len - options.max_gen_toks
        greedy = options.temperature == 0  # the sampler's static mode (sampling_rules.Mode)
        mode = (greedy, not greedy and options.top_k > 0, not greedy and options.top_p < 1)
        P = prompt_bucket(len(filled[0]), limit)
        self.programs.add((self.batch_size, P, options.max_gen_toks, mode))
        eos = self.tokenizer.eos_id
        texts = []
        for seq in out.sequences()[: len(prompts)]:
            ids = seq[: seq.index(eos)] if eos in seq else seq
            texts.append(cut_at_stops(self.tokenizer.decode(ids), options.until))
        return texts
