"""`Deferred`: an array that is computed only where it is used.

The converters hand the family tensor maps arrays that they slice, transpose and reshape before
anything keeps a window of them (`stream.Window`) or writes them (`ShardWriter`): an FP8
weight not yet dequantised (`fp8.py`), a run's parameter not yet read from its checkpoint
(`export.py`). Only the region finally asked for is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


class Deferred:
    """An array not computed yet: `compute(index)` makes any region of it (a tuple of
    step-1 slices, one per axis). Slicing, transposing and splitting an axis by reshape
    give new Deferreds (any other reshape computes it); `np.asarray` computes it. `dtype`:
    the dtype it stands for (what a converter keeps), not necessarily compute's."""

    def __init__(self, shape: tuple, compute: Callable, dtype):
        self.shape, self.compute, self.dtype = tuple(shape), compute, np.dtype(dtype)
        self.ndim, self.size = len(self.shape), math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

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
                if step < 1:
                    raise ValueError("a deferred array is sliced with a positive step only")
                picks.append(slice(start, max(start, stop), step))
                shape.append(len(range(start, stop, step)))
            else:
                i = int(k) + (n if int(k) < 0 else 0)
                picks.append(i)

        def compute(index):
            it, inner, every = iter(index), [], []
            for p in picks:  # the region of ours that covers it, and the step to take in it
                if isinstance(p, slice):
                    s = next(it)
                    first = p.start + s.start * p.step
                    inner.append(slice(first, first + max(0, (s.stop - s.start - 1) * p.step + 1)))
                    every.append(slice(None, None, p.step))
                else:
                    inner.append(slice(p, p + 1))
                    every.append(0)
            return self.compute(tuple(inner))[tuple(every)]

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
        """Deferred where it splits axes (e.g. [H * hd, D] -> [H, hd, D]); otherwise the
        array computed and reshaped (a merge of axes: one layer's weight, small)."""
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
            if math.prod(shape[k] for k in group) != n:  # not a split: made whole, reshaped
                return np.asarray(self).reshape(shape)
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


def _extent(s: slice) -> int:
    return s.stop - s.start
