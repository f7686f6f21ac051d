"""How an update's per-token GRPO loss becomes one number: `rl.loss_agg`, TRL's loss_type.

    loss = aggregate(loss_RT, mask_RT, "dapo", max_len=rl.max_new_tokens, batch_tokens=n)

Over the update's rows R (its split of the batch) and targets T, `mask_RT` 1 at the sampled
tokens a loss counts (a row dropped by dynamic sampling: all 0):
- grpo: each completion's token mean, then the mean over completions (GRPO's paper: a long
  completion's tokens weigh less);
- bnpo: the mean over all the update's sampled tokens;
- dr_grpo: their sum over completions x max_len (Dr. GRPO: a constant, no length bias);
- dapo: their sum over `batch_tokens`, the whole batch's sampled tokens / rl.minibatches
  (TRL's num_items_in_batch over the generation batch, rescaled to one optimizer step), so
  that a token weighs the same in every split of the batch; bnpo where the update is the batch.
"Completions" count the rows with a sampled token: TRL's grpo and dr_grpo count every row,
which is the same but for rows that dynamic sampling drops, which leave both denominators.
A sequence-level term (GSPO, [R, 1]) is broadcast over its completion's tokens first, as
TRL does. Each denominator is at least 1, so an update with nothing to learn has loss 0.
"""

from __future__ import annotations

import jax.numpy as jnp


def aggregate(loss_RT, mask_RT, agg: str, max_len: int, batch_tokens=None):
    """-> the update's loss under `agg` (the module doc); `batch_tokens` dapo's normaliser
    (None: the update's own sampled tokens)."""
    total = jnp.sum(jnp.broadcast_to(loss_RT, mask_RT.shape) * mask_RT, axis=1)  # [R]
    n_R = jnp.sum(mask_RT, axis=1)
    rows = jnp.maximum(jnp.sum((n_R > 0).astype(jnp.float32)), 1.0)
    if agg == "grpo":
        return jnp.sum(total / jnp.maximum(n_R, 1.0)) / rows
    if agg == "bnpo" or (agg == "dapo" and batch_tokens is None):
        return jnp.sum(total) / jnp.maximum(jnp.sum(n_R), 1.0)
    if agg == "dr_grpo":
        return jnp.sum(total) / (rows * max_len)
    if agg == "dapo":
        return jnp.sum(total) / jnp.maximum(batch_tokens, 1.0)
    raise ValueError(f"rl.loss_agg={agg!r}")  # the config refused it before
