"""DeepSeek-V4's manifold-constrained hyper-connections (mHC; Xie et al. 2026, V4 report sec. 2.2),
as transformers' `DeepseekV4HyperConnection` and `DeepseekV4HyperHead` compute them.

With `model.hc_mult` = N > 0 the residual is N streams x_BTND (the embedding copied N times).
Each block (attention, FFN) has its own `HyperConnection`, which from the streams, flattened
[B, T, N * D] and RMS-normalised without a weight (eps `model.norm_eps`), makes by one linear
map `fn` [N * D, (2 + N) N], a `bias` and three scalar `scale`s:

    pre_N   = sigmoid(scale_0 w_pre + b_pre) + eps          the block's input: sum_n pre_n x_n
    post_N  = 2 sigmoid(scale_1 w_post + b_post)            its output's share in each stream
    comb_NN = Sinkhorn(softmax_row(scale_2 w_comb + b_comb) + eps)

Sinkhorn: columns normalised, then `model.hc_sinkhorn_iters` - 1 times rows then columns,
each sum plus eps (`model.hc_eps`): a doubly-stochastic matrix to within the iterations. The
new streams are post_k y + sum_j comb_jk x_j (comb transposed: rows are the input streams).
The weights are computed in float32 (the reference keeps these modules float32); the block's
input is cast back to the streams' dtype, and the mixing runs in it (the reference's `.to`).
After the last layer, `HyperHead` merges the streams with its own sigmoid(...) + eps weights
(no post, no comb) before the final norm.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import Config
from moe_jax.sharding import param


def _unweighted_rms(flat_BTF: jax.Array, eps: float) -> jax.Array:
    """The reference's DeepseekV4UnweightedRMSNorm, in float32."""
    return flat_BTF * jax.lax.rsqrt(jnp.mean(jnp.square(flat_BTF), -1, keepdims=True) + eps)


def _mix_weights(x_BTND: jax.Array, fn, norm_eps: float) -> jax.Array:
    """The linear map of the normalised, flattened streams [B, T, out] in float32."""
    B, T, N, D = x_BTND.shape
    flat_BTF = _unweighted_rms(x_BTND.reshape(B, T, N * D).astype(jnp.float32), norm_eps)
    return flat_BTF @ fn[...].astype(jnp.float32)


def sinkhorn(comb_BTNN: jax.Array, iters: int, eps: float) -> jax.Array:
    """Columns normalised, then rows and columns `iters` - 1 times (the reference's order)."""
    cols = lambda c: c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    rows = lambda c: c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iters - 1, lambda _, c: cols(rows(c)), cols(comb_BTNN))


def _collapse(pre_BTN: jax.Array, x_BTND: jax.Array) -> jax.Array:
    """sum_n pre_n x_n in float32, cast to the streams' dtype."""
    return jnp.sum(pre_BTN[..., None] * x_BTND, axis=2).astype(x_BTND.dtype)


class HyperConnection(nnx.Module):
    """One block's mHC: its input from the streams and its output back into them."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        m = cfg.model
        N, D = m.hc_mult, m.d_model
        self.n, self.norm_eps = N, m.norm_eps
        self.iters, self.eps = m.hc_sinkhorn_iters, m.hc_eps
        out = (2 + N) * N  # pre N, post N, comb N x N
        self.fn = param(rngs, nnx.initializers.normal(m.init_std), (N * D, out), (None, None))
        self.bias = param(rngs, nnx.initializers.zeros, (out,), (None,))  # HF's `base`
        self.scale = param(rngs, nnx.initializers.ones, (3,), (None,))

    def weights(self, x_BTND: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> float32 (pre_BTN, post_BTN, comb_BTNN), as the module doc says."""
        N = self.n
        mix = _mix_weights(x_BTND, self.fn, self.norm_eps)
        b, s = self.bias[...].astype(jnp.float32), self.scale[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(mix[..., :N] * s[0] + b[:N]) + self.eps
        post = 2 * jax.nn.sigmoid(mix[..., N : 2 * N] * s[1] + b[N : 2 * N])
        logits = mix[..., 2 * N :] * s[2] + b[2 * N :]
        comb = jax.nn.softmax(logits.reshape(*logits.shape[:-1], N, N), axis=-1) + self.eps
        return pre, post, sinkhorn(comb, self.iters, self.eps)

    def enter(self, x_BTND: jax.Array) -> tuple[jax.Array, Callable]:
        """-> (the block's input [B, T, D], a function of its output giving the new streams)."""
        pre, post, comb = self.weights(x_BTND)
        dtype = x_BTND.dtype

        def add(y_BTD: jax.Array) -> jax.Array:
            mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dtype), x_BTND)
            return post.astype(dtype)[..., None] * y_BTD[..., None, :].astype(dtype) + mixed

        return _collapse(pre, x_BTND), add


class HyperHead(nnx.Module):
    """The streams merged into one after the last layer (the reference's `hc_head`)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        m = cfg.model
        N, D = m.hc_mult, m.d_model
        self.norm_eps, self.eps = m.norm_eps, m.hc_eps
        self.fn = param(rngs, nnx.initializers.normal(m.init_std), (N * D, N), (None, None))
        self.bias = param(rngs, nnx.initializers.zeros, (N,), (None,))
        self.scale = param(rngs, nnx.initializers.ones, (1,), (None,))

    def __call__(self, x_BTND: jax.Array) -> jax.Array:
        mix = _mix_weights(x_BTND, self.fn, self.norm_eps)
        pre = jax.nn.sigmoid(mix * self.scale[...] + self.bias[...]) + self.eps
        return _collapse(pre, x_BTND)


def enter(hc: HyperConnection | None, x_BTD: jax.Array) -> tuple[jax.Array, Callable]:
    """A block's input and residual: with mHC (`hc`), `HyperConnection.enter` on the streams;
    without, the plain residual stream itself and x + y (the program without mHC)."""
    if hc is None:
        return x_BTD, lambda y_BTD: x_BTD + y_BTD
    return hc.enter(x_BTD)


def spread(x_BTD: jax.Array, n: int) -> jax.Array:
    """The embedding as n equal streams [B, T, n, D] (n = 0: as it is, one plain stream)."""
    if n == 0:
        return x_BTD
    B, T, D = x_BTD.shape
    return jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, n, D))
