"""Rotary position embeddings with linear, Llama-3/4-style and YaRN frequency scaling.

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
    elif scaling.type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    return inv_freq


def _yarn_inv_freq(
    inv_freq_F: np.ndarray, head_dim: int, theta: float, s: RopeScalingConfig
) -> np.ndarray:
    """YaRN's "NTK-by-parts" (arXiv:2309.00071), step for step as transformers'
    `_compute_yarn_parameters`: frequency i turns old_len * inv_freq[i] / 2pi times over the
    original context; those turning fewer than beta_slow times are interpolated (divided by
    factor), those turning more than beta_fast times kept, and a linear ramp over the index i
    blends the two between."""
    # transformers reads 0 (or null) as "unset"; a zero count would also make the log below blow up
    beta_fast, beta_slow = s.beta_fast or 32.0, s.beta_slow or 1.0

    def index_turning(n_turns: float) -> float:  # the (fractional) i turning n_turns times
        old_len = s.original_max_position
        return head_dim * math.log(old_len / (n_turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(beta_fast), index_turning(beta_slow)
    if s.truncate:  # gpt-oss turns this off; the rounded band differs by up to a dim each side
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp, kept for equal results
    ramp_F = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv_freq_F / s.factor * ramp_F + inv_freq_F * (1 - ramp_F)


def rope_attention_factor(scaling: RopeScalingConfig) -> float:
    """The factor cos and sin are multiplied by (so q.k by its square): 1 except for YaRN,
    whose interpolated positions flatten attention and the paper sharpens it back."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor:  # 0 = derive it, as transformers does for a missing one
        return float(scaling.attention_factor)
    # DeepSeek-V3 gives both and so a ratio (1 where they are equal: its factor goes into the
    # softmax scale instead, `rope_softmax_factor`); transformers ignores one given without
    # the other.
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling, scaling.mscale) / _yarn_mscale(scaling, scaling.mscale_all_dim)
    return _yarn_mscale(scaling, 1.0)


def rope_softmax_factor(scaling: RopeScalingConfig) -> float:
    """The factor DeepSeek's attention (MLA, `mla.py`) multiplies its softmax scale by: YaRN's
    mscale(mscale_all_dim) squared, as transformers' `yarn_apply_mscale` (1 unless YaRN with
    mscale_all_dim set). The interpolated positions flatten attention over all the head's
    dims, not only the rotated ones, so the sharpening goes into the scale of the whole q.k."""
    if scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling, scaling.mscale_all_dim) ** 2


def _yarn_mscale(scaling: RopeScalingConfig, m: float) -> float:
    """YaRN's attention sharpening 0.1 m ln(factor) + 1 (1 where nothing is interpolated)."""
    return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0


def apply_rope(
    x_BTHD: jax.Array,
    positions_BT: jax.Array,
    inv_freq: np.ndarray,
    style: str,
    scale: float = 1.0,
) -> jax.Array:
    """Rotate each head's feature pairs by angle position * inv_freq (computed in float32) and
    multiply by `scale` (`rope_attention_factor`; applied to q and k alike, like transformers).

    Partial rotary (`attention.partial_rotary_factor` < 1, GLM-4.5): with fewer frequencies
    than pairs, the first 2 * len(inv_freq) dims of each head are rotated (and scaled) in
    `style` as if they were the whole head, and the rest pass through unchanged, as
    transformers' Glm4Moe `apply_rotary_pos_emb` does (`Config.rotary_dim`)."""
    n_rot = 2 * len(inv_freq)
    if n_rot < x_BTHD.shape[-1]:
        rotated = apply_rope(x_BTHD[..., :n_rot], positions_BT, inv_freq, style, scale)
        return jnp.concatenate([rotated, x_BTHD[..., n_rot:]], axis=-1)
    angles_BTF = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    # Materialised once: left to fusion, XLA:CPU recomputed sin and cos for every head and
    # element of the rotated tensors (and again in the backward), 0.34 s of the medium step.
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles_BTF), jnp.sin(angles_BTF)))
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, D/2]
    if scale != 1.0:  # on the [B, T, 1, D/2] tables, not on every head's rotated values
        cos, sin = cos * scale, sin * scale
    x = x_BTHD.astype(jnp.float32)
    if style == "half":
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:  # interleaved
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    return out.astype(x_BTHD.dtype)
