"""The harness's `generate_until`: continuations from the generation engine
(`moe_jax.inference.engine`: continuous batching over a paged KV cache), cut at stop strings.

    generator = Generator(sampler, tokenizer, batch_size=8, max_length=1024)
    generator.generate([(context_ids, GenOptions(until=("\\n",), max_gen_toks=32)), ...])

Every request goes to one engine of `batch_size` slots (its decode rows), longest first, the
queue kept topped up; a request leaves its slot as soon as it ends, and the next takes it, so
requests of different options and lengths share the decode steps. A context longer than
`max_length - max_gen_toks` loses its oldest tokens, as in the harness's Hugging Face backend;
a request ends at the tokenizer's EOS, at `max_gen_toks`, or once its text holds a stop
string (the engine is told to cancel it: no tokens are spent past it), and its text (the
continuation's tokens decoded on their own, special tokens left out, as the harness decodes
them) is cut at the first stop string. Stop strings that are single tokens of their own (a
newline in a byte, char or byte-level BPE vocabulary) are also given to the engine as stop
ids, which ends them without a host check and changes no text (the cut falls at or before
the token).

Greedy requests get the text `Sampler.generate` gives each alone (the engine's guarantee).
Sampled requests draw with the options' seed folded with the request's index in the call
(`SamplingParams.row`), so a request's text depends on its seed and place, not on what runs
beside it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from moe_jax.eval import EvalError
from moe_jax.inference.engine import Engine, SamplingParams
from moe_jax.inference.sampling import Sampler
from moe_jax.tokenizer import DataError, Tokenizer

# Tokens past the longest stop string's characters that the per-token check decodes: a
# token may decode to no character (a partial UTF-8 byte, a special token), so a few more.
STOP_TAIL_SLACK = 8


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
    """Continues token contexts with the engine, as the harness's `generate_until` asks."""

    def __init__(self, sampler: Sampler, tokenizer: Tokenizer, batch_size: int, max_length: int):
        self.sampler, self.tokenizer = sampler, tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self._engine: Engine | None = None  # made at the first request (its page pools)
        self.seconds = 0.0  # spent in `generate`, compiling included
        self.requests = 0  # generated so far
        self.tokens = 0  # generated so far (cancelled requests' last tokens included)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(
                self.sampler, max_slots=self.batch_size, vocab_size=self.tokenizer.vocab_size
            )
        return self._engine

    @property
    def programs(self) -> set:
        """The engine's compiled shapes run so far (prefill chunk, decode rows, table width,
        sampling mode)."""
        return set() if self._engine is None else self._engine.programs.shapes

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
        work = [self._request(i, ids, options) for i, (ids, options) in enumerate(requests)]
        work.sort(key=lambda w: -len(w[1]))  # longest first: close lengths decode together
        engine, out = self.engine, [""] * len(requests)
        tokens: dict[int, list[int]] = {}  # rid -> its tokens so far
        owner: dict[int, int] = {}  # rid -> request index
        # A queue of a few slots' worth: enough to refill every freed slot at once.
        backlog = max(2 * self.batch_size, 16)
        with tqdm(total=len(requests), desc="generating", disable=not progress or None) as bar:
            while work or engine.has_work():
                while work and len(engine.queue) < backlog:
                    i, prompt, params = work.pop(0)
                    rid = engine.submit(prompt, params)
                    owner[rid], tokens[rid] = i, []
                for e in engine.step():
                    if e.rid not in owner:  # cancelled this step, after its token was picked
                        continue
                    tokens[e.rid].append(e.token)
                    i = owner[e.rid]
                    until = requests[i][1].until
                    hit = e.finish_reason is None and self._meets_stop(tokens[e.rid], until)
                    if hit:
                        engine.cancel(e.rid)
                    if e.finish_reason is not None or hit:
                        out[i] = self._text(tokens.pop(e.rid), until)
                        del owner[e.rid]
                        bar.update(1)
        self.seconds += time.perf_counter() - t0
        self.requests += len(requests)
        return out

    def _request(self, i: int, ids: Sequence[int], options: GenOptions):
        """-> (request index, the prompt as the model reads it, the engine's parameters)."""
        room = self.max_length - options.max_gen_toks
        if room < 1:
            raise EvalError(
                f"max_gen_toks {options.max_gen_toks} leaves no room for a prompt in the "
                f"model's context of {self.max_length} tokens; lower max_gen_toks"
            )
        params = SamplingParams(
            max_tokens=options.max_gen_toks,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=options.seed % 2**32,
            stop_ids=tuple(self.stop_tokens(options.until)),
            row=i,
        )
        return i, list(ids)[-room:], params

    def _meets_stop(self, ids: list[int], until: Sequence[str]) -> bool:
        """Whether the text of `ids` holds a stop string: its tail decoded at each token (a
        hit confirmed on the whole text, which the tail's first characters may not match)."""
        stops = [s for s in until if s]
        if not stops:
            return False
        tail = ids[-(max(map(len, stops)) + STOP_TAIL_SLACK) :]
        if not any(s in self.tokenizer.decode(tail) for s in stops):
            return False
        return any(s in self._decoded(ids) for s in stops)

    def _decoded(self, ids: list[int]) -> str:
        eos = self.tokenizer.eos_id
        return self.tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)

    def _text(self, ids: list[int], until: Sequence[str]) -> str:
        self.tokens += len(ids)
        return cut_at_stops(self._decoded(ids), until)
