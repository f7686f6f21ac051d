"""RMSNorm, computed in float32 whatever the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.sharding import param


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last axis (Llama 4's "L2" QK-norm is this)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """`zero_centered` (model.zero_centered_norm, Qwen3-Next's): the weight is stored centred
    at zero and applied as (1 + w), so it starts at zeros and weight decay pulls it toward
    the identity rather than toward zero; otherwise applied as w, starting at ones."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, zero_centered: bool = False):
        self.eps = eps
        self.zero_centered = zero_centered
        init = nnx.initializers.zeros if zero_centered else nnx.initializers.ones
        self.scale = param(rngs, init, (dim,), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...]
        # (1 + w) in float32, as the reference computes it, before the cast back
        scale = 1.0 + scale.astype(jnp.float32) if self.zero_centered else scale
        return (y * scale).astype(x.dtype)
