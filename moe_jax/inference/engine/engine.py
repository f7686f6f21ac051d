"""The generation engine: continuous batching over a paged KV cache.

    engine = Engine(sampler, max_slots=8)                # an `inference.sampling.Sampler`'s model
    rid = engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7, seed=1))
    while engine.has_work():
        for event in engine.step(): ...    # Event(rid, token, finish_reason, logprob, top)
    engine.generate([ids_a, ids_b], SamplingParams(max_tokens=32))   # the same, to the end

A fixed number of decode slots; a request takes a free slot when it is admitted and leaves it
when it finishes, between steps. One `step()`:
 1. admits queued requests (first come, first served) while a slot and the pages for their
    prompt are free, sharing the pages of a prompt prefix seen before (`pages.PagePool`);
    a request whose next page of prefix another is prefilling waits for it, the requests
    behind passing it (G samples of one prompt submitted together prefill it once);
 2. runs one prefill chunk of `chunk` tokens for each of the `prefill_rows` oldest slots
    still prefilling, one row each (a long prompt takes several steps; the others keep
    decoding meanwhile), which on a prompt's last chunk picks the request's first token.
    Several rows a call: with one, prefill bounded the throughput under load (a request
    needs a chunk or two, and finished requests' slots waited for theirs);
 3. runs one decode step for every request past its prefill: each feeds its last token and
    picks the next, one row each (a row is not a slot: the pages travel with the request),
    in a power-of-two bucket of at least `min_decode_rows`: a few shapes to compile, and
    neither empty nor prefilling slots' rows computed.
A request ends at a stop id (which it keeps, as `Sampler` does), at `max_tokens`, or when the
caller cancels it; its pages go back to the pool. A slot asks for a page only when its
sequence reaches one; if none is left, the most recently admitted other request is preempted:
its pages are freed and it waits at the queue's head, to be prefilled again with the tokens it
has so far (greedy, it then goes on as before; its sampling keys are per step, so sampled too).

Speculative decoding (`Engine(sampler, speculative=True, draft_depth=K)`, a model with MTP
layers): step 3 is a verify call instead, each decoding request feeding its newest token and
the K tokens its MTP layers drafted, and emitting 1..K+1 tokens (greedy: the same tokens);
prefill chunks fill the MTP layers' pages too, and a prompt's last chunk drafts
(`speculation.py` the host side, `draft_programs.py` the programs; `self.speculation` counts
the drafts checked and kept).

Recording (`Engine(sampler, record=True)`, GRPO's rollouts): each request's experts at every
position of its row and each sampled token's log-prob at its temperature, as
`Sampler.generate(record=True)` gives them (`recording.py`; `generate_recorded`).

Sliding-window layers keep their pages in a pool of their own, released once behind the
window (`programs` module doc); a model with such layers shares no prefix pages (the window
pages of a prefix are gone by the time it could be shared).

Tokens are those `Sampler.generate` gives each request alone (greedy: token for token; the
engine's prefill runs in chunks and its attention in other shapes, so the logits agree to
float rounding, not bits).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from typing import NamedTuple

import jax
import numpy as np

from moe_jax.config import sampling_problem
from moe_jax.errors import MoeJaxError
from moe_jax.inference.engine.draft_programs import DraftPrograms
from moe_jax.inference.engine.pages import PagePool
from moe_jax.inference.engine.programs import Batch, Picked, PickMode, Programs, table_width
from moe_jax.inference.engine.recording import Recorder, generate_recorded
from moe_jax.inference.engine.sizes import model_problem, size_problem
from moe_jax.inference.engine.speculation import Speculation, draft_depth_of
from moe_jax.inference.sampling import Generation


def _bucket(n: int, lo: int, hi: int) -> int:
    """Rows for `n` requests: the next power of two, at least `lo`, at most `hi` (>= n)."""
    return min(hi, max(lo, 1 << math.ceil(math.log2(n))))


class EngineError(MoeJaxError, ValueError):
    """A request the engine cannot take; the message names the problem and the fix."""


class QueueFull(EngineError):
    """The queue holds `max_queue` requests already."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    row: int = 0  # the key is fold_in(seed, row), as row `row` of a Sampler batch


class Event(NamedTuple):
    rid: int
    token: int
    finish_reason: str | None  # "stop" (a stop id), "length" (max_tokens), else None
    logprob: float = 0.0  # the token's log-probability under the model
    top: tuple[tuple[int, float], ...] = ()  # the TOP_LOGPROBS likeliest (id, logprob)
    draft: int = -1  # speculation: the draft the token was checked against (-1: none)


@dataclasses.dataclass
class _Seq:
    rid: int
    prompt: list[int]
    params: SamplingParams
    key_data: np.ndarray  # uint32 [2]
    out: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    window_pages: list[int] = dataclasses.field(default_factory=list)  # -1: released
    slot: int = -1
    done: int = 0  # positions already in the cache
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculation's (speculation.py)
    it: int = 0  # speculation: the step its next verify call draws at
    record: object = None  # recording: its `recording.Record`

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefilling(self) -> bool:
        """Until the prompt (and, after a preemption, the tokens so far) is in the cache."""
        return self.done < len(self.tokens) - (1 if self.out else 0)


class Engine:
    def __init__(
        self,
        sampler,
        *,
        max_slots: int = 8,
        page_size: int = 16,
        n_pages: int | None = None,
        chunk: int = 64,
        max_queue: int = 1024,
        vocab_size: int | None = None,
        min_decode_rows: int = 1,
        prefill_rows: int = 4,
        speculative: bool = False,
        draft_depth: int | None = None,
        record: bool = False,
    ):
        """`n_pages`: the pool (default: every slot's full context, so nothing is ever
        preempted); at least one full context. `vocab_size`: sample ids below it only.
        `speculative`: decode by speculation with the model's MTP layers (`speculation.py`),
        `draft_depth` of them drafting (default: sample.draft_depth, else all). `record`:
        keep each request's experts and tempered log-probs (`recording.py`)."""
        cfg = sampler.cfg
        sizes = dict(max_slots=max_slots, page_size=page_size, n_pages=n_pages, chunk=chunk,
                     max_queue=max_queue)  # fmt: skip
        if problem := model_problem(cfg) or size_problem(sizes):
            raise EngineError(problem)
        if record and speculative:
            raise EngineError("the speculative engine does not record routes; drop speculative")
        K = draft_depth_of(cfg, draft_depth, EngineError) if speculative else 0
        if chunk < K:
            raise EngineError(f"chunk {chunk} is below draft_depth {K}; give at least {K}")
        self.V, self.max_len = cfg.model.vocab_size, cfg.model.max_seq_len
        self.page_size, self.chunk, self.max_slots = page_size, chunk, max_slots
        self.min_decode_rows, self.prefill_rows = min_decode_rows, prefill_rows
        self.max_pages = -(-self.max_len // page_size)  # a slot's table: one full context
        n_pages = n_pages or max_slots * self.max_pages
        if n_pages < self.max_pages:
            raise EngineError(
                f"n_pages {n_pages} cannot hold one full context ({self.max_pages} pages of "
                f"{page_size}); give at least that"
            )
        self.pool = PagePool(n_pages, page_size)
        # Ring layers' pool: each slot holds the pages of its last `window` positions and of
        # a prefill chunk (speculation: and of its MTP layers' K - 1 queries before the
        # newest token, and K drafts), so that many per slot never runs short.
        window = cfg.attention.sliding_window
        per_slot = -(-(window + chunk + 2 * K) // page_size) + 1
        n_window = max_slots * per_slot
        if K:
            self.programs = DraftPrograms(sampler, n_pages, n_window, page_size, max_slots, K)
        else:
            self.programs = Programs(sampler, n_pages, n_window, page_size)
        self.speculation = Speculation(self, K) if K else None
        self.window = window if self.programs.has_rings else 0
        self.window_pool = PagePool(max_slots * per_slot if self.window else 1, page_size)
        self.max_queue, self.n_vocab = max_queue, vocab_size or self.V
        self.queue: deque[_Seq] = deque()
        self.slots: list[_Seq | None] = [None] * max_slots
        self._ids = itertools.count()
        self._admitted = itertools.count()
        self._order: dict[int, int] = {}  # rid -> admission number (preemption picks the last)
        self.preempted = 0  # requests preempted so far
        self.prefilled = 0  # positions computed by prefill chunks so far (shared ones are not)
        self.recorder = Recorder(cfg, page_size) if record else None
        self.records = self.recorder.finished if record else {}  # rid -> a finished Record

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, params: SamplingParams = SamplingParams()) -> int:
        """Queue a request (token ids); -> its id. EngineError if unusable, QueueFull."""
        prompt = self._checked(prompt, params)
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests); retry later")
        rid = next(self._ids)
        key_data = jax.random.key_data(jax.random.fold_in(jax.random.key(params.seed), params.row))
        self.queue.append(_Seq(rid, prompt, params, np.asarray(key_data, np.uint32)))
        return rid

    def _checked(self, prompt, params: SamplingParams) -> list[int]:
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise EngineError("a prompt is a non-empty flat list of token ids")
        if ids.min() < 0 or ids.max() >= self.V:
            raise EngineError(f"prompt token ids must lie in [0, {self.V}) (the vocabulary)")
        if params.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if ids.size + params.max_tokens > self.max_len:
            raise EngineError(
                f"prompt of {ids.size} tokens + max_tokens {params.max_tokens} exceeds the "
                f"model's context ({self.max_len}); shorten the prompt or lower max_tokens"
            )
        rule = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if problem := sampling_problem(rule | {"seed": params.seed}):
            raise EngineError(problem)
        if any(not 0 <= int(t) < self.V for t in params.stop_ids):
            raise EngineError(f"stop ids must be token ids in [0, {self.V})")
        return ids.astype(int).tolist()

    def cancel(self, rid: int) -> bool:
        """Drop a request, queued or running, freeing its slot and pages; False if unknown."""
        for seq in self.queue:
            if seq.rid == rid:
                self.queue.remove(seq)
                return True
        for seq in self.slots:
            if seq is not None and seq.rid == rid:
                self._leave(seq)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.queue) or any(s is not None for s in self.slots)

    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Every prompt to its end (its tokens, as `Generation.sequences()` gives them)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.submit(p, q) for p, q in zip(prompts, each, strict=True)]
        out = {rid: [] for rid in rids}
        while self.has_work():
            for e in self.step():
                out[e.rid].append(e.token)
        return [out[rid] for rid in rids]

    def generate_recorded(self, prompts, params: list[SamplingParams]) -> Generation:
        """Every prompt to its end -> a Generation with routes and logprobs, as
        `Sampler.generate(record=True)` gives it (`recording.generate_recorded`)."""
        if self.recorder is None:
            raise EngineError("this engine does not record; make it with Engine(..., record=True)")
        return generate_recorded(self, prompts, params)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Event]:
        """Admit, one prefill chunk of up to `prefill_rows` slots, one decode step (module
        doc) -> the tokens picked."""
        self._admit()
        events = []
        prefilling = [s for s in self.slots if s is not None and s.prefilling]
        if prefilling:
            oldest = sorted(prefilling, key=lambda s: self._order[s.rid])
            events += self._prefill(oldest[: self.prefill_rows])
        decoding = [s for s in self.slots if s is not None and not s.prefilling]
        decoding = [s for s in decoding if s.rid not in {e.rid for e in events}]
        if decoding:
            events += self._decode(decoding)
        return events

    def _admit(self) -> None:
        twins = []  # waiting for a request in prefill to make their prefix's pages findable
        while self.queue and None in self.slots:
            seq = self.queue.popleft()
            tokens = seq.tokens
            # Ring layers' pages of a prefix are gone once behind its window: no sharing.
            shared = [] if self.window else self.pool.match_prefix(tokens)
            if self._twin_in_prefill(tokens, len(shared)):
                self.pool.release(shared)
                twins.append(seq)
                continue
            if self.speculation is not None:
                shared = self.speculation.shared_prefix(shared)
            own = self.pool.allocate(self._pages_for(len(tokens)) - len(shared))
            if own is None:  # wait for pages: first come, first served
                self.pool.release(shared)
                self.queue.appendleft(seq)
                break
            seq.pages, seq.done = shared + own, len(shared) * self.page_size
            if self.recorder is not None:
                self.recorder.admitted(seq, len(shared))
            seq.slot = self.slots.index(None)
            self.slots[seq.slot] = seq
            self._order[seq.rid] = next(self._admitted)
        self.queue.extendleft(reversed(twins))

    def _twin_in_prefill(self, tokens: list[int], n_found: int) -> bool:
        """Whether a request in prefill will make the full page after `tokens`' `n_found`
        findable ones findable: then `tokens` waits for it rather than compute it again (G
        samples of one prompt submitted together prefill it once), letting others pass."""
        end = (n_found + 1) * self.page_size
        if self.window or end > len(tokens) - 1:  # (match_prefix leaves the last token)
            return False
        slots = [s for s in self.slots if s is not None and s.prefilling]
        return any(s.prompt[:end] == tokens[:end] for s in slots)

    def _pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def _prefill(self, seqs: list[_Seq]) -> list[Event]:
        """The next chunk of each of `seqs`' tokens into its pages, one row each; a row's next
        token on its last chunk."""
        R = _bucket(len(seqs), 1, self.prefill_rows)
        tokens_RC = np.zeros((R, self.chunk), np.int32)
        positions_RC = np.full((R, self.chunk), -1, np.int32)
        last_R, ends = np.zeros(R, np.int32), []
        for i, seq in enumerate(seqs):
            tokens = seq.tokens
            end = len(tokens) if not seq.out else len(tokens) - 1  # a preempted one's last: decode
            if self.speculation is None:
                end = min(end, seq.done + self.chunk)
            else:
                end = self.speculation.chunk_end(seq.done, end, self.chunk)
            n = end - seq.done
            tokens_RC[i, :n] = tokens[seq.done : end]
            positions_RC[i, :n] = np.arange(seq.done, end)
            last_R[i] = n - 1
            self.prefilled += n
            self._window_pages(seq, end)
            ends.append(end)
        rows = seqs + [None] * (R - len(seqs))
        batch = self._batch(rows, tokens_RC, positions_RC, last_R)
        if self.speculation is not None:
            return self.speculation.prefill(seqs, batch, ends)
        picked = self.programs.run(batch, self._mode(seqs))
        events = []
        for i, (seq, end) in enumerate(zip(seqs, ends, strict=True)):
            if self.recorder is not None:
                self.recorder.fed(seq, picked, i, seq.done, end - seq.done)
            seq.done = end
            if end < len(seq.tokens):  # a middle chunk (or a preempted one's refill): no token
                continue
            if not self.window:
                findable = self.pool.register(seq.prompt, seq.pages)
                if self.recorder is not None:
                    self.recorder.registered(seq, findable)
            events += self._emit(seq, picked, i)
        return events

    def _decode(self, seqs: list[_Seq]) -> list[Event]:
        """Every decoding slot feeds its last token at its position and picks the next."""
        if self.speculation is not None:
            return self.speculation.decode(seqs)
        for seq in sorted(seqs, key=lambda s: self._order[s.rid]):
            if seq.slot >= 0 and not self._grow(seq, seq.done + 1):
                self._preempt(seq)
        seqs = [s for s in seqs if s.slot >= 0]
        if not seqs:
            return []
        for seq in seqs:
            self._window_pages(seq, seq.done + 1)
        # One row per decoding request (a row is not a slot: the pages travel with the
        # request), in a power-of-two bucket: slots still prefilling take no row.
        S = self._rows_for(len(seqs))
        tokens_S1 = np.zeros((S, 1), np.int32)
        positions_S1 = np.full((S, 1), -1, np.int32)
        for i, seq in enumerate(seqs):
            tokens_S1[i, 0] = seq.tokens[-1]
            positions_S1[i, 0] = seq.done
        rows = seqs + [None] * (S - len(seqs))
        batch = self._batch(rows, tokens_S1, positions_S1, np.zeros(S, np.int32))
        picked = self.programs.run(batch, self._mode(seqs))
        events = []
        for i, seq in enumerate(seqs):
            if self.recorder is not None:
                self.recorder.fed(seq, picked, i, seq.done, 1)
            seq.done += 1
            events += self._emit(seq, picked, i)
        return events

    def _rows_for(self, n: int) -> int:
        return _bucket(n, self.min_decode_rows, self.max_slots)

    def _grow(self, seq: _Seq, n_positions: int) -> bool:
        """Pages for `n_positions` of `seq` (preempting others if the pool is short)."""
        need = self._pages_for(n_positions) - len(seq.pages)
        while need > 0:
            pages = self.pool.allocate(need)
            if pages is not None:
                seq.pages += pages
                return True
            others = [s for s in self.slots if s is not None and s is not seq]
            if not others:
                return False
            self._preempt(max(others, key=lambda s: self._order[s.rid]))
        return True

    def _window_pages(self, seq: _Seq, end: int) -> None:
        """The ring layers' pages for a call writing positions up to `end` (exclusive), and
        those wholly behind the window of its first query (`seq.done`) released."""
        if not self.window:
            return
        PS = self.page_size
        # The oldest key any query from here sees (speculation: the MTP layers' queries
        # start K - 1 positions before the newest token).
        lag = self.speculation.K - 1 if self.speculation is not None else 0
        first_key = seq.done - lag - self.window + 1
        for i, page in enumerate(seq.window_pages):
            if page >= 0 and (i + 1) * PS <= first_key:
                self.window_pool.release([page])
                seq.window_pages[i] = -1
        need = self._pages_for(end) - len(seq.window_pages)
        if need > 0:
            pages = self.window_pool.allocate(need)
            assert pages is not None, "the window pool is sized never to run short"
            seq.window_pages += pages

    def _preempt(self, seq: _Seq) -> None:
        """Free `seq`'s slot and pages; it waits at the queue's head to be refilled."""
        self._leave(seq)
        seq.done, seq.slot = 0, -1
        self.preempted += 1
        self.queue.appendleft(seq)

    def _leave(self, seq: _Seq) -> None:
        self.pool.release(seq.pages)
        self.window_pool.release([p for p in seq.window_pages if p >= 0])
        seq.pages, seq.window_pages = [], []
        self.slots[seq.slot] = None
        seq.slot = -1
        self._order.pop(seq.rid, None)

    def _emit(self, seq: _Seq, picked: Picked, row: int) -> list[Event]:
        ids, logprobs = picked.top_ids_BK[row].tolist(), picked.top_logprobs_BK[row].tolist()
        top = tuple(zip(ids, logprobs, strict=True))
        event = self._event(seq, int(picked.tokens_B[row]), float(picked.logprob_B[row]), top)
        if self.recorder is not None:
            self.recorder.picked(seq, picked, row, event.finish_reason is not None)
        return [event]

    def _event(self, seq: _Seq, token: int, logprob: float, top, draft: int = -1) -> Event:
        """`seq`'s next token; it leaves at a stop id or `max_tokens`."""
        seq.out.append(token)
        p = seq.params
        reason = "stop" if token in p.stop_ids else None
        if reason is None and len(seq.out) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._leave(seq)
        return Event(seq.rid, token, reason, logprob, top, draft)

    # ------------------------------------------------------------------ program inputs

    def _batch(self, rows, tokens_BT, positions_BT, last_B) -> Batch:
        """The call's inputs; empty rows (None) get padding and greedy rules."""
        B = len(rows)
        width = table_width(np.array([len(s.pages) for s in rows if s is not None]), self.max_pages)
        table_BM = np.zeros((B, width), np.int32)
        window_BM = np.zeros((B, width if self.window else 1), np.int32)
        keys_B2 = np.zeros((B, 2), np.uint32)
        step_B = np.zeros(B, np.int32)
        temperature_B = np.zeros(B, np.float32)
        top_k_B = np.full(B, self.V, np.int32)
        top_p_B = np.full(B, 2.0, np.float32)
        for i, seq in enumerate(rows):
            if seq is None:
                continue
            table_BM[i, : len(seq.pages)] = seq.pages
            if self.window:  # released pages: any page, behind every query's window
                window_BM[i, : len(seq.window_pages)] = np.maximum(seq.window_pages, 0)
            keys_B2[i], step_B[i] = seq.key_data, len(seq.out)
            p = seq.params
            temperature_B[i] = p.temperature
            top_k_B[i] = p.top_k if 0 < p.top_k < self.V else self.V
            top_p_B[i] = p.top_p if p.top_p < 1 else 2.0
        return Batch(
            table_BM, window_BM, tokens_BT, positions_BT, last_B, keys_B2, step_B,
            temperature_B, top_k_B, top_p_B, np.int32(self.n_vocab),
        )  # fmt: skip

    def _mode(self, seqs: list[_Seq]) -> PickMode:
        ps = [s.params for s in seqs]
        all_greedy = all(p.temperature == 0 for p in ps)
        any_filter = any(0 < p.top_k < self.V or p.top_p < 1 for p in ps if p.temperature > 0)
        return PickMode(all_greedy, any_filter, self.recorder is not None)
