"""NaN and inf in an imported checkpoint, refused by tensor as its regions are read (the
import's `--allow-nonfinite` lets them through)."""

from __future__ import annotations

import numpy as np

from moe_jax.interop.lazy import Deferred
from moe_jax.interop.safetensors_io import InteropError, TensorReader


def _nonfinite_error(name: str, reader: TensorReader) -> InteropError:
    return InteropError(
        f"tensor '{name}' in '{reader.file_of(name)}' holds NaN or inf; a model with it "
        "computes NaN: use an intact checkpoint, or import it as it is with --allow-nonfinite"
    )


def checked_finite(tensor: Deferred, name: str, reader: TensorReader) -> Deferred:
    """`tensor` (HF tensor `name`) with each region checked as it is read: one pass over
    values already in memory, so a NaN or inf weight stops the import by name."""

    def compute(index):
        values = tensor.compute(index)
        if not np.isfinite(values).all():
            raise _nonfinite_error(name, reader)
        return values

    return Deferred(tensor.shape, compute, tensor.dtype)
