"""MXFP4 expert weights kept packed for inference (gpt-oss is released this way: 4.25 bits a
weight, so gpt-oss-120b's experts take 61 GB instead of 229 GB in bf16).

    qmodel = quantize_model(model, "mxfp4")   # model/int8.py: experts MXFP4, the rest as is

Format (OCP MX, as `moe_jax.interop.mxfp4` reads checkpoints): per block of 32 values along a
weight's contracted (input) axis, one E8M0 scale 2**(s - 127) and 32 FP4 E2M1 codes, two to a
byte (even element in the low nibble). Our experts' `w [..., D, F]` are stored as
{"blocks": uint8 [..., D/32, 16, F], "scales": uint8 [..., D/32, F]}: the contracted axis
split in blocks and the output axis last, so that indexing the leading (expert) axis gathers
a picked expert's packed rows as int8's does, and the model reads the dequantised float32
weight as from any Param (`Mxfp4Param`, dequantised at the point of use like int8's: see
`int8.after`). The scale choice and rounding are those of `interop.mxfp4.quantize` (the
smallest scale that clips nothing; nearest E2M1 value, ties to the even code), so a weight
imported from an MXFP4 checkpoint is packed back to the same values exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32  # values per scale
SCALE_BIAS = 127
# FP4 E2M1 code -> value (sign bit 3): +0 .5 1 1.5 2 3 4 6, then the negatives.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding |x| to the E2M1 magnitudes: (midpoint, whether a tie rounds up to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))  # fmt: skip


def dequantize(raw: dict, index=...) -> jax.Array:
    """{"blocks" [..., G, 16, F], "scales" [..., G, F]} -> float32 [..., G * 32, F]; `index`
    picks along the leading axes first (a gather reads only the picked packed rows)."""
    blocks, scales = raw["blocks"], raw["scales"]
    if index is not ...:
        blocks, scales = blocks[index], scales[index]
    table = jnp.asarray(E2M1, jnp.float32)
    pairs = jnp.stack([table[blocks & 0xF], table[blocks >> 4]], axis=-2)  # [..., G, 16, 2, F]
    *lead, G, half, _, F = pairs.shape
    values = pairs.reshape(*lead, G, 2 * half, F)
    factor = jnp.exp2(scales.astype(jnp.float32) - SCALE_BIAS)[..., None, :]
    return (values * factor).reshape(*lead, G * 2 * half, F)


@jax.jit
def quantize(w: jax.Array) -> dict:
    """float `w [..., D, F]` (D a multiple of 32) -> {"blocks", "scales"} (see the module doc)."""
    *lead, D, F = w.shape
    x = w.astype(jnp.float32).reshape(*lead, D // BLOCK, BLOCK, F)
    amax = jnp.max(jnp.abs(x), axis=-2)  # [..., G, F]
    # amax = m 2**k, m in [0.5, 1): 6 * 2**(k - 3) = 0.75 * 2**k covers it iff m <= 0.75
    m, k = jnp.frexp(amax)
    s = jnp.maximum(jnp.where(m <= 0.75, k - 3, k - 2), -SCALE_BIAS)
    s = jnp.where(amax == 0, -SCALE_BIAS, s)
    a = jnp.abs(x) * jnp.exp2(-s.astype(jnp.float32))[..., None, :]
    code = sum((a >= t if up else a > t).astype(jnp.uint8) for t, up in _MIDPOINTS)
    code = code | (jnp.signbit(x).astype(jnp.uint8) << 3)  # [..., G, 32, F]
    blocks = code[..., 0::2, :] | (code[..., 1::2, :] << 4)
    return {"blocks": blocks, "scales": (s + SCALE_BIAS).astype(jnp.uint8)}
