"""The engine's record for routing replay (`Engine(sampler, record=True)`, issue 53): each
request's experts at every position of its row and each sampled token's log-prob, as
`Sampler.generate(record=True)` gives them, so that GRPO's rollouts can be drawn by the engine.

    engine = Engine(sampler, record=True)
    gen = generate_recorded(engine, prompts, params)   # a Generation with routes and logprobs
    engine.records.pop(rid)                            # or a finished request's Record

Recording, every call of the engine returns its rows' experts and tempered log-probs
(`programs.PickMode.record`). A request's record is by position: its prompt's experts from
its prefill chunks, and at a shared prefix page those the page's first holder computed (kept
per findable page: a prefix's experts depend on its tokens alone), so G samples of one prompt,
prefilled once, each carry their whole row. A preempted request keeps its record: its refill
writes the same positions again, so nothing is shifted or recorded twice, and it emits no
token (`Engine._prefill`), so no log-prob is added.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_jax.inference.engine.programs import Picked
from moe_jax.inference.sampling import Generation


@dataclasses.dataclass
class Record:
    """One request's: its row as a trainer lays it out (prompt, then the sampled tokens)."""

    # int32 [n_moe_layers, prompt + max_tokens, top_k]: the experts each fed position took,
    # -1 where no token was fed (the last sampled one, which no step feeds, and beyond).
    routes_LSK: np.ndarray
    # Each sampled token's log-prob at the request's temperature (1 if greedy) over the whole
    # vocabulary (`programs.tempered_logprobs`): what a trainer recomputes.
    logprobs: list[float]


class Recorder:
    """The engine's records: of requests in flight (on each request), of findable prefix
    pages, and of finished requests (`finished`, the engine's `records`)."""

    def __init__(self, cfg, page_size: int):
        self.n_layers = sum(cfg.is_moe(i) for i in range(cfg.model.n_layers))
        self.top_k, self.page_size = cfg.moe.top_k, page_size
        # A findable page's experts [L, page_size, K]; an entry outlives its page's hash but
        # is only read for pages `match_prefix` returns, each set when it became findable.
        self.page_routes: dict[int, np.ndarray] = {}
        self.finished: dict[int, Record] = {}  # rid -> the record of a request that ended

    def admitted(self, seq, n_shared: int) -> None:
        """`seq` took a slot with its first `n_shared` pages shared: their experts."""
        if seq.record is None:
            S = len(seq.prompt) + seq.params.max_tokens
            routes = np.full((self.n_layers, S, self.top_k), -1, np.int32)
            seq.record = Record(routes, [])
        PS = self.page_size
        for i, page in enumerate(seq.pages[:n_shared]):
            seq.record.routes_LSK[:, i * PS : (i + 1) * PS] = self.page_routes[page]

    def fed(self, seq, picked: Picked, row: int, start: int, n: int) -> None:
        """A call fed `seq`'s positions [start, start + n) in row `row`."""
        seq.record.routes_LSK[:, start : start + n] = picked.routes_LBTK[:, row, :n]

    def registered(self, seq, indices: list[int]) -> None:
        """`seq`'s pages at `indices` became findable: keep their experts for sharers."""
        PS = self.page_size
        for i in indices:
            self.page_routes[seq.pages[i]] = seq.record.routes_LSK[:, i * PS : (i + 1) * PS].copy()

    def picked(self, seq, picked: Picked, row: int, finished: bool) -> None:
        """`seq` sampled a token in row `row` (and, `finished`, ended with it)."""
        seq.record.logprobs.append(float(picked.tempered_B[row]))
        if finished:
            self.finished[seq.rid] = seq.record


def generate_recorded(engine, prompts, params) -> Generation:
    """Every prompt to its end through a recording engine (each with its SamplingParams)
    -> the Generation `Sampler.generate(record=True)` gives: tokens [B, N] (-1 after a
    request's end), routes [L, B, longest prompt + N, K], logprobs [B, N]; N the largest
    max_tokens, `steps` the engine steps run."""
    rids = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    out, steps = {rid: [] for rid in rids}, 0
    while engine.has_work():
        for e in engine.step():
            out.setdefault(e.rid, []).append(e.token)
        steps += 1
    B, N = len(rids), max(q.max_tokens for q in params)
    S = max(map(len, prompts)) + N
    rec = engine.recorder
    tokens, logprobs = np.full((B, N), -1, np.int32), np.zeros((B, N), np.float32)
    routes = np.full((rec.n_layers, B, S, rec.top_k), -1, np.int32)
    for b, rid in enumerate(rids):
        record, n = engine.records.pop(rid), len(out[rid])
        tokens[b, :n], logprobs[b, :n] = out[rid], record.logprobs
        routes[:, b, : record.routes_LSK.shape[1]] = record.routes_LSK
    lengths = np.array([len(out[r]) for r in rids], np.int32)
    return Generation(tokens, lengths, steps, routes=routes, logprobs=logprobs)
