"""Drawing tokens: how one token is drawn from each row's logits.

Applied in this order to each row's logits: temperature (0 = greedy argmax), top-k (keep the k
most likely; 0 = off), top-p (keep the smallest most-likely set whose mass reaches p; 1 = off).
Ties rank by token id, like argmax, so top-k = 1 and top-p -> 0 are greedy. Every row draws
from its own key, `fold_in(fold_in(seed, row), step)`: a seed always gives the same text, and
row r's draws do not depend on the batch size.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Mode(NamedTuple):
    """Static part of the sampling rule (which code the step compiles to)."""

    greedy: bool
    top_k: bool
    top_p: bool


def sample_tokens(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    mode: Mode,
) -> jax.Array:
    """One token per row [B] from float32 logits [B, V]; `keys_B` is one PRNG key per row."""
    if mode.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    draw = jax.vmap(jax.random.categorical)
    if not (mode.top_k or mode.top_p):
        return draw(keys_B, logits_BV).astype(jnp.int32)
    # Work in rank order: one stable sort (ties by token id, as argmax) serves both filters.
    order_BV, sorted_BV = _ranked(logits_BV)
    keep_BV = _kept_ranks(sorted_BV, top_k, top_p, mode)
    rank_B = draw(keys_B, jnp.where(keep_BV, sorted_BV, -jnp.inf))
    return jnp.take_along_axis(order_BV, rank_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def filtered_logits(logits_BV, temperature, top_k, top_p, mode: Mode) -> jax.Array:
    """The distribution `sample_tokens` draws from (not greedy), as float32 logits [B, V] in
    token order: divided by the temperature, -inf outside the top-k / top-p set
    (`moe_jax.inference.acceptance` needs the probabilities themselves, not only a draw)."""
    assert not mode.greedy, "greedy picks the argmax; it draws from no distribution"
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    if not (mode.top_k or mode.top_p):
        return logits_BV
    order_BV, sorted_BV = _ranked(logits_BV)
    n_kept_B1 = jnp.sum(_kept_ranks(sorted_BV, top_k, top_p, mode), -1, keepdims=True)
    # The kept ranks are the first n_kept: a token is kept where it ranks no lower than the
    # last kept one (ties by id), an elementwise test in place of scattering the ranks back.
    last_B1 = jnp.take_along_axis(order_BV, n_kept_B1 - 1, axis=-1)
    cut_B1 = jnp.take_along_axis(logits_BV, last_B1, axis=-1)
    id_V = jnp.arange(logits_BV.shape[-1])
    kept_BV = (logits_BV > cut_B1) | ((logits_BV == cut_B1) & (id_V <= last_B1))
    return jnp.where(kept_BV, logits_BV, -jnp.inf)


def _ranked(logits_BV):
    """(token ids by rank, logits by rank): one stable sort, ties by token id as argmax."""
    order_BV = jnp.argsort(logits_BV, axis=-1, descending=True, stable=True)
    return order_BV, jnp.take_along_axis(logits_BV, order_BV, axis=-1)


def _kept_ranks(sorted_BV, top_k, top_p, mode: Mode):
    """Which ranks the top-k and top-p filters keep [B, V] (logits sorted, tempered)."""
    rank_V = jnp.arange(sorted_BV.shape[-1])
    keep_BV = jnp.ones(sorted_BV.shape, bool)
    if mode.top_k:
        keep_BV &= rank_V < top_k
    if mode.top_p:
        probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        keep_BV &= mass_before_BV < top_p  # the most likely token always stays
    return keep_BV


def pick_tokens(logits_BV, step, row_keys_B, n_vocab: int, temperature, top_k, top_p, mode: Mode):
    """Step `step`'s token of each row: the padded vocabulary's extra ids masked out, each
    row's key folded with the step."""
    keys_B = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys_B)
    return sample_tokens(in_vocab(logits_BV, n_vocab), keys_B, temperature, top_k, top_p, mode)


def in_vocab(logits_BV, n_vocab):
    """The logits with the padded vocabulary's extra ids (those >= n_vocab) at -inf."""
    return jnp.where(jnp.arange(logits_BV.shape[-1]) < n_vocab, logits_BV, -jnp.inf)
