"""The output head's per-token statistics for the loss, optionally a chunk of positions at a time.

    logz_BT, target_logit_BT = head_statistics(model.logits, x_BTD, targets_BT, chunk)

Cross-entropy needs, per target, only logsumexp(logits) and the target's logit, yet computing
them from full logits holds a float32 [B, T, V] array, and its gradient another: 16 GiB for
8192 tokens at Llama 4's 202,048-token vocabulary. With `chunk` > 0 (`train.loss_chunk`) the
head runs on `chunk` positions of every row at a time inside a `lax.map`, each chunk under
`jax.checkpoint`, so the backward recomputes that chunk's logits instead of keeping them: at
most one [B, chunk, V] block of logits (and its gradient) exists at a time, for one more head
matmul in the backward (2 B T D V more FLOPs: a few percent of a step). The statistics are
the same numbers (the same per-token float32 reductions, and the head's gradient summed over
the chunks in order); `chunk` = 0 computes the full logits at once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _statistics(logits_fn, x_BTD, targets_BT):
    logits_BTV = logits_fn(x_BTD)  # float32
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logz_BT, target_logit_BT


def head_statistics(
    logits_fn: Callable[[jax.Array], jax.Array], x_BTD: jax.Array, targets_BT: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """-> (logsumexp of the logits [B, T], the target's logit [B, T]), both float32.
    `logits_fn`: the last layer's output [B, c, D] -> float32 logits [B, c, V]; `chunk`:
    positions per chunk (0: all at once); must divide T."""
    B, T, D = x_BTD.shape
    if chunk <= 0 or chunk >= T:
        return _statistics(logits_fn, x_BTD, targets_BT)
    assert T % chunk == 0, f"train.loss_chunk {chunk} must divide the {T} positions"
    n = T // chunk
    x_NBcD = x_BTD.reshape(B, n, chunk, D).swapaxes(0, 1)
    t_NBc = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)
    one = jax.checkpoint(lambda a: _statistics(logits_fn, *a))
    logz_NBc, target_NBc = jax.lax.map(one, (x_NBcD, t_NBc))
    unchunk = lambda a_NBc: a_NBc.swapaxes(0, 1).reshape(B, T)
    return unchunk(logz_NBc), unchunk(target_NBc)
