"""The sampling rules: how one token is drawn from each row's logits.

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
    order_BV = jnp.argsort(logits_BV, axis=-1, descending=True, stable=True)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    rank_V = jnp.arange(logits_BV.shape[-1])
    keep_BV = jnp.ones(sorted_BV.shape, bool)
    if mode.top_k:
        keep_BV &= rank_V < top_k
    if mode.top_p:
        probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        keep_BV &= mass_before_BV < top_p  # the most likely token always stays
    rank_B = draw(keys_B, jnp.where(keep_BV, sorted_BV, -jnp.inf))
    return jnp.take_along_axis(order_BV, rank_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def pick_tokens(logits_BV, step, row_keys_B, n_vocab: int, temperature, top_k, top_p, mode: Mode):
    """Step `step`'s token of each row: the padded vocabulary's extra ids masked out, each
    row's key folded with the step."""
    keys_B = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys_B)
    in_vocab_V = jnp.arange(logits_BV.shape[-1]) < n_vocab
    logits_BV = jnp.where(in_vocab_V, logits_BV, -jnp.inf)
    return sample_tokens(logits_BV, keys_B, temperature, top_k, top_p, mode)
