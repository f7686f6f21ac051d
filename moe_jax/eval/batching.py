"""Requests packed into padded batches of a few shapes, so that a handful of compiled programs
serve a whole task.

Requests are sorted by length, longest first, and cut into batches of `batch_size` rows; a
batch is padded to the bucket of its longest row (`data.windows.bucket`: the next power of
two, at least a minimum, at most the context) and its last batch is filled up with empty
rows. A program is compiled per (rows, bucket) shape, so a task whose lengths span 20 to 900
tokens costs at most the 7 programs of the buckets 16 .. 1024, and rows of one batch are close
in length (the padding is what the length sort leaves, as in the harness's Hugging Face
backend, plus the bucket's rounding up).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_jax.data.windows import bucket

__all__ = ["batches", "bucket"]


def batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Request indices longest first (ties in their given order), cut into batches of
    `batch_size`; the last batch may be shorter."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
