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

With rl.correction (`correction`) the importance weights need the trainer's log-probs at the
sampler's params: one forward of the whole batch before the updates (no gradient, no
dropout), which every update's clipped ratio then takes as pi_old in place of the sampler's;
with a single update its own forward serves. loss_agg=dapo normalises each update by the
batch's sampled tokens / M (`batch_tokens`), the other reductions by their split's own.

Resuming: a train step is a whole batch of rollouts, its updates one program, so the state
exists (and is saved) at batch boundaries only; a stop asked for while a batch's updates
run (SIGTERM during its rollouts or its passes) takes effect once they are done, and the
checkpoint is of that boundary. A resumed run draws the next batch as the uninterrupted one
did (each draw seeded by its step). The LR schedule advances once a batch (`make_optimizer`)
and LoRA dropout's masks fold in the update's index.

Metrics: the updates' means ("loss", "clip_frac", "kl", "grad_norm", the MoE statistics,
...), but those that measure the sampler / trainer gap (`FIRST_UPDATE`: "logp_diff_max",
"mismatch_kl", ..., "expert_agreement") from the first update alone, the one that runs the
sampler's params (on its split); and the batch's own (`grpo.batch_metrics`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.model import lora
from moe_jax.posttrain.reference_policy import reference_params
from moe_jax.posttrain.rl import grpo
from moe_jax.posttrain.rl.rollouts import token_logps
from moe_jax.sharding import BATCH_AXES

# the sampler's params' own: the sampler / trainer gap (`correction`) and the experts
FIRST_UPDATE = (
    "logp_diff_max", "logp_diff_mean", "mismatch_kl", "mismatch_frac", "is_ess",
    "expert_agreement",
)  # fmt: skip


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

    stats = grpo.batch_metrics(batch)
    batch = batch | {"batch_tokens": batch_tokens(batch, rl)}
    if U == 1:
        params, opt_state, metrics = one(state["params"], state["opt_state"], batch, key)
        return params, opt_state, metrics | stats

    if rl.correction != "none":  # the weights' trainer side: the sampler's params (`correction`)
        with tracing(key), lora.dropping(key, 0.0):
            batch["train_logp"] = sampler_params_logps(state["params"], graphdef, batch, rl)
    splits = split_rows({k: v for k, v in batch.items() if k != "batch_tokens"}, M)

    def body(carry, u):
        rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u % M, 0, False), splits)
        rows["batch_tokens"] = batch["batch_tokens"]
        params, opt_state, metrics = one(*carry, rows, jax.random.fold_in(key, u))
        return (params, opt_state), metrics

    carry = (state["params"], state["opt_state"])
    (params, opt_state), metrics_U = jax.lax.scan(body, carry, jnp.arange(U))
    metrics = {k: v[0] if k in FIRST_UPDATE else jnp.mean(v, axis=0) for k, v in metrics_U.items()}
    return params, opt_state, metrics | stats


def batch_tokens(batch: dict, rl):
    """rl.loss_agg=dapo's normaliser of an update: the batch's sampled tokens that the loss
    counts (dynamic sampling's drops left out) over rl.minibatches."""
    mask_RT = batch["mask"][:, 1:]
    if rl.dynamic_sampling:
        mask_RT = mask_RT * batch["keep"][:, None]
    return jnp.sum(mask_RT) / rl.minibatches


def sampler_params_logps(params, graphdef, batch: dict, rl):
    """The trainer's log-probs of the batch's targets [R, S - 1] at `params` (the sampler's,
    before any update), no gradient, no dropout, the rollout's experts replayed as the
    updates replay them."""
    model = nnx.merge(graphdef, params)
    routes = jnp.swapaxes(batch["routes"], 0, 1) if rl.routing_replay else None
    logp = token_logps(model, batch["tokens"], routes=routes, temperature=rl.temperature)[0]
    return jax.lax.stop_gradient(logp)
