"""Rotary position embeddings with Llama-3/4-style frequency scaling.

Two layouts of the rotated pairs exist in the wild and checkpoints depend on which one:
`half` rotates (x[i], x[i + d/2]) (Llama 2/3, Mixtral, Qwen), `interleaved` rotates
(x[2i], x[2i+1]) (Llama 4's complex-number formulation).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.config import RopeScalingConfig


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalingConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64 numpy: computed once, exactly)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling.type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.type == "llama3":
        # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept,
        # and the band between is interpolated smoothly (Llama 3.1 / Llama 4).
        old_len = scaling.original_max_position
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        band = scaling.high_freq_factor - scaling.low_freq_factor
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        if band > 0:
            smooth = (old_len / wavelen - scaling.low_freq_factor) / band
            smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
            scaled = np.where(is_medium, smoothed, scaled)
        inv_freq = scaled
    return inv_freq


def apply_rope(
    x_BTHD: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray, style: str
) -> jax.Array:
    """Rotate each head's feature pairs by angle position * inv_freq (computed in float32)."""
    angles_BTF = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    # Materialised once: left to fusion, XLA:CPU recomputed sin and cos for every head and
    # element of the rotated tensors (and again in the backward), 0.34 s of the medium step.
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles_BTF), jnp.sin(angles_BTF)))
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, D/2]
    x = x_BTHD.astype(jnp.float32)
    if style == "half":
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:  # interleaved
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    return out.astype(x_BTHD.dtype)
