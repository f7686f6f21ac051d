"""Speculative decoding with the model's own MTP module as the draft (DeepSeek-V3,
arXiv:2412.19437 sec. 5.4.3: 85-90% of its second-token predictions accepted).

    sampler = SpeculativeSampler(model)         # model.mtp_depth >= 1; sample.speculative=true
    out = sampler.generate(prompts, 100, temperature=0)
    out.sequences()                             # the greedy text, token for token
    out.acceptance_rate, out.acceptance_rates   # drafts kept, all together and per depth

The program is the plain sampler's (`sampling`: one jitted prefill + while loop, the
same arguments, prompt buckets, stop tokens, streaming and mesh, on the same loop skeleton,
`decoding`) with another prefill and loop body. With
K drafting depths (`draft_depth`, sample.draft_depth: 1..model.mtp_depth, default all) a row
holds its newest token x (at position p, not yet fed) and drafts d_1..d_K of the K tokens
after it, and each step
1. runs the main model on [x, d_1, .., d_K] at positions p..p+K, one forward of K+1
   positions, whose distribution at p+j-1 is the one the plain sampler would draw d_j's
   token from;
2. keeps d_1, d_2, .. while the rule keeps them (`acceptance`: greedy, while each is
   the main model's argmax; at a temperature, speculative sampling's rejection rule) and
   emits them and one more token of the main model's (at the first rejection, or the bonus
   after all K): 1 to K+1 tokens, each distributed exactly as the plain sampler's (greedy:
   the same token);
3. drafts again from the newest token's predecessor s: depth 1 there (the main model's hidden
   state at s and the token at s+1, the newest) drafts d_1, and depth k (its input depth k-1's
   hidden state at s and d_{k-1}, `mtp.py`'s recurrence) drafts d_k, each drawn from its
   depth's distribution by the same rule.

The MTP layers' inputs: depth k at position t takes h_{k-1}(t) and token t+k, as in training.
While token t+k is not yet emitted (t > s + 1 - k), the hypothesis stands in for it: the
newest token and the drafts before d_k, so a draft is what the full forward over the text
followed by the drafts before it gives (the tests check this). Depth k's cache therefore holds
hypothetical entries at positions s+2-k..s, which the next step writes again once the tokens
are known: each step runs depth k over positions p+1-k..p+K (K+k positions: its hypothetical
slots of the last step, this step's positions, and beyond the newest token entries that a
later step writes before any query reads them), from h_{k-1} of depth k-1's call and the one
position before it that depth k-1 does not run again, carried from the step before. Near the
start (p+1-k < 0) depth k runs positions 0..K+k-1 instead.

KV caches after a rejection: a step writes slots up to p+K of the main layers' caches and of
the MTP layers', holding keys of rejected drafts or of hypothetical tokens. The next call of
each layer starts at or before the first of those slots (the main layers at the new newest
token, depth k at its first hypothetical slot) and writes all of them again before any query
reads them (attention masks by position: a query never sees a slot past its own), and the
cache has room for p+K of any row (2K slots more than the plain sampler's). A sliding
window's ring attends to its keys older than the call's first position only
(`kv_cache.ring_keys`), so a stale entry is never read; and a ring is here 2K-1 slots longer
than its window W, so that what a stale entry at t replaced, t - (W + 2K - 1), lies outside
the window of every later query (a slot written lies at most 2K-1 positions past the next
call's first). The MTP layers' caches are of the kind of the last main layer's
(`Transformer.init_cache(mtp=True)`), carried apart from the main layers', and filled in the
prefill from the prompt's hidden states (the last k-1 positions of depth k from the first
token and the first drafts: hypothetical).

Rows advance at their own pace (their positions differ); a finished row stays where it
stopped. A step checks only as many drafts as the row has room for, and ends at an emitted
stop token. Streaming (`on_token`) calls back K+1 times a step, with each row's first, second,
.. token of the step (-1 where it emitted none), so its step numbers count calls, not tokens.
Randomness: each row's key (`fold_in(seed, row)`, as the plain sampler's) folded with the step
and split (`acceptance.step_keys`): a seed gives the same text, but not the plain
sampler's text (the same distribution, drawn otherwise).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.inference.acceptance import DraftRule, step_keys
from moe_jax.inference.decoding import Decoding, Program, Request, Weights, loop, shard_cache
from moe_jax.inference.sampling import Generation, Sampler, SamplingError
from moe_jax.model import Transformer, weight_gather


@dataclasses.dataclass(frozen=True)
class SpeculativeGeneration(Generation):
    drafted_by_depth: np.ndarray  # int32 [B, K]: drafts of each depth the main model checked
    accepted_by_depth: np.ndarray  # int32 [B, K]: those it kept
    # int32 [B, max_new_tokens]: the draft each token was checked against (-1: none, as for
    # the first token and a bonus token); the token equals it where the draft was kept
    drafts: np.ndarray

    @property
    def drafted(self) -> np.ndarray:
        """Drafts checked per row [B], all depths together."""
        return self.drafted_by_depth.sum(axis=1)

    @property
    def accepted(self) -> np.ndarray:
        """Drafts kept per row [B], all depths together."""
        return self.accepted_by_depth.sum(axis=1)

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over checked drafts, all rows and depths (nan if none was checked)."""
        return _rate(np.sum(self.accepted), np.sum(self.drafted))

    @property
    def acceptance_rates(self) -> list[float]:
        """Per depth k: the drafts of depth k kept over those checked (depth k is checked
        only after depths 1..k-1 were kept), all rows (nan where none was checked)."""
        accepted_K, drafted_K = self.accepted_by_depth.sum(0), self.drafted_by_depth.sum(0)
        return [_rate(a, d) for a, d in zip(accepted_K, drafted_K, strict=True)]


def _rate(accepted, checked) -> float:
    return float(accepted) / int(checked) if checked else float("nan")


@dataclasses.dataclass(frozen=True)
class _Runner:
    """The program's model calls beyond the plain sampler's (`decoding.Decoding`, `d`): the
    main layers without the head, the head, the MTP depths; and the sampling rule."""

    d: Decoding
    rule: DraftRule
    K: int  # depths that draft

    def model(self):
        return self.d.model()

    def main(self, tokens_BT, positions_BT, cache):
        """The main layers -> (their last output [B, T, D], the new cache)."""
        return self.d.forward(tokens_BT, positions_BT, cache, head=False)

    def logits(self, x_BTD):
        """The main model's float32 logits after each position [B, T, V]."""
        return self.model().logits(x_BTD)

    def depth(self, k: int, h_BTD, ahead_BT, positions_BT, cache):
        """MTP depth k over h_{k-1} and the tokens k ahead -> (h_k [B, T, D], its cache)."""
        h_BTD, cache = mtp_depth(self.model(), k, h_BTD, ahead_BT, positions_BT, cache)
        return h_BTD, shard_cache(cache)

    def draft(self, k: int, h_BD, key_B):
        """Depth k's draft from its hidden state at the newest token's predecessor [B, D]
        -> (token [B], its distribution [B, V] or [B, 0] greedy)."""
        return mtp_draft(self.model(), self.rule, k, h_BD, key_B)


def mtp_depth(model, k: int, h_BTD, ahead_BT, positions_BT, cache):
    """MTP depth k of `model` over h_{k-1} and the tokens k ahead -> (h_k [B, T, D], its
    cache) (also the engine's, `moe_jax.inference.engine.draft_programs`, over its pages)."""
    emb_BTD = weight_gather.lookup(ahead_BT, model.embed.embedding, model.dtype)
    h_BTD, cache, _ = model.mtp[k - 1](h_BTD, emb_BTD, positions_BT, cache, 1, None)
    return h_BTD, cache


def mtp_draft(model, rule, k: int, h_BD, key_B):
    """Depth k's draft by `rule` (its `draw`) from its hidden state [B, D] -> (token [B], its
    distribution [B, V] or [B, 0] greedy)."""
    h_B1D = h_BD[:, None]
    logits_B1V = model.mtp[k - 1].logits(h_B1D, model.head_weight(h_B1D))
    return rule.draw(logits_B1V[:, 0], key_B)


def take_at(x_BT, i_B):
    """x[b, i_B[b]] of an array [B, T, ...] -> [B, ...]."""
    i = i_B.reshape(-1, *([1] * (x_BT.ndim - 1)))
    return jnp.take_along_axis(x_BT, i, axis=1)[:, 0]


def put_at(x_BT, i_B, value_B):
    """x [B, T] with x[b, i_B[b]] = value_B[b] (an index past T: unchanged)."""
    return jnp.where(jnp.arange(x_BT.shape[1])[None] == i_B[:, None], value_B[:, None], x_BT)


def wider_rings(cache, extra: int):
    """The cache with each sliding-window ring `extra` slots longer (module doc: keys that a
    step's stale entries replace lie outside every later window). A fresh cache: all empty."""
    if isinstance(cache, list):
        return [wider_rings(c, extra) for c in cache]
    if not isinstance(cache, dict):
        return cache
    if "pos" not in cache:
        return {name: wider_rings(c, extra) for name, c in cache.items()}
    axis = cache["pos"].ndim - 1  # [..., B, W] and [..., B, W, K, hd]
    longer = lambda a: a.shape[:axis] + (a.shape[axis] + extra,) + a.shape[axis + 1 :]
    ring = {name: jnp.zeros(longer(a), a.dtype) for name, a in cache.items() if name != "pos"}
    return ring | {"pos": jnp.full(longer(cache["pos"]), -1, cache["pos"].dtype)}


def _prefill(run: _Runner) -> dict:
    """The prompts through the main layers (as the plain sampler's prefill: padding at
    position -1) and, with every hidden state kept, through the MTP depths -> the loop's
    first carry: the first new token, its K drafts, the caches."""
    d, K = run.d, run.K
    prompt_BP, prompt_len_B, N = d.request.prompt_BP, d.request.prompt_len_B, d.N
    B, P = prompt_BP.shape
    cache = wider_rings(run.model().init_cache(B, P + N + 2 * K, mtp=True), 2 * K - 1)
    mtp_caches = [shard_cache(c) for c in cache.pop("mtp")[:K]]  # apart from the main layers'
    positions_BP = d.prompt_positions()
    x_BPD, cache = run.main(prompt_BP, positions_BP, d.unstacked(cache))
    last_B = prompt_len_B - 1
    first_key, *draft_keys = step_keys(d.row_keys_B, 0, K + 1)
    tok_B, _ = run.rule.draw(run.logits(take_at(x_BPD, last_B)[:, None])[:, 0], first_key)
    d.emit(0, tok_B)
    # The text and its hypothesis: the prompt, the new token, then each draft once drawn.
    seq_BS = put_at(jnp.pad(prompt_BP, ((0, 0), (0, K + 1))), last_B + 1, tok_B)
    h_BPD, drafts, qs, carried = x_BPD, [], [], []
    for k in range(1, K + 1):  # depth k at prompt position t takes token t+k
        ahead_BP = seq_BS[:, k : k + P]
        h_BPD, mtp_caches[k - 1] = run.depth(k, h_BPD, ahead_BP, positions_BP, mtp_caches[k - 1])
        d_B, q_BV = run.draft(k, take_at(h_BPD, last_B), draft_keys[k - 1])
        seq_BS = put_at(seq_BS, last_B + 1 + k, d_B)
        drafts.append(d_B)
        qs.append(q_BV)
        if k < K:  # the first step's depth k+1 starts at p - k = the prompt's length - k
            carried.append(take_at(h_BPD, jnp.maximum(prompt_len_B - k, 0)))
    zeros_BK = jnp.zeros((B, K), jnp.int32)
    return {
        "it": jnp.int32(1),
        "tok": tok_B,  # each row's newest token (fed next)
        "drafts": jnp.stack(drafts, 1),  # [B, K]: the drafts of the tokens after it
        "q": jnp.stack(qs, 1),  # [B, K, V]: their distributions ([B, K, 0] greedy)
        "h": carried,  # K-1 x [B, D]: h_k at p - k, depth k+1's first input
        "n": jnp.ones((B,), jnp.int32),  # tokens emitted
        "cache": cache,
        "mtp": mtp_caches,
        "out": jnp.full((B, N), -1, jnp.int32).at[:, 0].set(tok_B),
        "checked": jnp.full((B, N), -1, jnp.int32),
        "done": d.is_stop(tok_B) | (N <= 1),
        "drafted": zeros_BK,
        "accepted": zeros_BK,
    }


def _verify(run: _Runner, c: dict, p_B, keys: list):
    """Step 1-2 of the module doc: the main forward over the newest token and the drafts,
    the rule's verdict, and what the row emits -> (main hidden states [B, K+1, D], new
    cache, reached [B, K]: drafts checked, kept [B, K], n_kept [B], next_token [B], its
    presence [B])."""
    K, N, is_stop = run.K, run.d.N, run.d.is_stop
    positions_BT = p_B[:, None] + jnp.arange(K + 1, dtype=jnp.int32)
    tokens_BT = jnp.concatenate([c["tok"][:, None], c["drafts"]], axis=1)
    x_BTD, cache = run.main(tokens_BT, positions_BT, c["cache"])
    verdict = run.rule.check(run.logits(x_BTD), c["drafts"], c["q"], keys[0])
    # Draft j is checked while the ones before it were kept and emitted no stop token, and
    # the row has room for it (N - n tokens left).
    go_on_BK = verdict.kept_BK & ~is_stop(c["drafts"])
    before_BK = jnp.cumprod(jnp.pad(go_on_BK[:, :-1], ((0, 0), (1, 0)), constant_values=True), 1)
    room_B = N - c["n"]
    j_K = jnp.arange(1, K + 1)
    reached_BK = (~c["done"])[:, None] & (j_K[None] <= room_B[:, None]) & before_BK.astype(bool)
    kept_BK = reached_BK & verdict.kept_BK
    n_kept_B = jnp.sum(kept_BK, axis=1, dtype=jnp.int32)
    # One more token unless the kept drafts filled the row or ended it with a stop token.
    last_kept_B = take_at(c["drafts"], jnp.maximum(n_kept_B - 1, 0))
    stopped_B = (n_kept_B > 0) & is_stop(last_kept_B)
    extra_B = ~c["done"] & ~stopped_B & (n_kept_B < room_B)
    next_B = verdict.next_token(n_kept_B, keys[1])
    return x_BTD, cache, reached_BK, kept_BK, n_kept_B, next_B, extra_B


def draft_chain(run: _Runner, c: dict, x_BTD, p_B, n_kept_B, ahead_BF, keys: list):
    """Step 3 of the module doc: every depth over its positions, chained, drafting from the
    newest token's predecessor s = p + n_kept -> (drafts [B, K], their distributions, the
    hidden states the next step carries, the MTP caches). `ahead_BF`: the tokens at p+1..
    (the emitted ones, then 0), each draft put in as it is drawn. `run`: anything with K,
    depth and draft as `_Runner`'s (the engine's runs over its pages, `inference.engine`)."""
    K = run.K
    s_B = p_B + n_kept_B
    h_BTD, drafts, qs, carried, caches = x_BTD, [], [], [], []
    for k in range(1, K + 1):
        start_B = jnp.maximum(p_B + 1 - k, 0)  # depth k runs positions start..start+K+k-1
        if k > 1:  # h_{k-1} at start: carried, or (near the start) past what it needs
            h_B1D = c["h"][k - 2][:, None]
            clamped_B11 = (p_B + 1 - k < 0)[:, None, None]
            before = jnp.concatenate([h_B1D, h_BTD], axis=1)
            h_BTD = jnp.where(clamped_B11, jnp.concatenate([h_BTD, h_B1D], axis=1), before)
        window_T = jnp.arange(K + k, dtype=jnp.int32)
        positions_BT = start_B[:, None] + window_T
        ahead_BT = jnp.take_along_axis(ahead_BF, (start_B + k - p_B - 1)[:, None] + window_T, 1)
        h_BTD, cache = run.depth(k, h_BTD, ahead_BT, positions_BT, c["mtp"][k - 1])
        d_B, q_BV = run.draft(k, take_at(h_BTD, s_B - start_B), keys[k - 1])
        ahead_BF = put_at(ahead_BF, n_kept_B + k, d_B)  # d_k is the token at s + k + 1
        drafts.append(d_B)
        qs.append(q_BV)
        caches.append(cache)
        if k < K:  # the next step's depth k+1 starts at s + 1 - k
            carried.append(take_at(h_BTD, jnp.clip(s_B + 1 - k - start_B, 0, K + k - 1)))
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), carried, caches


def _step(run: _Runner, c: dict) -> dict:
    """One step of every row (the module doc): check the drafts, emit 1..K+1 tokens, draft."""
    d, K = run.d, run.K
    active_B = ~c["done"]
    p_B = d.request.prompt_len_B + c["n"] - 1  # the newest token's position
    check_key, next_key, *draft_keys = step_keys(d.row_keys_B, c["it"], K + 2)
    verified = _verify(run, c, p_B, [check_key, next_key])
    x_BTD, cache, reached_BK, kept_BK, n_kept_B, next_B, extra_B = verified
    # The step's tokens: the kept drafts, then the main model's where it adds one (token
    # ids everywhere, even where nothing is emitted: they feed the model, whose MoE layers
    # mix the rows' tokens, so that no row may feed it an id out of range).
    i_T = jnp.arange(K + 1)
    drafts_BT = jnp.pad(c["drafts"], ((0, 0), (0, 1)))
    step_BT = jnp.where(i_T[None] == n_kept_B[:, None], next_B[:, None], drafts_BT)
    count_B = n_kept_B + extra_B
    is_emitted_BT = i_T[None] < count_B[:, None]
    emitted_BT = jnp.where(is_emitted_BT, step_BT, -1)
    for i in range(K + 1):
        d.emit((K + 1) * (c["it"] - 1) + 1 + i, emitted_BT[:, i])
    # Then the drafts, from the newest token's predecessor (rows that ended: anything).
    ahead_BF = jnp.where(i_T[None] <= n_kept_B[:, None], step_BT, 0)
    ahead_BF = jnp.pad(ahead_BF, ((0, 0), (0, 2 * K)))  # room for drafts and a clamped start
    drafts_BK, q_BKV, carried, mtp_caches = draft_chain(
        run, c, x_BTD, p_B, n_kept_B, ahead_BF, draft_keys
    )
    checked_BT = jnp.where(jnp.pad(reached_BK, ((0, 0), (0, 1))), drafts_BT, -1)
    out_BN, checked_BN = _record(c, emitted_BT, checked_BT, count_B)
    n_B = c["n"] + count_B
    ended_B = jnp.any(d.is_stop(step_BT) & is_emitted_BT, axis=1)  # (stops are padded by -1)
    keep = lambda new, old: jnp.where(active_B.reshape(-1, *[1] * (old.ndim - 1)), new, old)
    return {
        "it": c["it"] + 1,
        "tok": keep(next_B, c["tok"]),
        "drafts": keep(drafts_BK, c["drafts"]),
        "q": keep(q_BKV, c["q"]),
        "h": carried,
        "n": n_B,
        "cache": cache,
        "mtp": mtp_caches,
        "out": out_BN,
        "checked": checked_BN,
        "done": c["done"] | (active_B & (ended_B | (n_B >= d.N))),
        "drafted": c["drafted"] + reached_BK,
        "accepted": c["accepted"] + kept_BK,
    }


def _record(c: dict, emitted_BT, checked_BT, count_B):
    """The step's tokens (and the drafts they were checked against) into the outputs
    [B, N] at each row's columns n..n+count-1."""
    col_BN, n_B1 = jnp.arange(c["out"].shape[1])[None, :], c["n"][:, None]
    out_BN, checked_BN = c["out"], c["checked"]
    for i in range(emitted_BT.shape[1]):
        at_BN = (col_BN == n_B1 + i) & (i < count_B)[:, None]
        out_BN = jnp.where(at_BN, emitted_BT[:, i : i + 1], out_BN)
        checked_BN = jnp.where(at_BN, checked_BT[:, i : i + 1], checked_BN)
    return out_BN, checked_BN


def _speculate(
    graphdef, emit_host, draft_depth: int, weights: Weights, request: Request, *, program: Program
):
    """Prefill + speculative decode loop (`decoding.loop`, as `sampling._generate`) ->
    (tokens [B, N] with -1 after a stop, loop iterations, drafts checked [B, K], drafts kept
    [B, K], the draft each token was checked against [B, N] or -1)."""
    d = Decoding.start(graphdef, emit_host, weights, request, program)
    r = request
    rule = DraftRule(r.temperature, r.top_k, r.top_p, r.n_vocab, program.mode)
    run = _Runner(d, rule, draft_depth)
    c = loop(d, _prefill(run), lambda c: _step(run, c))
    return c["out"], c["it"] - 1, c["drafted"], c["accepted"], c["checked"]


class SpeculativeSampler(Sampler):
    """A `Sampler` that drafts with the model's MTP module (module doc): the same arguments
    and the same distribution of text (greedy: the same text), in fewer steps."""

    RECORDS = False  # its steps emit several tokens: routing replay records with `Sampler`

    def __init__(self, model: Transformer, *, mesh=None, consume: bool = False, draft_depth=None):
        """`draft_depth`: how many MTP depths draft, 1..model.mtp_depth (None: the model's
        sample.draft_depth, else all of them)."""
        depth = model.cfg.model.mtp_depth
        if not depth:
            raise SamplingError(
                "speculative decoding drafts with the model's MTP module, and this model has "
                "none (model.mtp_depth=0); train with model.mtp_depth=1, or sample without it"
            )
        if draft_depth is None:
            draft_depth = model.cfg.sample.draft_depth or depth
        if not 1 <= draft_depth <= depth:
            raise SamplingError(
                f"draft_depth {draft_depth} is not within [1, {depth}] (the model's MTP "
                f"depths, model.mtp_depth={depth}); set sample.draft_depth to at most {depth}"
            )
        super().__init__(model, mesh=mesh, consume=consume)
        self.draft_depth = draft_depth
        self.compiled = jax.jit(
            partial(_speculate, self.graphdef, self._emit, draft_depth), static_argnames="program"
        )

    def _generation(self, out_BN, steps, drafted_BK, accepted_BK, checked_BN):
        plain = super()._generation(out_BN, steps)
        p = (plain.tokens, plain.lengths, plain.steps)
        return SpeculativeGeneration(*p, drafted_BK, accepted_BK, checked_BN)
