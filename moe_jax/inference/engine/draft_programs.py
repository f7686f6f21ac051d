"""The engine's speculative programs (`Engine(speculative=True)`): speculative decoding with
the model's MTP layers (`inference.speculative`'s method) per request, over the paged caches.

    progs = DraftPrograms(sampler, n_pages, n_window_pages, page_size, max_slots, K)
    out = progs.prefill(batch, PrefillRows(...), mode)  # a chunk; a prompt's last: x, d_1..d_K
    out = progs.verify(batch, VerifyRows(...), mode)    # [x, d_1..d_K] checked: 1..K+1 tokens

Each request holds its newest token x (at position p, not yet fed) and K drafts d_1..d_K of
the tokens after it, as a row of `SpeculativeSampler` does, and a verify call
1. runs the main layers on [x, d_1..d_K] at p..p+K (a [rows, K+1] call);
2. keeps drafts by each row's own rule (`RowRule`: greedy rows while a draft is the argmax,
   sampled ones by `acceptance`' rejection rule with their temperature and filters)
   while the request has room for them (stop ids end a request on the host, which emits the
   step's tokens up to the first), and adds the main model's token after the kept ones;
3. drafts again from the newest token's predecessor s = p + n_kept with
   `speculative.draft_chain`, the sampler's own chain of MTP depths.
The last prefill chunk of a prompt picks x (a preempted request refilled has it) and drafts
after it as `speculative`'s prefill does; the chunks before it fill the MTP caches too.

State on the device per slot (a request keeps its slot while it runs; a row of a call names
it): the drafts' distributions q [slots, K, V] (the rejection rule reads them; greedy rows
none) and h_k at p - k, depth k+1's first input next step ([slots, D] per k < K). The drafts
themselves go to the host, which feeds them back as tokens.

MTP caches: a page pool per drafting depth, read through the request's own page table (the
window pool's where the last layer, whose kind the MTP layers take, has a sliding window), so
a request's pages hold every layer's keys at the same positions, and depth k's position t the
entry made from token t+k. Such entries past the newest token's predecessor are hypothetical
(from drafts), as in `speculative`: depth k's call starts at p+1-k and writes them again.

Rejected drafts are not rolled back: their keys are overwritten before any query reads them.
A verify call writes the main layers' positions p..p+K (those the request has room for) and
depth k's up to s only (`_Drafter`: positions past s are written nowhere); the next call
starts at the new newest token, p + n_kept + 1 (depth k at s + 2 - k), and writes every one
of those stale positions first, while attention masks by position (no query sees a key past
its own position). Pages stay with the request (the next call writes as far), so nothing is
freed or copied. The host gives each call pages up to the last position it writes; a
position never lands in a page the request does not hold.

Prefix sharing: a shared prompt page is never written, and depth k's entry at t is the
request's own only where token t+k is too, so a request takes the shared pages that end K
positions before the prefix it matched (the engine drops the others) and computes the rest.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.inference.acceptance import DraftRule, step_keys
from moe_jax.inference.decoding import model_of
from moe_jax.inference.engine.programs import (
    Batch,
    PickMode,
    Programs,
    forward_pages,
    is_ring,
    token_logprobs,
)
from moe_jax.inference.next_token import Mode
from moe_jax.inference.speculative import draft_chain, mtp_depth, mtp_draft, put_at, take_at


class PrefillRows(NamedTuple):
    """A prefill chunk's rows beyond its `Batch` (host arrays; B rows of C tokens)."""

    slot_B: np.ndarray  # int32: the slot whose state a last chunk sets; max_slots: none
    final_B: np.ndarray  # bool: the chunk ends the row's prefill (draft after it)
    fresh_B: np.ndarray  # bool: ... and picks its first token (else x is given: a refill)
    ahead_BF: np.ndarray  # int32 [B, C + K]: the token after each chunk position (0: unknown)


class VerifyRows(NamedTuple):
    """A verify call's rows beyond its `Batch` (host arrays; B rows of K+1 tokens)."""

    slot_B: np.ndarray  # int32: the row's slot (its state); max_slots: padding
    room_B: np.ndarray  # int32: tokens the request may still emit (0: padding)


class Prefilled(NamedTuple):
    """A prefill call's picks per row (host arrays): the first token (a last, fresh chunk's),
    its log-probability and the top ones (as `programs.Picked`), the drafts after it."""

    tokens_B: np.ndarray
    logprob_B: np.ndarray
    top_ids_BK: np.ndarray
    top_logprobs_BK: np.ndarray
    drafts_BK: np.ndarray


class Verified(NamedTuple):
    """A verify call's result per row (host arrays): the step's tokens [B, K+1] (the kept
    drafts, then the main model's), the drafts kept [B] and which [B, K] (each reached: the
    ones before it kept, room for it), each token's log-probability and top ones, and the
    next drafts [B, K]."""

    tokens_BT: np.ndarray
    n_kept_B: np.ndarray
    kept_BK: np.ndarray
    logprob_BT: np.ndarray
    top_ids_BTK: np.ndarray
    top_logprobs_BTK: np.ndarray
    drafts_BK: np.ndarray


@dataclasses.dataclass(frozen=True)
class RowRule:
    """Each row's own sampling rule (the engine's requests differ) with `DraftRule`'s draw
    and check: greedy rows by the argmax, sampled rows by their temperature and filters (the
    static mode only skips what no row needs, as `programs.pick`)."""

    greedy_B: jax.Array
    greedy: DraftRule
    sampled: DraftRule | None  # None: every row greedy

    @classmethod
    def of(cls, b: Batch, mode: PickMode) -> RowRule:
        greedy_B = b.temperature_B == 0
        greedy = DraftRule(None, None, None, b.n_vocab, Mode(True, False, False))
        if mode.all_greedy:
            return cls(greedy_B, greedy, None)
        temperature_B1 = jnp.where(greedy_B, 1.0, b.temperature_B)[:, None]  # greedy: unused
        filters = Mode(False, mode.any_filter, mode.any_filter)  # off: top_k V, top_p 2
        sampled = DraftRule(
            temperature_B1, b.top_k_B[:, None], b.top_p_B[:, None], b.n_vocab, filters
        )
        return cls(greedy_B, greedy, sampled)

    def draw(self, logits_BV, keys_B):
        """-> (a token per row [B], the sampled rows' distributions [B, V] or [B, 0])."""
        tok_B, q_BV = self.greedy.draw(logits_BV, keys_B)
        if self.sampled is None:
            return tok_B, q_BV
        drawn_B, q_BV = self.sampled.draw(logits_BV, keys_B)
        return jnp.where(self.greedy_B, tok_B, drawn_B), q_BV

    def check(self, logits_BTV, drafts_BK, q_BKV, keys_B):
        """`DraftRule.check` row by row -> (kept [B, K], each on its own; the token after the
        first n_kept drafts, `next_token(n_kept_B, key_B)`)."""
        greedy = self.greedy.check(logits_BTV, drafts_BK, None, keys_B)
        if self.sampled is None:
            return greedy.kept_BK, greedy.next_token
        # DraftRule.check reads the main model's logits as rows of [B * T, V]: each row's
        # values once per position.
        T = logits_BTV.shape[1]
        each = lambda a_B1: jnp.repeat(a_B1, T, axis=0)
        s = self.sampled
        rule = dataclasses.replace(
            s, temperature=each(s.temperature), top_k=each(s.top_k), top_p=each(s.top_p)
        )
        sampled = rule.check(logits_BTV, drafts_BK, q_BKV, keys_B)
        g_B = self.greedy_B
        kept_BK = jnp.where(g_B[:, None], greedy.kept_BK, sampled.kept_BK)

        def next_token(n_kept_B, key_B):
            by_rule = greedy.next_token(n_kept_B, key_B), sampled.next_token(n_kept_B, key_B)
            return jnp.where(g_B, *by_rule)

        return kept_BK, next_token


@dataclasses.dataclass(frozen=True)
class _Drafter:
    """`speculative.draft_chain`'s runner over the paged MTP caches: `mtp_depth` and
    `mtp_draft` with the request's table, writing no position past `limit_B`."""

    model: object
    rule: RowRule
    K: int
    table_BM: jax.Array
    limit_B: jax.Array | None = None  # None: every position written

    def depth(self, k: int, h_BTD, ahead_BT, positions_BT, cache):
        if self.limit_B is not None:  # past s: rewritten by a later call before it is read
            positions_BT = jnp.where(positions_BT <= self.limit_B[:, None], positions_BT, -1)
        paged = cache | {"table": self.table_BM}
        h_BTD, new = mtp_depth(self.model, k, h_BTD, ahead_BT, positions_BT, paged)
        return h_BTD, {name: a for name, a in new.items() if name != "table"}

    def draft(self, k: int, h_BD, key_B):
        return mtp_draft(self.model, self.rule, k, h_BD, key_B)


def _mtp_table(cfg, b: Batch):
    """The MTP layers' page table: of the kind of the last layer (`mtp.py`)."""
    return b.window_BM if is_ring(cfg, cfg.model.n_layers - 1) else b.table_BM


def _store(state: dict, slot_B, carried: list, q_BKV) -> dict:
    """The state with each row's carried h_k and drafts' distributions at its slot (a slot
    past the state's: padding, none)."""
    h = [
        h_SD.at[slot_B].set(h_BD, mode="drop")
        for h_SD, h_BD in zip(state["h"], carried, strict=True)
    ]
    q = state["q"]
    if q_BKV.shape[-1]:  # greedy calls have none (and read none)
        q = q.at[slot_B].set(q_BKV, mode="drop")
    return {"h": h, "q": q}


def _prefill_keys(b: Batch, K: int) -> list:
    """The first token's key and the K drafts' per row: the sampler's prefill's (`step_keys`
    at step 0) for a fresh request, or for a refill the drafts' of the step `b.step_B` it
    drafted at last, so that a preempted request drafts what it had."""
    row_keys_B = jax.random.wrap_key_data(b.keys_B2)
    fresh = step_keys(row_keys_B, 0, K + 1)
    again = step_keys(row_keys_B, b.step_B, K + 2)[2:]
    data = jax.random.key_data
    is_fresh_B1 = (b.step_B == 0)[:, None]
    pick = lambda f, a: jax.random.wrap_key_data(jnp.where(is_fresh_B1, data(f), data(a)))
    return [fresh[0]] + [pick(f, a) for f, a in zip(fresh[1:], again, strict=True)]


def _prefill(graphdef, K, weights, pages, state, b: Batch, r: PrefillRows, *, mode):
    """One chunk through the main layers and the K MTP depths; a last chunk's first token
    and drafts (module doc) -> (`Prefilled`'s arrays, the pages, the state)."""
    model = model_of(graphdef, weights.params, weights.blocks)
    rule = RowRule.of(b, mode)
    main = {name: p for name, p in pages.items() if name != "mtp"}
    x_BCD, main = forward_pages(model, len(weights.blocks), main, b, head=False)
    logits_BV = model.logits(take_at(x_BCD, b.last_B)[:, None])[:, 0]
    first_key, *draft_keys = _prefill_keys(b, K)
    drawn_B, _ = rule.draw(logits_BV, first_key)
    x_B = jnp.where(r.fresh_B, drawn_B, take_at(r.ahead_BF, b.last_B))
    # The text and its hypothesis after a last chunk: x, then each draft once drawn (an
    # index past the row's end, for the other rows: unchanged).
    F = r.ahead_BF.shape[1]
    at_B = lambda i_B: jnp.where(r.final_B, i_B, F)
    ahead_BF = put_at(r.ahead_BF, at_B(b.last_B), x_B)
    C = b.tokens_BT.shape[1]
    drafter = _Drafter(model, rule, K, _mtp_table(model.cfg, b))
    h_BCD, drafts, qs, carried, caches = x_BCD, [], [], [], []
    for k in range(1, K + 1):  # depth k at chunk position i takes the token at i + k
        ahead_BC = ahead_BF[:, k - 1 : k - 1 + C]
        h_BCD, cache = drafter.depth(k, h_BCD, ahead_BC, b.positions_BT, pages["mtp"][k - 1])
        d_B, q_BV = drafter.draft(k, take_at(h_BCD, b.last_B), draft_keys[k - 1])
        ahead_BF = put_at(ahead_BF, at_B(b.last_B + k), d_B)
        drafts.append(d_B)
        qs.append(q_BV)
        caches.append(cache)
        if k < K:  # the first verify's depth k+1 starts at p - k (p: x's position)
            carried.append(take_at(h_BCD, jnp.maximum(b.last_B + 1 - k, 0)))
    slot_B = jnp.where(r.final_B, r.slot_B, state["q"].shape[0])
    state = _store(state, slot_B, carried, jnp.stack(qs, 1))
    picked = (x_B, *token_logprobs(logits_BV, x_B, b.n_vocab), jnp.stack(drafts, 1))
    return picked, main | {"mtp": caches}, state


def _verify(graphdef, K, weights, pages, state, b: Batch, r: VerifyRows, *, mode):
    """One step of every row (module doc) -> (`Verified`'s arrays, the pages, the state)."""
    model = model_of(graphdef, weights.params, weights.blocks)
    rule = RowRule.of(b, mode)
    main = {name: p for name, p in pages.items() if name != "mtp"}
    x_BTD, main = forward_pages(model, len(weights.blocks), main, b, head=False)
    logits_BTV = model.logits(x_BTD)
    row_keys_B = jax.random.wrap_key_data(b.keys_B2)
    check_key, next_key, *draft_keys = step_keys(row_keys_B, b.step_B, K + 2)
    drafts_BK = b.tokens_BT[:, 1:]
    q_BKV = None if rule.sampled is None else state["q"][r.slot_B]
    verdict_BK, next_token = rule.check(logits_BTV, drafts_BK, q_BKV, check_key)
    # Draft j is checked while the ones before it were kept and the request has room for it.
    before_BK = jnp.cumprod(jnp.pad(verdict_BK[:, :-1], ((0, 0), (1, 0)), constant_values=True), 1)
    room_BK = jnp.arange(1, K + 1)[None] <= r.room_B[:, None]
    kept_BK = before_BK.astype(bool) & room_BK & verdict_BK
    n_kept_B = jnp.sum(kept_BK, axis=1, dtype=jnp.int32)
    next_B = next_token(n_kept_B, next_key)
    i_T = jnp.arange(K + 1)
    drafts_BT = jnp.pad(drafts_BK, ((0, 0), (0, 1)))
    step_BT = jnp.where(i_T[None] == n_kept_B[:, None], next_B[:, None], drafts_BT)
    # Then the drafts, from the newest token's predecessor s = p + n_kept.
    p_B = b.positions_BT[:, 0]
    ahead_BF = jnp.where(i_T[None] <= n_kept_B[:, None], step_BT, 0)
    ahead_BF = jnp.pad(ahead_BF, ((0, 0), (0, 2 * K)))  # room for drafts and a clamped start
    carried = {"h": [h_SD[r.slot_B] for h_SD in state["h"]], "mtp": pages["mtp"]}
    table_BM = _mtp_table(model.cfg, b)
    drafter = _Drafter(model, rule, K, table_BM, limit_B=p_B + n_kept_B)
    new_drafts_BK, q_BKV, h, caches = draft_chain(
        drafter, carried, x_BTD, p_B, n_kept_B, ahead_BF, draft_keys
    )
    state = _store(state, r.slot_B, h, q_BKV)
    logprobs = token_logprobs(logits_BTV, step_BT, b.n_vocab)
    verified = (step_BT, n_kept_B, kept_BK, *logprobs, new_drafts_BK)
    return verified, main | {"mtp": caches}, state


@functools.lru_cache(maxsize=8)
def _jitted(graphdef, K: int):
    """The jitted prefill and verify for one graph and depth, shared by its engines."""
    jit = lambda f: jax.jit(
        partial(f, graphdef, K), static_argnames="mode", donate_argnames=("pages", "state")
    )
    return jit(_prefill), jit(_verify)


def init_state(model, max_slots: int, K: int, mesh=None) -> dict:
    """Every slot's carried hidden states and drafts' distributions, zeroed (replicated)."""
    D, V = model.cfg.model.d_model, model.cfg.model.vocab_size
    state = {
        "h": [jnp.zeros((max_slots, D), model.dtype) for _ in range(K - 1)],
        "q": jnp.zeros((max_slots, K, V), jnp.float32),
    }
    return state if mesh is None else jax.device_put(state, NamedSharding(mesh, P()))


class DraftPrograms(Programs):
    """`Programs` with the MTP layers' pools, the slots' state and the two calls above (one
    compile per shape and mode, as `Programs.run`)."""

    def __init__(
        self, sampler, n_pages: int, n_window_pages: int, page_size: int, max_slots: int, K: int
    ):
        super().__init__(sampler, n_pages, n_window_pages, page_size, K, max_slots)
        self.K = K
        with self._on_mesh():
            self.state = init_state(sampler.inference_model(), max_slots, K, self.mesh)
        self._prefill, self._verify = _jitted(sampler.graphdef, K)

    def prefill(self, batch: Batch, rows: PrefillRows, mode: PickMode) -> Prefilled:
        return Prefilled(*self._call("prefill", batch, rows, mode))

    def verify(self, batch: Batch, rows: VerifyRows, mode: PickMode) -> Verified:
        return Verified(*self._call("verify", batch, rows, mode))

    def _call(self, name: str, batch: Batch, rows, mode: PickMode):
        fn = self._prefill if name == "prefill" else self._verify
        widths = (batch.table_BM.shape[1], batch.window_BM.shape[1])
        self.shapes.add((name, batch.tokens_BT.shape, widths, mode))
        if self.mesh is not None:  # rows and rules replicated over the mesh
            batch, rows = jax.device_put((batch, rows), NamedSharding(self.mesh, P()))
        with self._on_mesh():
            out, self.pages, self.state = fn(
                self.weights, self.pages, self.state, batch, rows, mode=mode
            )
        return (np.asarray(a) for a in out)
