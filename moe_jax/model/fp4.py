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
import numpy as np

BLOCK = 32  # values per scale
SCALE_BIAS = 127
FP4_MAX = 6.0
# FP4 E2M1 code -> value (sign bit 3): +0 .5 1 1.5 2 3 4 6, then the negatives.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding |x| to the E2M1 magnitudes: (midpoint, whether a tie rounds up to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))  # fmt: skip

# The format's two operations, written once for NumPy (`xp=np`: interop.mxfp4, the checkpoints'
# layout) and JAX (here, the model's): which scale a block gets, which code a value gets.


def scale_exponents(amax, xp=jnp):
    """A block's exponent s from its largest magnitude: the smallest 2**s (s >= -127) with
    amax <= 6 * 2**s, so that nothing clips; an all-zero block gets -127. amax = m 2**k, m in
    [0.5, 1): 6 * 2**(k - 3) = 0.75 * 2**k covers it iff m <= 0.75."""
    m, k = xp.frexp(amax)
    s = xp.maximum(xp.where(m <= 0.75, k - 3, k - 2), -SCALE_BIAS)
    return xp.where(amax == 0, -SCALE_BIAS, s)


def e2m1_codes(x, xp=jnp):
    """Values already divided by their block's 2**s (|x| <= 6) -> E2M1 codes (uint8): the
    nearest value, ties to the even code (mantissa bit 0, as IEEE's round-to-nearest-even),
    the sign bit kept (-0.1 gives code 8, -0)."""
    a = xp.abs(x)
    code = sum((a >= t if up else a > t).astype(xp.uint8) for t, up in _MIDPOINTS)
    return code | (xp.signbit(x).astype(xp.uint8) << 3)


def _scaled_table() -> np.ndarray:
    """float32 [256 * 16]: code c at scale byte b (index 16 b + c) -> E2M1[c] * 2**(b - 127),
    exact in float64 and rounded once to float32, as `interop.mxfp4` (transformers) decodes:
    subnormal for bytes 0..2, and byte 255 (the OCP spec's NaN) read as 2**128 like
    transformers does: +-inf, 2**127 for code +-0.5, +-0 for a zero code. `quantize` never
    writes 255 (its largest scale is 253)."""
    exact = np.ldexp(np.array(E2M1)[None, :], np.arange(256)[:, None] - SCALE_BIAS)
    with np.errstate(over="ignore"):
        return exact.astype(np.float32).reshape(-1)


_SCALED = _scaled_table()


def _pow2(e: jax.Array) -> jax.Array:
    """2.0**e in float32, e int in [-126, 127], built from its exponent bits (exp2 is off by
    up to 4e-6 on XLA's CPU)."""
    bits = (e.astype(jnp.int32) + 127).astype(jnp.uint32) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize(raw: dict, index=...) -> jax.Array:
    """{"blocks" [..., G, 16, F], "scales" [..., G, F]} -> float32 [..., G * 32, F]; `index`
    picks along the leading axes first (a gather reads only the picked packed rows)."""
    blocks, scales = raw["blocks"], raw["scales"]
    if index is not ...:
        blocks, scales = blocks[index], scales[index]
    # One lookup of (scale, code) -> its value, no multiply: a product with a subnormal result
    # (scale bytes 0..2) is flushed to 0 by XLA's CPU, and 2**(s - 127) alone is inf at 255.
    table = jnp.asarray(_SCALED)
    row = (scales.astype(jnp.int32) << 4)[..., None, :]  # [..., G, 1, F]
    pairs = jnp.stack([table[row | (blocks & 0xF)], table[row | (blocks >> 4)]], axis=-2)
    *lead, G, half, _, F = pairs.shape  # [..., G, 16, 2, F]
    return pairs.reshape(*lead, G * 2 * half, F)


def quantize(w: jax.Array) -> dict:
    """float `w [..., D, F]` (D a multiple of 32) -> {"blocks", "scales"} (see the module doc).
    Non-finite values are refused, as `interop.mxfp4.quantize` refuses them: no scale holds
    them (the spec's NaN scale, 255, decodes to infinities in transformers)."""
    try:
        finite = bool(jnp.all(jnp.isfinite(w)))
    except jax.errors.ConcretizationTypeError:  # traced (nnx.eval_shape): no values to check
        finite = True
    if not finite:
        raise ValueError("quantize: w contains inf or NaN")
    return _quantize(w)


@jax.jit
def _quantize(w: jax.Array) -> dict:
    *lead, D, F = w.shape
    x = w.astype(jnp.float32).reshape(*lead, D // BLOCK, BLOCK, F)
    s = scale_exponents(jnp.max(jnp.abs(x), axis=-2))  # [..., G, F]
    code = e2m1_codes(x * _pow2(-s)[..., None, :])  # [..., G, 32, F]
    blocks = code[..., 0::2, :] | (code[..., 1::2, :] << 4)
    return {"blocks": blocks, "scales": (s + SCALE_BIAS).astype(jnp.uint8)}
