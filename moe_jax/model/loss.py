"""The loss's pieces that every objective shares (cross-entropy, DPO, GRPO): a batch split into
the model's inputs, its targets and which targets count, and the output head's per-token
statistics, optionally a chunk of positions at a time.

    inputs, targets_BT, weights_BT = split_batch(batch)
    logz_BT, target_logit_BT = target_statistics(model, x_BTD, targets_BT, chunk, head_DV)
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

from moe_jax.model import weight_gather
from moe_jax.named_scopes import HEAD_LOSS, scoped
from moe_jax.sharding import logical_to_spec


def _statistics(logits_fn, x_BTD, targets_BT):
    logits_BTV = logits_fn(x_BTD)  # float32
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logz_BT, target_logit_BT


def head_statistics(
    logits_fn: Callable[..., jax.Array],
    x_BTD: jax.Array,
    targets_BT: jax.Array,
    chunk: int,
    head_DV: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """-> (logsumexp of the logits [B, T], the target's logit [B, T]), both float32.
    `logits_fn(x_BcD, head_DV)`: the last layer's output -> float32 logits [B, c, V]; `chunk`:
    positions per chunk (0: all at once), must divide T. `head_DV`: the head weight, read
    once outside the chunk loop and passed to every chunk; under a mesh, give it already
    gathered (a sharding constraint, as `train_step.loss_fn` does): else XLA gathers it and
    all-reduces its gradient once per chunk (Llama 4 at 8192 tokens on v5p-128, 8 chunks:
    34.4 GiB of all-gathers and 16.8 of all-reduces a step instead of 5.5 and 3.3)."""
    B, T, D = x_BTD.shape
    if chunk <= 0 or chunk >= T:
        return _statistics(lambda x: logits_fn(x, head_DV), x_BTD, targets_BT)
    assert T % chunk == 0, f"train.loss_chunk {chunk} must divide the {T} positions"
    n = T // chunk
    x_NBcD = x_BTD.reshape(B, n, chunk, D).swapaxes(0, 1)
    t_NBc = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)
    one = jax.checkpoint(lambda a: _statistics(lambda x: logits_fn(x, head_DV), *a))
    logz_NBc, target_NBc = jax.lax.map(one, (x_NBcD, t_NBc))
    unchunk = lambda a_NBc: a_NBc.swapaxes(0, 1).reshape(B, T)
    return unchunk(logz_NBc), unchunk(target_NBc)


Batch = jax.Array | dict[str, jax.Array]
BATCH_KEYS = ("tokens", "segments", "positions", "loss_mask")


def split_batch(batch: Batch) -> tuple[dict, jax.Array, jax.Array]:
    """-> (model inputs: tokens, positions and segments [B, T] as given; targets [B, T];
    float32 weights [B, T], 1 where a target counts in the loss, else 0)."""
    if not isinstance(batch, dict):
        batch = {"tokens": batch}
    if "tokens" not in batch or not set(batch) <= set(BATCH_KEYS):
        raise ValueError(
            f"a batch dict holds 'tokens' and optionally 'segments', 'positions', 'loss_mask'; "
            f"got {sorted(batch)}"
        )
    tokens_BT1 = batch["tokens"]
    inputs = {"tokens": tokens_BT1[:, :-1]}
    inputs |= {k: batch[k][:, :-1] for k in ("positions", "segments") if k in batch}
    counted_BT = jnp.ones(tokens_BT1[:, 1:].shape, bool)
    if "segments" in batch:  # no target across a document boundary, none on padding
        seg_BT1 = batch["segments"]
        counted_BT = (seg_BT1[:, 1:] == seg_BT1[:, :-1]) & (seg_BT1[:, :-1] != 0)
    if "loss_mask" in batch:
        counted_BT &= batch["loss_mask"][:, 1:] != 0
    return inputs, tokens_BT1[:, 1:], counted_BT.astype(jnp.float32)


@scoped(HEAD_LOSS)
def target_statistics(model, x_BTD, targets_BT, chunk: int, head_DV):
    """-> (logsumexp of the logits, the target's logit), each float32 [B, T], of the model's
    head `head_DV` over the final-normed `x_BTD`, `chunk` positions at a time (0: at once)."""
    # mesh.weight_gather=steps: the chunks run per device, the head gathered one axis at a time
    by_steps = chunk and weight_gather.head_statistics(
        head_statistics, model.final_norm(x_BTD), targets_BT, chunk, head_DV
    )
    if by_steps:
        return by_steps
    if chunk and not jax.sharding.get_abstract_mesh().empty:
        # gathered here, once, whole but for `tensor`'s vocab split (the chunks' loop would
        # gather it again every chunk)
        head_DV = jax.lax.with_sharding_constraint(head_DV, logical_to_spec((None, "vocab")))
    return head_statistics(model.logits, x_BTD, targets_BT, chunk, head_DV)
