"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) on multi-head latent attention
(`attention.index_topk` > 0): a lightning indexer scores every past token for each query,
and the query attends to its `index_topk` best only.

For a token with the attention's (normed) input x [D] and mla's query latent
q_r = RMSNorm(W_qa x) [r], as transformers' `DeepseekV32Indexer` computes them
(Hi = index_n_heads, Di = index_head_dim, P = qk_rope_head_dim):

    q_h = W_qb_h q_r  [Di] per head;   k = LayerNorm(W_k x)  [Di], one key for all heads
    the first P dims of q_h and k rotated by the model's RoPE (YaRN's factor included):
    rotate-half (V3.2) or interleaved pairs (GLM-5: `index_rope_style`), the rest as they are
    w_h = (W_w x)_h Hi^-0.5                                  the heads' weights, per query
    I(t, s) = sum_h w_h(t) relu(Di^-0.5 q_h(t) . k(s))       float32
    selected(t) = the index_topk keys s of largest I(t, s) among those t may attend
                  (s <= t, its own document): all of them while there are fewer

The release's Hadamard rotation of q and k and its FP8 scoring are left out, as transformers
leaves them: the rotation is orthogonal (q . k unchanged) and FP8 only rounds.
GLM's sharing (`index_topk_freq` > 1): the layers between two indexer layers reuse the last
one's selection, which the decoder passes from layer to layer (`transformer.py`).

Gradients: none reaches the indexer through the selection (top-k is piecewise constant; the
reference runs it under no_grad), and its inputs are detached, so it sends none into the
layer either: its weights learn only from a loss of their own on its scores.

The attention over the selection is the masked dense form: mla's attention with its causal
mask ANDed with the selection [B, T, S]. Every one of the T x S logits is still computed, as
are the indexer's T x S scores (Hi Di multiply-adds each, a head at a time): it costs dense
attention plus the indexer and saves nothing yet, and the scores and the selection are
[B, T, S] arrays whole (a long prefill's too). The saving needs each query's k keys gathered
(a kernel's job, FlashMLA's sparse one), which turns the T x S of attention into T x k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import Config
from moe_jax.model import in_turn, weight_gather
from moe_jax.model.rope import apply_rope, rope_attention_factor, rope_inv_freq
from moe_jax.sharding import param

# The indexer's key norm: transformers' nn.LayerNorm(index_head_dim, eps=1e-6), whatever
# the model's rms_norm_eps
KEY_NORM_EPS = 1e-6


class Indexer(nnx.Module):
    """The lightning indexer of one layer (the module doc). Shapes: I = index_head_dim,
    H = index_n_heads here, r the query latent."""

    def __init__(self, cfg: Config, dtype, *, rngs: nnx.Rngs):
        a = cfg.attention
        D, H, I, r = cfg.model.d_model, a.index_n_heads, a.index_head_dim, a.q_lora_rank
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = dtype
        self.n_heads, self.head_dim, self.topk = H, I, a.index_topk
        self.rope_dim, self.rope_style = a.qk_rope_head_dim, a.index_rope_style
        self.inv_freq = tuple(rope_inv_freq(self.rope_dim, a.rope_theta, a.rope_scaling).tolist())
        self.rope_scale = rope_attention_factor(a.rope_scaling)
        self.wq_b = param(rngs, init, (r, H, I), ("latent", None, None))
        # transformers' wk: named apart, as int8 sampling reads a `wk` as GQA's [D, K, hd]
        self.w_key = param(rngs, init, (D, I), ("embed", None))
        self.k_norm_scale = param(rngs, nnx.initializers.ones, (I,), (None,))
        self.k_norm_bias = param(rngs, nnx.initializers.zeros, (I,), (None,))
        self.weights_proj = param(rngs, init, (D, H), ("embed", None))

    def _rope(self, a: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """RoPE on the first qk_rope_head_dim dims of `a` [B, T, ..., I], the rest as they
        are (`apply_rope` rotates as many dims as it has frequencies)."""
        return apply_rope(a, positions_BT, self.inv_freq, self.rope_style, self.rope_scale)

    def keys(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """Each token's key k [B, T, I] (what a decode cache keeps of the indexer)."""
        x_BTD = jax.lax.stop_gradient(x_BTD)
        k_BTI = weight_gather.einsum("btd,di->bti", x_BTD, self.w_key, self.dtype)
        k32 = k_BTI.astype(jnp.float32)  # LayerNorm in float32, as the norms are
        mean = jnp.mean(k32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(k32 - mean), axis=-1, keepdims=True)
        k32 = (k32 - mean) * jax.lax.rsqrt(var + KEY_NORM_EPS)
        k32 = k32 * self.k_norm_scale[...] + self.k_norm_bias[...]
        k_BTI = k32.astype(k_BTI.dtype)
        return self._rope(k_BTI[:, :, None], positions_BT)[:, :, 0]

    def scores(
        self, x_BTD: jax.Array, q_BTr: jax.Array, positions_BT: jax.Array, k_BSI: jax.Array
    ) -> jax.Array:
        """I(t, s) of the call's queries against keys `k_BSI`: float32 [B, T, S]."""
        x_BTD, q_BTr = jax.lax.stop_gradient(x_BTD), jax.lax.stop_gradient(q_BTr)
        wq_b = in_turn.dense(self.wq_b[...], self.dtype, q_BTr)
        q_BTHI = self._rope(jnp.einsum("btr,rhi->bthi", q_BTr, wq_b), positions_BT)
        w_BTH = weight_gather.einsum("btd,dh->bth", x_BTD, self.weights_proj, self.dtype)
        w_BTH = w_BTH.astype(jnp.float32) * self.n_heads**-0.5
        k_BSI = k_BSI.astype(q_BTHI.dtype)

        # One head at a time, its ReLU'd logits added into the [B, T, S] sum: all heads at
        # once held [B, T, H, S] float32 (64 heads: 64x the scores), as transformers' does.
        # Rematerialised, so a backward (the indexer's loss) keeps no head's logits either.
        @jax.checkpoint
        def head(sum_BTS, qw):
            q_BTI, w_BT = qw
            logits_BTS = jnp.einsum(
                "bti,bsi->bts", q_BTI, k_BSI, preferred_element_type=jnp.float32
            )
            return sum_BTS + w_BT[..., None] * jax.nn.relu(logits_BTS * self.head_dim**-0.5), None

        zeros_BTS = jnp.zeros((*q_BTHI.shape[:2], k_BSI.shape[1]), jnp.float32)
        heads = (jnp.moveaxis(q_BTHI, 2, 0), jnp.moveaxis(w_BTH, 2, 0))
        return jax.lax.scan(head, zeros_BTS, heads)[0]


def select(scores_BTS: jax.Array, allowed_BTS: jax.Array, topk: int) -> jax.Array:
    """The selection [B, T, S] (bool): each query's `topk` allowed keys of largest score, all
    its allowed keys where it has fewer. Exactly `topk` by `lax.top_k` (ties by lower index),
    where a threshold on the k-th score would take every key tied with it."""
    masked_BTS = jnp.where(allowed_BTS, scores_BTS, -jnp.inf)
    k = min(topk, scores_BTS.shape[-1])
    _, idx_BTk = jax.lax.top_k(masked_BTS, k)
    picked_BTS = jnp.put_along_axis(
        jnp.zeros(scores_BTS.shape, bool), idx_BTk, True, axis=-1, inplace=False
    )
    # fewer than k allowed keys: the top k took disallowed ones too
    return jax.lax.stop_gradient(picked_BTS & allowed_BTS)


def index_cache(cfg: Config, lead: tuple[int, ...], dtype) -> dict:
    """The indexer's decode cache for `lead` = (..., B, S): {"index_k": [..., B, S, 1, I]},
    each token's key, laid out as one key head like mla's latent."""
    return {"index_k": jnp.zeros((*lead, 1, cfg.attention.index_head_dim), dtype)}


def first_carry(cfg: Config, B: int, T: int, cache: dict | None) -> dict | None:
    """What the first layer is passed of DSA (None: nothing): with GLM's sharing, the
    selection "picked", all-False [B, T, S] (the layer scan's carry keeps one shape; the
    first layer always runs its indexer, so it is never read; S: T, or the cache's length);
    training the indexer (train.indexer_stage, a forward without a cache), "kl", the sum of
    the indexer layers' losses (`indexer_kl`)."""
    a, carry = cfg.attention, {}
    if a.index_topk > 0 and a.index_topk_freq > 1:
        layers = {k: cache[k] for k in ("prefix", "blocks", "tail") if k in cache} if cache else {}
        S = jax.tree.leaves(layers)[0].shape[-3] if layers else T  # [..., B, S, 1, L]
        carry["picked"] = jnp.zeros((B, T, S), bool)
    if a.index_topk > 0 and cfg.train.indexer_stage != "none" and cache is None:
        carry["kl"] = jnp.zeros((), jnp.float32)
    return carry or None


def indexer_kl(q_BTHQ, k_BTHQ, scale: float, scores_BTS, set_BTS, valid_BT) -> jax.Array:
    """The indexer's loss (DeepSeek-V3.2's): for each query t, KL(p_t || softmax(I_t)) over
    its keys in `set_BTS` (all it may attend in the dense warm-up, its selection in the
    sparse stage), where p_t is the main attention's distribution summed over the heads and
    renormalised (the heads' mean) on that set, detached: the mean over the `valid_BT`
    queries (not padding). Gradients reach the indexer's scores only."""
    low = jnp.finfo(jnp.float32).min
    logits_BHTS = jnp.einsum("bthq,bshq->bhts", q_BTHQ, k_BTHQ, preferred_element_type=jnp.float32)
    p_BHTS = jax.nn.softmax(jnp.where(set_BTS[:, None], logits_BHTS * scale, low), axis=-1)
    p_BTS = jax.lax.stop_gradient(jnp.mean(p_BHTS, axis=1))
    log_q_BTS = jax.nn.log_softmax(jnp.where(set_BTS, scores_BTS, low), axis=-1)
    kept = set_BTS & (p_BTS > 0)  # 0 log 0 = 0
    log_p_BTS = jnp.log(jnp.where(kept, p_BTS, 1.0))
    kl_BT = jnp.sum(jnp.where(kept, p_BTS * (log_p_BTS - log_q_BTS), 0.0), axis=-1)
    valid = valid_BT.astype(jnp.float32)
    return jnp.sum(kl_BT * valid) / jnp.maximum(jnp.sum(valid), 1.0)
