"""FP8 block-quantised weights as DeepSeek-V3 and Kimi K2 release them, dequantised lazily.

Format (config.json `quantization_config`: quant_method "fp8", fmt "e4m3",
weight_block_size [128, 128]): a linear weight `W [m, n]` is stored as `X.weight`, float8
e4m3 (`F8_E4M3`), and `X.weight_scale_inv`, float32 `[ceil(m / 128), ceil(n / 128)]`, one
scale per 128 x 128 block (the last row and column of blocks may be partial). The weight is

    W[i, j] = float32(X.weight[i, j]) * X.weight_scale_inv[i // 128, j // 128]

a float32 product (DeepSeek's `weight_dequant` and transformers' fp8 dequantisation compute
it so), then rounded to the model's dtype (bf16 for the releases). The embedding, the output
head, the norms and the router stay bf16 / f32 in those checkpoints.

`Deferred` is the dequantised weight before it is computed: the rules slice, transpose and
reshape it like an array, and only the window a converter keeps is dequantised (a chunk of
experts, a device's shard), block rows and columns it touches only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

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


class Deferred:
    """An array not computed yet: `compute(index)` makes any region of it (a tuple of
    step-1 slices, one per axis). Slicing, transposing and splitting an axis by reshape
    give new Deferreds; `np.asarray` computes it, in float32."""

    def __init__(self, shape: tuple, compute: Callable, dtype=DEQUANTIZED):
        self.shape, self.compute, self.dtype = tuple(shape), compute, np.dtype(dtype)
        self.ndim, self.size = len(self.shape), math.prod(self.shape)

    def __array__(self, dtype=None, copy=None):
        out = self.compute(tuple(slice(0, n) for n in self.shape))
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, key) -> Deferred:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1 :]
        key = key + (slice(None),) * (self.ndim - len(key))
        picks, shape = [], []
        for k, n in zip(key, self.shape, strict=True):
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step != 1:
                    raise ValueError("a deferred FP8 weight is sliced with step 1 only")
                picks.append(slice(start, max(start, stop)))
                shape.append(max(0, stop - start))
            else:
                i = int(k) + (n if int(k) < 0 else 0)
                picks.append(i)

        def compute(index):
            it = iter(index)
            inner = tuple(
                slice(p.start + (s := next(it)).start, p.start + s.stop)
                if isinstance(p, slice)
                else slice(p, p + 1)
                for p in picks
            )
            out = self.compute(inner)
            drop = tuple(a for a, p in enumerate(picks) if not isinstance(p, slice))
            return out.reshape([d for a, d in enumerate(out.shape) if a not in drop])

        return Deferred(shape, compute, self.dtype)

    def transpose(self, *axes) -> Deferred:
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], tuple) else axes
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        inverse = np.argsort(axes)

        def compute(index):
            return self.compute(tuple(index[i] for i in inverse)).transpose(axes)

        return Deferred([self.shape[a] for a in axes], compute, self.dtype)

    @property
    def T(self) -> Deferred:
        return self.transpose()

    def reshape(self, *shape) -> Deferred:
        """Only splits of one axis into several (e.g. [H * hd, D] -> [H, hd, D]), or none."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        shape = tuple(shape)
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        if shape == self.shape:
            return self
        groups, j = [], 0  # for each of our axes, the new axes it splits into
        for n in self.shape:
            group = []
            while j < len(shape) and (math.prod(shape[k] for k in group) < n or not group):
                group.append(j)
                j += 1
            if math.prod(shape[k] for k in group) != n:
                raise ValueError(f"a deferred FP8 weight {self.shape} cannot become {shape}")
            groups.append(group)

        def compute(index):
            outer = []
            for g in groups:  # the rows of our axis that the new axes' slices cover
                first, *rest = [index[k] for k in g]
                inner = math.prod(shape[k] for k in g[1:])
                outer.append(slice(first.start * inner, first.stop * inner))
            out = self.compute(tuple(outer))
            out = out.reshape([_extent(index[g[0]]) if k == g[0] else shape[k]
                               for g in groups for k in g])  # fmt: skip
            return out[tuple(slice(None) if k == g[0] else index[k] for g in groups for k in g)]

        return Deferred(shape, compute, self.dtype)


def _extent(s: slice) -> int:
    return s.stop - s.start


def deferred(w: np.ndarray, scale_inv: np.ndarray, block=BLOCK) -> Deferred:
    """The dequantised weight of `w` (memory-mapped FP8) and its scales, not yet computed."""

    def compute(index):
        return dequantize(w, scale_inv, block, *index)

    return Deferred(w.shape, compute)
