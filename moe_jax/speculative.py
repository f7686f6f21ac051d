"""Speculative greedy decoding with the model's own MTP module as the draft (DeepSeek-V3,
arXiv:2412.19437 sec. 5.4.3: 85-90% of its second-token predictions accepted).

    sampler = SpeculativeSampler(model)         # model.mtp_depth >= 1; sample.speculative=true
    out = sampler.generate(prompts, 100, temperature=0)
    out.sequences()                             # the greedy text, token for token
    out.acceptance_rate                         # drafts the main model agreed with

The program is the plain sampler's (`moe_jax.sampling`: one jitted prefill + while loop, the
same arguments, prompt buckets, stop tokens, streaming and mesh) with another loop body. A row
holds its newest token x (at position p, not yet fed) and a draft d of the token after it,
and each step
1. runs the main model on [x, d] at positions [p, p+1], one forward of 2 positions, whose
   greedy picks are g0 (after x) and g1 (after x, d);
2. emits g0, which is always right (the greedy token after the accepted text), and g1 too
   when d == g0 (the draft accepted: g1 then follows the accepted text as well);
3. runs the first MTP depth over positions [p, p+1] with the main model's hidden states
   there and the tokens one ahead, [g0, g1] (`mtp.py`: its input at t is token t+1), whose
   pick at the newest token's predecessor (p+1 if accepted, else p) drafts the next d.
Every emitted token is the main model's argmax after the accepted text, as the plain
sampler's is: the same text, in 1 or 2 tokens a step instead of 1.

KV caches after a rejection: slot p+1 of the main layers' and of the MTP layer's caches holds
keys of the rejected draft. The next step starts at p+1 and writes that slot again before any
query reads it (attention masks by position: the query at p never sees slot p+1). A sliding
window's ring attends to its keys older than the call's first position only
(`kv_cache.ring_keys`), so the stale entry at p+1 is never read, and the one it replaced,
p+1-W, is outside the window of every later query. The MTP layer's cache is of the kind of
the last main layer's (`Transformer.init_cache(mtp=True)`), carried apart from the main
layers', and filled in the prefill from the prompt's hidden states.

Greedy only: at a temperature, keeping the sampled distribution needs speculative sampling's
rejection rule (Leviathan et al. 2023), which this does not implement, so the sampler refuses
temperature > 0. Rows advance at their own pace (their positions differ); a finished row stays
where it stopped. Streaming (`on_token`) calls back twice a step, with each row's first and
second token of the step (-1 where it emitted none), so its step numbers count calls, not
tokens. With model.mtp_depth > 1 only the first depth drafts (one token a step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.model import Transformer, gather
from moe_jax.sampling import (
    Generation,
    Sampler,
    SamplingError,
    model_of,
    shard_cache,
    stack_blocks,
    unstack_blocks,
)
from moe_jax.sampling_rules import pick_tokens


@dataclasses.dataclass(frozen=True)
class SpeculativeGeneration(Generation):
    drafted: np.ndarray  # int32 [B]: drafts the main model checked, per row
    accepted: np.ndarray  # int32 [B]: those it agreed with
    # int32 [B, max_new_tokens]: the draft each token was checked against (-1: none, as for
    # the first token and a token that came second in its step)
    drafts: np.ndarray

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over checked drafts, all rows together (nan if none was checked)."""
        checked = int(np.sum(self.drafted))
        return float(np.sum(self.accepted)) / checked if checked else float("nan")


@dataclasses.dataclass(frozen=True)
class _Runner:
    """The program's model calls: the main layers with the KV cache as the plain sampler
    carries it (its layer blocks apart, see `sampling.unstack_blocks`), the head, the draft."""

    graphdef: object
    params: object
    param_blocks: list
    pick: Callable  # float32 logits [B, V] -> the greedy tokens [B]

    def model(self):
        return model_of(self.graphdef, self.params, self.param_blocks)

    def unstacked(self, cache: dict) -> dict:
        cache = shard_cache(cache)
        return cache | {"blocks": unstack_blocks(cache["blocks"], len(self.param_blocks))}

    def main(self, tokens_BT, positions_BT, cache):
        """The main layers -> (their last output [B, T, D], the new cache)."""
        stacked = cache | {"blocks": stack_blocks(cache["blocks"])}
        x_BTD, _, new = self.model()(tokens_BT, positions=positions_BT, cache=stacked, head=False)
        return x_BTD, self.unstacked(new)

    def picks(self, x_BTD) -> list:
        """The main model's greedy token after each of the T positions: T arrays [B]."""
        logits_BTV = self.model().logits(x_BTD)
        return [self.pick(logits_BTV[:, t]) for t in range(x_BTD.shape[1])]

    def draft(self, x_BTD, ahead_BT, positions_BT, mtp_cache, at_B):
        """The first MTP depth over the main layers' outputs and the tokens one ahead ->
        (its greedy pick at index at_B of each row [B], its new cache)."""
        model = self.model()
        layer = model.mtp[0]
        emb_BTD = gather.lookup(ahead_BT, model.embed.embedding, model.dtype)
        h_BTD, mtp_cache, _ = layer(x_BTD, emb_BTD, positions_BT, mtp_cache, 1, None)
        h_B1D = jnp.take_along_axis(h_BTD, at_B[:, None, None], axis=1)
        logits_B1V = layer.logits(h_B1D, model.head_weight(h_B1D))
        return self.pick(logits_B1V[:, 0]), shard_cache(mtp_cache)


def _prefill(run: _Runner, prompt_BP, prompt_len_B, N: int, is_stop, emit) -> dict:
    """The prompts through the main layers (as the plain sampler's prefill: padding at
    position -1) and, with every hidden state kept, through the MTP layer -> the loop's
    first carry: the first new token, its draft, the caches."""
    B, P = prompt_BP.shape
    cache = run.model().init_cache(B, P + N, mtp=True)
    mtp_cache = shard_cache(cache.pop("mtp")[0])  # carried apart from the main layers'
    arange_P = jnp.arange(P, dtype=jnp.int32)
    positions_BP = jnp.where(arange_P[None, :] < prompt_len_B[:, None], arange_P[None, :], -1)
    x_BPD, cache = run.main(prompt_BP, positions_BP, run.unstacked(cache))
    last_B = prompt_len_B - 1
    (tok_B,) = run.picks(jnp.take_along_axis(x_BPD, last_B[:, None, None], axis=1))
    emit(0, tok_B)
    # The MTP layer at prompt position t takes token t+1: the prompt's next, the new token last.
    ahead_BP = jnp.concatenate([prompt_BP[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    ahead_BP = jnp.where(arange_P[None, :] == last_B[:, None], tok_B[:, None], ahead_BP)
    draft_B, mtp_cache = run.draft(x_BPD, ahead_BP, positions_BP, mtp_cache, last_B)
    zeros_B = jnp.zeros((B,), jnp.int32)
    return {
        "it": jnp.int32(1),
        "tok": tok_B,  # each row's newest token (fed next)
        "draft": draft_B,  # the draft of the token after it
        "n": jnp.ones((B,), jnp.int32),  # tokens emitted
        "cache": cache,
        "mtp": mtp_cache,
        "out": jnp.full((B, N), -1, jnp.int32).at[:, 0].set(tok_B),
        "drafts": jnp.full((B, N), -1, jnp.int32),
        "done": is_stop(tok_B) | (N <= 1),
        "drafted": zeros_B,
        "accepted": zeros_B,
    }


def _step(run: _Runner, c: dict, prompt_len_B, N: int, is_stop, emit) -> dict:
    """One step of every row (the module doc): check the draft, emit 1 or 2 tokens, draft."""
    active_B = ~c["done"]
    pos_B = prompt_len_B + c["n"] - 1  # the newest token's position
    positions_B2 = pos_B[:, None] + jnp.arange(2, dtype=jnp.int32)
    x_B2D, cache = run.main(jnp.stack([c["tok"], c["draft"]], 1), positions_B2, c["cache"])
    g0_B, g1_B = run.picks(x_B2D)
    agree_B = c["draft"] == g0_B
    # g1 too where the draft was right, g0 did not end the row, and the row has room
    two_B = active_B & agree_B & ~is_stop(g0_B) & (c["n"] + 2 <= N)
    ahead_B2 = jnp.stack([g0_B, g1_B], 1)
    at_B = two_B.astype(jnp.int32)  # the newest token's predecessor: p+1 or p
    new_draft_B, mtp_cache = run.draft(x_B2D, ahead_B2, positions_B2, c["mtp"], at_B)
    first_B, second_B = jnp.where(active_B, g0_B, -1), jnp.where(two_B, g1_B, -1)
    emit(2 * c["it"] - 1, first_B)
    emit(2 * c["it"], second_B)
    col_BN, n_B1 = jnp.arange(N)[None, :], c["n"][:, None]
    at_n_BN = (col_BN == n_B1) & active_B[:, None]  # token n: g0, checked against the draft
    out_BN = jnp.where(at_n_BN, first_B[:, None], c["out"])
    out_BN = jnp.where((col_BN == n_B1 + 1) & two_B[:, None], second_B[:, None], out_BN)
    n_B = c["n"] + active_B + two_B
    ended_B = is_stop(g0_B) | (two_B & is_stop(g1_B)) | (n_B >= N)
    keep = lambda new, old: jnp.where(active_B, new, old)  # a finished row stays
    return {
        "it": c["it"] + 1,
        "tok": keep(jnp.where(two_B, g1_B, g0_B), c["tok"]),
        "draft": keep(new_draft_B, c["draft"]),
        "n": n_B,
        "cache": cache,
        "mtp": mtp_cache,
        "out": out_BN,
        "drafts": jnp.where(at_n_BN, c["draft"][:, None], c["drafts"]),
        "done": c["done"] | (active_B & ended_B),
        "drafted": c["drafted"] + active_B,
        "accepted": c["accepted"] + (active_B & agree_B),
    }


def _speculate(
    graphdef,
    emit_host,
    params,
    param_blocks,
    prompt_BP,
    prompt_len_B,
    stop_S,
    key,
    temperature,
    top_k,
    top_p,
    n_vocab,
    *,
    max_new_tokens: int,
    mode,
    stream: bool,
):
    """Prefill + speculative decode loop (the arguments of `sampling._generate`) -> (tokens
    [B, N] with -1 after a stop, loop iterations, drafts checked [B], drafts accepted [B],
    the draft each token was checked against [B, N] or -1)."""
    assert mode.greedy, "speculative decoding is greedy (SpeculativeSampler checks it)"
    B, N = prompt_BP.shape[0], max_new_tokens
    row_keys_B = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(B))
    # the plain sampler's rule (greedy here: the keys and filters are not read)
    pick = lambda logits_BV: pick_tokens(
        logits_BV, 0, row_keys_B, n_vocab, temperature, top_k, top_p, mode
    )
    run = _Runner(graphdef, params, param_blocks, pick)
    is_stop = lambda tok_B: jnp.any(tok_B[:, None] == stop_S[None, :], axis=-1)

    def emit(step, tok_B):
        if stream:
            one_device = jax.sharding.get_abstract_mesh().empty
            jax.debug.callback(emit_host, step, tok_B, ordered=one_device)

    init = _prefill(run, prompt_BP, prompt_len_B, N, is_stop, emit)
    # Every step emits at least one token of every unfinished row: at most N - 1 steps.
    cond = lambda c: (c["it"] < N) & ~jnp.all(c["done"])
    step = lambda c: _step(run, c, prompt_len_B, N, is_stop, emit)
    c = jax.lax.while_loop(cond, step, init)
    return c["out"], c["it"] - 1, c["drafted"], c["accepted"], c["drafts"]


class SpeculativeSampler(Sampler):
    """A `Sampler` whose greedy generation drafts with the model's MTP module (module doc)."""

    def __init__(self, model: Transformer, *, mesh=None, consume: bool = False):
        if not model.cfg.model.mtp_depth:
            raise SamplingError(
                "speculative decoding drafts with the model's MTP module, and this model has "
                "none (model.mtp_depth=0); train with model.mtp_depth=1, or sample without it"
            )
        super().__init__(model, mesh=mesh, consume=consume)
        self.compiled = jax.jit(
            partial(_speculate, self.graphdef, self._emit),
            static_argnames=("max_new_tokens", "mode", "stream"),
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature=0.0, **kw
    ) -> SpeculativeGeneration:
        """`Sampler.generate` at temperature 0 (the only one), with acceptance counts."""
        _check_greedy(temperature)
        return super().generate(prompts, max_new_tokens, temperature=0.0, **kw)

    def lower(self, prompts, max_new_tokens: int, *, temperature=0.0, **kw):
        _check_greedy(temperature)
        return super().lower(prompts, max_new_tokens, temperature=0.0, **kw)

    def _generation(self, out_BN, steps, drafted_B, accepted_B, drafts_BN):
        plain = super()._generation(out_BN, steps)
        p = (plain.tokens, plain.lengths, plain.steps)
        return SpeculativeGeneration(*p, drafted_B, accepted_B, drafts_BN)


def _check_greedy(temperature: float) -> None:
    if temperature != 0:
        raise SamplingError(
            f"speculative decoding requires temperature 0 (greedy), got {temperature}; set "
            "the temperature to 0, or sample.speculative=false to sample at a temperature"
        )
