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
pages of a prefix are gone by the time it could be shared). A hybrid's linear layers keep a
state per slot instead (`programs` module doc); a shared prefix restores a snapshot of it
kept at a page boundary (`snapshots.py`). No speculation for them (a rejected draft would
roll the state back; refused, `sizes.model_problem`).

Tokens are those `Sampler.generate` gives each request alone (greedy: token for token; the
engine's prefill runs in chunks and its attention in other shapes, so the logits agree to
float rounding, not bits).
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import jax
import numpy as np

from moe_jax.config import sampling_problem
from moe_jax.inference.engine.draft_programs import DraftPrograms
from moe_jax.inference.engine.pages import PagePool
from moe_jax.inference.engine.programs import Batch, Picked, PickMode, Programs, table_width
from moe_jax.inference.engine.recording import Recorder, generate_recorded
from moe_jax.inference.engine.requests import EngineError, Event, QueueFull, SamplingParams, Seq
from moe_jax.inference.engine.sizes import model_problem, size_problem
from moe_jax.inference.engine.snapshots import Snapshots
from moe_jax.inference.engine.speculation import Speculation, draft_depth_of
from moe_jax.inference.sampling import Generation

GREEDY = SamplingParams()  # a request's parameters unless given: 16 tokens, greedy


def _bucket(n: int, lo: int, hi: int) -> int:
    """Rows for `n` requests: the next power of two, at least `lo`, at most `hi` (>= n)."""
    return min(hi, max(lo, 1 << math.ceil(math.log2(n))))


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
        n_snapshots: int | None = None,
    ):
        """`n_pages`: the pool (default: every slot's full context, so nothing is ever
        preempted); at least one full context. `vocab_size`: sample ids below it only.
        `speculative`: decode by speculation with the model's MTP layers (`speculation.py`),
        `draft_depth` of them drafting (default: sample.draft_depth, else all). `record`:
        keep each request's experts and tempered log-probs (`recording.py`). `n_snapshots`:
        a hybrid's prefix states kept (`snapshots.py`; default 2 per slot)."""
        cfg = sampler.cfg
        sizes = dict(max_slots=max_slots, page_size=page_size, n_pages=n_pages, chunk=chunk,
                     max_queue=max_queue)  # fmt: skip
        if problem := model_problem(cfg, speculative) or size_problem(sizes):
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
            n_snapshots = 2 * max_slots if n_snapshots is None else n_snapshots
            rows = max_slots + n_snapshots  # a hybrid's state rows: the slots', snapshots
            self.programs = Programs(sampler, n_pages, n_window, page_size, n_slots=rows)
        self.speculation = Speculation(self, K) if K else None
        self.window = window if self.programs.has_rings else 0
        self.shares_prefixes = not self.window  # (ring layers drop a prefix's pages)
        self.snapshots = None  # a hybrid's prefix states, rows past the slots'
        if self.programs.has_states:
            self.snapshots = Snapshots(n_snapshots, max_slots, page_size)
            self.state_rows = max_slots + n_snapshots
        self.window_pool = PagePool(max_slots * per_slot if self.window else 1, page_size)
        self.max_queue, self.n_vocab = max_queue, vocab_size or self.V
        self.queue: deque[Seq] = deque()
        self.slots: list[Seq | None] = [None] * max_slots
        self._ids = itertools.count()
        self._admitted = itertools.count()
        self._order: dict[int, int] = {}  # rid -> admission number (preemption picks the last)
        self.preempted = 0  # requests preempted so far
        self.prefilled = 0  # positions computed by prefill chunks so far (shared ones are not)
        self.recorder = Recorder(cfg, page_size) if record else None
        self.records = self.recorder.finished if record else {}  # rid -> a finished Record

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, params: SamplingParams = GREEDY) -> int:
        """Queue a request (token ids); -> its id. EngineError if unusable, QueueFull."""
        prompt = self._checked(prompt, params)
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests); retry later")
        rid = next(self._ids)
        key_data = jax.random.key_data(jax.random.fold_in(jax.random.key(params.seed), params.row))
        self.queue.append(Seq(rid, prompt, params, np.asarray(key_data, np.uint32)))
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
            shared = self.pool.match_prefix(tokens) if self.shares_prefixes else []
            restore = -1
            if self.snapshots is not None:  # as many pages as a kept state covers
                m, restore = self.snapshots.find(tokens, len(shared))
                self.pool.release(shared[m:])
                shared = shared[:m]
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
            if restore >= 0:
                seq.restore = restore
                self.snapshots.pin(restore)
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
        if not self.shares_prefixes or end > len(tokens) - 1:  # (match_prefix leaves one)
            return False
        slots = [s for s in self.slots if s is not None and s.prefilling]
        return any(s.prompt[:end] == tokens[:end] for s in slots)

    def _pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def _prefill(self, seqs: list[Seq]) -> list[Event]:
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
                if self.snapshots is not None:
                    end = self.snapshots.boundary(seq.prompt, seq.done, end)
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
        batch = self._batch(rows, tokens_RC, positions_RC, last_R, ends)
        if self.speculation is not None:
            return self.speculation.prefill(seqs, batch, ends)
        picked = self.programs.run(batch, self._mode(seqs))
        events = []
        for i, (seq, end) in enumerate(zip(seqs, ends, strict=True)):
            if seq.restore >= 0:  # read: its row may give way now
                self.snapshots.unpin(seq.restore)
                seq.restore = -1
            if self.recorder is not None:
                self.recorder.fed(seq, picked, i, seq.done, end - seq.done)
            seq.done = end
            if end < len(seq.tokens):  # a middle chunk (or a preempted one's refill): no token
                continue
            if self.shares_prefixes:
                findable = self.pool.register(seq.prompt, seq.pages)
                if self.recorder is not None:
                    self.recorder.registered(seq, findable)
            events += self._emit(seq, picked, i)
        return events

    def _decode(self, seqs: list[Seq]) -> list[Event]:
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

    def _grow(self, seq: Seq, n_positions: int) -> bool:
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

    def _window_pages(self, seq: Seq, end: int) -> None:
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

    def _preempt(self, seq: Seq) -> None:
        """Free `seq`'s slot and pages; it waits at the queue's head to be refilled."""
        self._leave(seq)
        seq.done, seq.slot = 0, -1
        self.preempted += 1
        self.queue.appendleft(seq)

    def _leave(self, seq: Seq) -> None:
        if seq.restore >= 0:  # admitted, never prefilled
            self.snapshots.unpin(seq.restore)
            seq.restore = -1
        self.pool.release(seq.pages)
        self.window_pool.release([p for p in seq.window_pages if p >= 0])
        seq.pages, seq.window_pages = [], []
        self.slots[seq.slot] = None
        seq.slot = -1
        self._order.pop(seq.rid, None)

    def _emit(self, seq: Seq, picked: Picked, row: int) -> list[Event]:
        ids, logprobs = picked.top_ids_BK[row].tolist(), picked.top_logprobs_BK[row].tolist()
        top = tuple(zip(ids, logprobs, strict=True))
        event = self._event(seq, int(picked.tokens_B[row]), float(picked.logprob_B[row]), top)
        if self.recorder is not None:
            self.recorder.picked(seq, picked, row, event.finish_reason is not None)
        return [event]

    def _event(self, seq: Seq, token: int, logprob: float, top, draft: int = -1) -> Event:
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

    def _batch(self, rows, tokens_BT, positions_BT, last_B, ends=()) -> Batch:
        """The call's inputs; empty rows (None) get padding and greedy rules. `ends`: a
        prefill's rows' ends, where a hybrid may keep their states (`snapshots.py`)."""
        B = len(rows)
        width = table_width(np.array([len(s.pages) for s in rows if s is not None]), self.max_pages)
        table_BM = np.zeros((B, width), np.int32)
        window_BM = np.zeros((B, width if self.window else 1), np.int32)
        keys_B2 = np.zeros((B, 2), np.uint32)
        step_B = np.zeros(B, np.int32)
        temperature_B = np.zeros(B, np.float32)
        top_k_B = np.full(B, self.V, np.int32)
        top_p_B = np.full(B, 2.0, np.float32)
        from_B, slot_B, snap_B = self._state_rows(rows, ends)
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
            temperature_B, top_k_B, top_p_B, np.int32(self.n_vocab), from_B, slot_B, snap_B,
        )  # fmt: skip

    def _state_rows(self, rows, ends) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A hybrid's state rows per batch row (`Batch.from_B` ...; padding: none): read from
        its restored snapshot, its slot, or none at position 0; written to its slot, and a
        snapshot row where a prefill ends on a page boundary to keep."""
        none = self.state_rows if self.snapshots is not None else self.max_slots
        from_B, slot_B, snap_B = (np.full(len(rows), none, np.int32) for _ in range(3))
        if self.snapshots is None:
            return from_B, slot_B, snap_B
        for i, seq in enumerate(rows):
            if seq is None:
                continue
            from_B[i] = seq.restore if seq.restore >= 0 else seq.slot if seq.done else none
            slot_B[i] = seq.slot
            if i < len(ends) and (row := self.snapshots.target(seq.prompt, ends[i])) >= 0:
                snap_B[i] = row
        return from_B, slot_B, snap_B

    def _mode(self, seqs: list[Seq]) -> PickMode:
        ps = [s.params for s in seqs]
        all_greedy = all(p.temperature == 0 for p in ps)
        any_filter = any(0 < p.top_k < self.V or p.top_p < 1 for p in ps if p.temperature > 0)
        return PickMode(all_greedy, any_filter, self.recorder is not None)
