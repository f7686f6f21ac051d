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
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones, (dim,), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)
