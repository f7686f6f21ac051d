"""Accepting drafts: speculative sampling's rule (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318): which drafts the main model keeps and the token it
adds, such that every emitted token has exactly the distribution the plain sampler draws it from.

A step checks drafts d_1..d_K of the tokens after the newest one. d_j was drawn from q_j (the
draft's distribution) and the main model's distribution of the same token is p_{j-1} (the
main forward at the position before it). In order, d_j is kept with probability
min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection the token in its place is drawn from
norm(max(0, p_{j-1} - q_j)), and if all K are kept one more (the bonus) is drawn from p_K.
Each emitted token is then distributed by p given the tokens before it (the papers' theorem:
P(d kept) + P(rejected) norm(max(0, p - q)) = min(p, q) + (1 - sum min(p, q)) (p - min(p, q))
/ (1 - sum min(p, q)) = p), whatever the drafts are: a poor draft costs speed, not accuracy.

p and q are the sampling rule's distributions (`draws.filtered_logits`): the
temperature, then the top-k / top-p filter applied to each by its own logits (the standard
way, as vLLM and Hugging Face do it), so a draft outside p's set is always rejected and every
token stays inside p's set, as the plain sampler's. Greedy (temperature 0) is the limit with
one-hot p and q: a draft is kept when it is the main model's argmax, and the token added is
that argmax, with no randomness (compared as ids, not as probabilities).

Randomness: each row's step key (`step_keys`) is split into the drafts' keys, one for the
acceptance uniforms and one for the added token, so a seed gives the same text.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.inference.next_token import Mode, filtered_logits, in_vocab


def step_keys(row_keys_B, step, n: int) -> list:
    """n independent keys per row for one step (`step`: every row's, or each row's own [B],
    as the engine's rows are at their own steps): n arrays of [B] keys."""
    split = lambda k, s: jax.random.split(jax.random.fold_in(k, s), n)
    keys_BN = jax.vmap(split)(row_keys_B, jnp.broadcast_to(step, row_keys_B.shape))
    return [keys_BN[:, i] for i in range(n)]


@dataclasses.dataclass(frozen=True)
class DraftRule:
    """The sampling values of one call (traced, as the plain sampler's) and its static mode."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    n_vocab: jax.Array
    mode: Mode

    def probs(self, logits_BV) -> jax.Array:
        """The distribution the plain sampler draws from: float32 [B, V] summing to 1."""
        return jax.nn.softmax(self._logits(logits_BV), axis=-1)

    def _logits(self, logits_BV):
        logits_BV = in_vocab(logits_BV.astype(jnp.float32), self.n_vocab)
        return filtered_logits(logits_BV, self.temperature, self.top_k, self.top_p, self.mode)

    def draw(self, logits_BV, keys_B) -> tuple[jax.Array, jax.Array]:
        """One token per row [B] by the rule, with the distribution it was drawn from [B, V]
        (greedy: the argmax, and an empty [B, 0]: the check compares ids)."""
        B = logits_BV.shape[0]
        if self.mode.greedy:
            tok_B = jnp.argmax(in_vocab(logits_BV, self.n_vocab), axis=-1).astype(jnp.int32)
            return tok_B, jnp.zeros((B, 0), jnp.float32)
        filtered_BV = self._logits(logits_BV)
        tok_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
        return tok_B, jax.nn.softmax(filtered_BV, axis=-1)

    def check(self, logits_BTV, drafts_BK, q_BKV, keys_B) -> Verdict:
        """The main model's logits at the newest token and at the K drafts [B, K+1, V], the
        drafts [B, K] and their distributions [B, K, V] -> which drafts the rule keeps, each
        on its own (the caller stops at the first rejection), and how to draw the token
        after the kept ones."""
        B, T, V = logits_BTV.shape
        K = T - 1
        if self.mode.greedy:
            best_BT = jnp.argmax(in_vocab(logits_BTV, self.n_vocab), axis=-1).astype(jnp.int32)
            return Verdict(drafts_BK == best_BT[:, :K], best_BT, None, None)
        p_BTV = self.probs(logits_BTV.reshape(B * T, V)).reshape(B, T, V)
        at = lambda probs_BKV: jnp.take_along_axis(probs_BKV, drafts_BK[..., None], -1)[..., 0]
        u_BK = jax.vmap(lambda key: jax.random.uniform(key, (K,)))(keys_B)
        # u < p / q without dividing (q(d) > 0: d was drawn from q; p(d) = 0 always rejects)
        kept_BK = u_BK * at(q_BKV) < at(p_BTV[:, :K])
        return Verdict(kept_BK, None, p_BTV, q_BKV)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """`DraftRule.check`'s result: kept [B, K], and the greedy picks [B, K+1] or the main
    model's distributions [B, K+1, V] with the drafts' [B, K, V]."""

    kept_BK: jax.Array
    best_BT: jax.Array | None
    p_BTV: jax.Array | None
    q_BKV: jax.Array | None

    def next_token(self, n_kept_B, key_B) -> jax.Array:
        """The token after the first n_kept_B drafts [B]: the main model's pick there where
        draft n_kept + 1 was rejected (from norm(max(0, p - q)), greedy: the argmax), or the
        bonus from p_K where all K were kept."""
        if self.best_BT is not None:
            return jnp.take_along_axis(self.best_BT, n_kept_B[:, None], axis=1)[:, 0]
        K = self.kept_BK.shape[1]
        p_BV = jnp.take_along_axis(self.p_BTV, n_kept_B[:, None, None], axis=1)[:, 0]
        q_BV = jnp.take_along_axis(self.q_BKV, jnp.minimum(n_kept_B, K - 1)[:, None, None], 1)
        q_BV = jnp.where((n_kept_B < K)[:, None], q_BV[:, 0], 0.0)  # the bonus: p alone
        residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
        # A rejection means p(d) < q(d), so the residual has mass; float rounding may still
        # leave none where p and q are equal to the last bit: then p itself (the same law).
        residual_BV = jnp.where(jnp.sum(residual_BV, -1, keepdims=True) > 0, residual_BV, p_BV)
        logits_BV = jnp.where(residual_BV > 0, jnp.log(residual_BV), -jnp.inf)
        return jax.vmap(jax.random.categorical)(key_B, logits_BV).astype(jnp.int32)
