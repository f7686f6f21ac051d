"""FP8 block-quantised weights as DeepSeek-V3 and Kimi K2 release them, dequantised lazily.

Format (config.json `quantization_config`: quant_method "fp8", fmt "e4m3",
weight_block_size [128, 128]): a linear weight `W [m, n]` is stored as `X.weight`, float8
e4m3 (`F8_E4M3`), and `X.weight_scale_inv`, float32 `[ceil(m / 128), ceil(n / 128)]`, one
scale per 128 x 128 block (the last row and column of blocks may be partial). The weight is

    W[i, j] = float32(X.weight[i, j]) * X.weight_scale_inv[i // 128, j // 128]

a float32 product (DeepSeek's `weight_dequant` and transformers' fp8 dequantisation compute
it so), then rounded to the model's dtype (bf16 for the releases). The embedding, the output
head, the norms and the router stay bf16 / f32 in those checkpoints.

`deferred` gives the dequantised weight before it is computed (`lazy.Deferred`): the tensor maps
slice, transpose and reshape it like an array, and only the window a converter keeps is
dequantised (a chunk of experts, a device's shard), block rows and columns it touches only.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from moe_jax.interop.lazy import Deferred

BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
DEQUANTIZED = np.dtype(ml_dtypes.bfloat16)  # the dtype a "source" import keeps


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block=BLOCK, rows=None, cols=None):
    """float32 `W[rows, cols]` (slices; default all) of a block-quantised weight `w [m, n]`
    with `scale_inv [ceil(m / bm), ceil(n / bn)]`: only those rows and columns are read."""
    (m, n), (bm, bn) = w.shape, block
    rows = slice(*(rows or slice(None)).indices(m)[:2])
    cols = slice(*(cols or slice(None)).indices(n)[:2])
    x = np.asarray(w[rows, cols], dtype=np.float32)
    s = np.asarray(scale_inv, dtype=np.float32)
    r = np.arange(rows.start, rows.stop) // bm
    c = np.arange(cols.start, cols.stop) // bn
    return x * s[r[:, None], c[None, :]]


def check_scales(name: str, w_shape: tuple, s_shape: tuple, block=BLOCK) -> str | None:
    """Why `name`'s scales do not fit its weight, or None."""
    want = tuple(math.ceil(d / b) for d, b in zip(w_shape, block, strict=True))
    if len(w_shape) != 2 or tuple(s_shape) != want:
        return f"'{name}{SCALE_SUFFIX}' has shape {list(s_shape)}, {list(want)} for {list(w_shape)}"
    return None


def deferred(w: np.ndarray, scale_inv: np.ndarray, block=BLOCK) -> Deferred:
    """The dequantised weight of `w` (memory-mapped FP8) and its scales, not yet computed."""

    def compute(index):
        return dequantize(w, scale_inv, block, *index)

    return Deferred(w.shape, compute, DEQUANTIZED)
