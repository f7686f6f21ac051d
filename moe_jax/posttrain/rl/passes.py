"""PPO-style passes over one batch of rollouts: rl.epochs passes, each over rl.minibatches
splits of the batch, one optimizer update a split, all inside one train step.

    params, opt_state, metrics = update_passes(state, batch, cfg, graphdef, tracing, update, key)

Split m holds rows m, m + M, m + 2M, ... (M = rl.minibatches): each device's contiguous
block of the batch splits into M local parts, so the split moves no data between devices
(as gradient accumulation's micro-batches). The updates run in order, epoch by epoch and
split by split in each (a `lax.scan` over them, the params and optimizer state its carry):
each differentiates `grpo.loss_fn` on its split at the params the previous update left,
with the sampler's log-probs as pi_old throughout (`grpo`'s module doc), so from the second
update on the ratio departs from 1 and the clip acts. Each update is an update of its own,
the loss a mean over its split's sampled tokens (PPO's minibatch SGD, verl's ppo_epochs and
ppo_mini_batch_size); the advantages are the whole group's, computed before the split.

Resuming: a train step is a whole batch of rollouts, its updates one program, so the state
exists (and is saved) at batch boundaries only; a stop asked for while a batch's updates
run (SIGTERM during its rollouts or its passes) takes effect once they are done, and the
checkpoint is of that boundary. A resumed run draws the next batch as the uninterrupted one
did (each draw seeded by its step). The LR schedule advances once a batch (`make_optimizer`)
and LoRA dropout's masks fold in the update's index.

Metrics: the updates' means ("loss", "clip_frac", "kl", "grad_norm", the MoE statistics,
...), but "logp_diff_max" and "expert_agreement", which measure the sampler / trainer gap,
from the first update alone, the one that runs the sampler's params (on its split); and the
batch's own (`grpo.batch_metrics`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.posttrain.reference_policy import reference_params
from moe_jax.posttrain.rl import grpo
from moe_jax.sharding import BATCH_AXES

FIRST_UPDATE = ("logp_diff_max", "expert_agreement")  # the sampler's params' own


def split_rows(batch: dict, M: int) -> dict:
    """The batch's arrays [R, ...] as [M, R / M, ...]: split m holds rows m, m + M, ..."""
    split = lambda a: a.reshape(a.shape[0] // M, M, *a.shape[1:]).swapaxes(0, 1)
    splits = jax.tree.map(split, batch)
    if not jax.sharding.get_abstract_mesh().empty:
        splits = jax.lax.with_sharding_constraint(splits, P(None, BATCH_AXES))
    return splits


def update_passes(state: dict, batch: dict, cfg, graphdef, tracing, update, key):
    """-> (params, opt_state, metrics) after rl.epochs x rl.minibatches updates of `state`
    on `batch` (the module doc). `tracing(key)`: the context an update's gradients are
    traced in (the train step's: weight gathers, LoRA dropout); `update(params, opt_state,
    grads, metrics, step)`: the train step's optimizer update."""
    rl = cfg.rl
    M, U = rl.minibatches, rl.updates
    reference = reference_params(state["opt_state"])  # a full fine-tune's KL reference

    def one(params, opt_state, rows, k):
        with tracing(k):
            grads, metrics = grpo.compute_grads(params, graphdef, rows, cfg, reference)
        return update(params, opt_state, grads, metrics, state["step"])

    if U == 1:
        params, opt_state, metrics = one(state["params"], state["opt_state"], batch, key)
        return params, opt_state, metrics | grpo.batch_metrics(batch)

    splits = split_rows(batch, M)

    def body(carry, u):
        rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u % M, 0, False), splits)
        params, opt_state, metrics = one(*carry, rows, jax.random.fold_in(key, u))
        return (params, opt_state), metrics

    carry = (state["params"], state["opt_state"])
    (params, opt_state), metrics_U = jax.lax.scan(body, carry, jnp.arange(U))
    metrics = {k: v[0] if k in FIRST_UPDATE else jnp.mean(v, axis=0) for k, v in metrics_U.items()}
    return params, opt_state, metrics | grpo.batch_metrics(batch)
