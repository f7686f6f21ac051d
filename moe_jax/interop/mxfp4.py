"""MXFP4 expert weights of gpt-oss checkpoints, in NumPy (no torch needed).

Format (OCP Microscaling MXFP4, as OpenAI's gpt-oss checkpoints store the MoE experts): for each
of `model.layers.N.mlp.experts.{gate_up_proj,down_proj}` the checkpoint holds

- `*_blocks`: uint8 `[E, R, G, 16]`, two FP4 E2M1 codes per byte, the element at even position
  2j in the low nibble and the one at 2j+1 in the high nibble (32 values per row of 16 bytes).
  A code is sign(1) exponent(2) mantissa(1); codes 0..15 are
  +0 .5 1 1.5 2 3 4 6  -0 -.5 -1 -1.5 -2 -3 -4 -6.
- `*_scales`: uint8 `[E, R, G]`, one E8M0 exponent per block of 32 values: the block is
  multiplied by 2**(scale - 127). Like transformers, scale 255 means 2**128 (the OCP spec
  calls it NaN), so in bf16 it decodes to +-inf, or +-0 for a zero code.

Layout contract (the one of `transformers.integrations.mxfp4.convert_moe_packed_tensors`, the
dequantisation `from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))` uses):
blocks `[E, R, G, 16]` + scales `[E, R, G]` -> `[E, G*32, R]`, i.e. the values decoded along
the last axis to `[E, R, K=G*32]` and then the last two axes swapped. So the 32-value blocks run
along the *input* dimension of the HF parameter:

- `gate_up_proj_blocks [E, 2*I, H/32, 16]` -> `GptOssExperts.gate_up_proj [E, H, 2*I]`
  (`x @ gate_up_proj[e]`; gate and up interleaved in the last axis: gate = [..., 0::2],
  up = [..., 1::2]);
- `down_proj_blocks [E, H, I/32, 16]` -> `GptOssExperts.down_proj [E, I, H]`.

The biases (`*_bias`, bf16) are stored unquantised. `dequantize` returns bfloat16 (`ml_dtypes`)
by default, the dtype gpt-oss loads in; every value is the exact product code * 2**(scale-127)
rounded to nearest-even in the output dtype (overflow -> +-inf, which only the top scales
253..255 reach in bf16), which is bit for bit what transformers computes. `quantize` is the
inverse direction (for tests and for writing MXFP4 checkpoints).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from moe_jax.model.fp4 import BLOCK, E2M1, FP4_MAX, SCALE_BIAS, e2m1_codes, scale_exponents

# The FP4 E2M1 value of each code 0..15 (transformers' FP4_VALUES); the format's table, scale
# rule and rounding are `model.fp4`'s, one definition for the model's packing and this one.
FP4_VALUES = np.array(E2M1, dtype=np.float64)
__all__ = ["BLOCK", "FP4_MAX", "FP4_VALUES", "SCALE_BIAS", "dequantize", "quantize"]
_OUT_DTYPES = {
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
}
_CHUNK = 1 << 22  # output values decoded (or input values encoded) per step


@functools.lru_cache(maxsize=8)
def _pair_table(dtype: np.dtype) -> np.ndarray:
    """[256 scales * 256 bytes, 2] -> the byte's (low, high) nibble values at that scale, in dtype.

    The products code * 2**(scale-127) are exact in float64; one cast rounds them to nearest-even
    in dtype (as torch's float32 product cast to bf16/f16 does: that product is exact too)."""
    exps = np.arange(256, dtype=np.int64) - SCALE_BIAS
    byte = np.arange(256)
    pair = np.stack([FP4_VALUES[byte & 0x0F], FP4_VALUES[byte >> 4]], axis=-1)  # [256, 2]
    exact = np.ldexp(pair[None, :, :], exps[:, None, None])  # [256, 256, 2]
    with np.errstate(over="ignore"):
        table = exact.astype(dtype)
    table.flags.writeable = False
    return table.reshape(256 * 256, 2)


def _check_blocks_scales(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks must be uint8, got {blocks.dtype}")
    if scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 (E8M0), got {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks must be [experts, rows, groups, 16], got shape {tuple(blocks.shape)}"
        )
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"MXFP4 scales shape {tuple(scales.shape)} must equal blocks shape without the last "
            f"dim {tuple(blocks.shape[:-1])}"
        )


def dequantize(
    blocks: np.ndarray,
    scales: np.ndarray,
    dtype=ml_dtypes.bfloat16,
    *,
    chunk_size: int = _CHUNK,
) -> np.ndarray:
    """MXFP4 `blocks [E, R, G, 16]` uint8 + `scales [E, R, G]` uint8 -> `[E, G*32, R]` in dtype.

    Bit for bit `transformers.integrations.mxfp4.convert_moe_packed_tensors(blocks, scales,
    dtype=...)`, i.e. the HF parameter (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`); see
    the module docstring. dtype: bfloat16 (default, `ml_dtypes.bfloat16`), float16, float32 or
    float64. Decodes about `chunk_size` values at a time through a 256x256 (scale, byte) table,
    so the only full-size array is the output (memory-mapped inputs are read piecewise).
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    _check_blocks_scales(blocks, scales)
    try:
        out_dtype = np.dtype(dtype)
    except TypeError:
        out_dtype = None
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be bfloat16, float16, float32 or float64, got {dtype!r}")
    table = _pair_table(out_dtype)
    n_exp, rows, groups, _ = blocks.shape
    width = groups * BLOCK
    out = np.empty((n_exp, width, rows), dtype=out_dtype)
    step = max(1, chunk_size // max(width, 1))
    for e in range(n_exp):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            idx = (scales[e, r0:r1, :, None].astype(np.intp) << 8) | blocks[e, r0:r1]
            # idx [r, G, 16] = scale * 256 + byte -> [r, G, 16, 2]: (low, high) nibble values
            vals = table.take(idx, axis=0)
            out[e, :, r0:r1] = vals.reshape(r1 - r0, width).T
    return out


def quantize(w: np.ndarray, *, chunk_size: int = _CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """HF expert weight `w [E, K, R]` (any float dtype) -> MXFP4 `(blocks [E, R, K/32, 16] uint8,
    scales [E, R, K/32] uint8)`, the inverse layout of `dequantize` (K: the input dimension,
    a multiple of 32).

    Per block of 32 values along K the scale is the smallest power of two 2**s (s >= -127) with
    max|block| <= 6 * 2**s, so nothing is clipped; each value becomes the nearest E2M1 value of
    w / 2**s, ties to the even code. Hence |dequantize - w| <= half the E2M1 spacing around
    |w| / 2**s, times 2**s (spacing 0.5 below 2, 1 in [2, 4], 2 in [4, 6]), at most 2**s, and
    dequantize(quantize(w)) == w exactly when w is representable (e.g. itself a dequantize).
    Non-finite values and |w| > 6 * 2**127 are refused; an all-zero block gets scale 0.
    """
    w = np.asarray(w)
    if w.ndim != 3 or w.shape[1] % BLOCK:
        raise ValueError(
            f"quantize expects w [experts, K, rows] with K a multiple of {BLOCK}, got shape "
            f"{tuple(w.shape)}"
        )
    if w.dtype.kind != "f" and w.dtype != np.dtype(ml_dtypes.bfloat16):
        raise ValueError(f"quantize expects a float array, got {w.dtype}")
    n_exp, width, rows = w.shape
    groups = width // BLOCK
    blocks = np.empty((n_exp, rows, groups, BLOCK // 2), dtype=np.uint8)
    scales = np.empty((n_exp, rows, groups), dtype=np.uint8)
    # float32 holds bf16/f16/f32 exactly and x / 2**s stays exact (only values far below the
    # first rounding midpoint can lose bits); float64 input is rounded from float64.
    work = np.float64 if w.dtype == np.float64 else np.float32
    step = max(1, chunk_size // max(width, 1))
    for e in range(n_exp):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            x = w[e, :, r0:r1].T.astype(work).reshape(r1 - r0, groups, BLOCK)
            amax = np.max(np.abs(x), axis=-1)  # [r, G]
            if not np.all(np.isfinite(amax)):
                raise ValueError("quantize: w contains inf or NaN")
            if work is np.float64 and np.any(amax > FP4_MAX * 2.0**SCALE_BIAS):
                raise ValueError("quantize: |w| exceeds the largest MXFP4 value 6 * 2**127")
            s = scale_exponents(amax, np)
            codes = e2m1_codes(np.ldexp(x, -s[..., None]), np)  # [r, G, 32]
            blocks[e, r0:r1] = codes[..., 0::2] | (codes[..., 1::2] << 4)
            scales[e, r0:r1] = s + SCALE_BIAS
    return blocks, scales
