"""GRPO (Shao et al. 2024) and GSPO (Zheng et al. 2025), `train.objective=grpo`.

    A_R = group_advantages(rewards_PG, scale)                  # host side, numpy
    loss, metrics = clipped_objective(logp, old_logp, adv, mask, rl)
    grads, metrics = compute_grads(params, graphdef, batch, cfg, reference)   # an update's

Each prompt's G completions are compared among themselves: advantage (r - mean) / (std +
1e-4) over the group (std with Bessel's correction, as TRL computes it; `rl.scale_rewards=
false`: r - mean). The objective, with ratio rho = pi / pi_old of the sampled tokens:
- rl.level=token (GRPO): -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A) per sampled
  token;
- rl.level=sequence (GSPO): rho = exp(mean over a completion's tokens of log rho_t), the same
  clipped term per completion, spread over its tokens;
reduced by rl.loss_agg (`aggregate`, TRL's loss_type; "" keeps each level's own: the mean
over the sampled tokens at token level, the mean over completions at sequence level), plus
rl.kl_beta times k3 = exp(ref - logp) - (ref - logp) - 1 per token (reduced alike; "": the
mean over the sampled tokens), and the MoE aux loss. The reference: with LoRA the base with
its adapters off; in a full fine-tune the frozen copy of the starting params in the optimizer
state (`moe_jax.posttrain.reference_policy`); either runs the rollout's experts too under
routing replay. rl.correction (`correction`) weights each token's term by its truncated or
masked importance ratio trainer / sampler, and rl.dynamic_sampling drops the groups whose
rewards are all equal (batch["keep"]) from the loss and its denominators.
pi_old is the sampler's log-prob of the token (under rl.correction the trainer's at the
sampler's params, the ratio's mismatch then carried by the weight), not recomputed: with replay
and the same weights the trainer's equals it to float rounding ("logp_diff_max" shows the
gap), so a recomputing forward would cost a pass over the batch for nothing, and the ratio
stays the importance weight of the distribution the rollouts were drawn from. With one
update a batch rho is 1 but for that gap; rl.epochs x rl.minibatches updates
(`moe_jax.posttrain.rl.passes`) move pi away from it, and the clip acts.

Capacity: the sampler never drops (its graph is dropless, `moe_jax.inference.sampling`), and replay
hands the training forward the sampler's choices, not its drops: with moe.capacity_factor
> 0 the training forward still queues the replayed assignments into its own capacity slots
(its routing groups, its priority rule) and drops what overflows, so a dropped assignment
makes the trainer's log-prob differ from the sampler's. Train GRPO dropless
(moe.capacity_factor=0) for the log-probs to agree; "dropped_frac" shows what a capacity
costs.

The batch (rows R = prompts x G, S positions: `rl.rollout.rollout_batch`): "tokens" [R, S],
"mask" and "old_logp" [R, S] (target t at index t + 1: index 0 is 0), "adv" and "rewards"
[R] (and "keep" [R] with rl.dynamic_sampling), "routes" [R, n_moe_layers, S, K] (the
sampler's experts, row-major for the mesh).

Metrics: "reward_mean"/"reward_std", "adv_abs" (mean |A|), "completion_len" (`batch_metrics`,
of the whole batch; "zero_var_groups", the fraction dynamic sampling drops); of each update
(`loss_fn`): "clip_frac" (the fraction of sampled tokens, or completions, whose clipped term
was the smaller), "kl", the sampler / trainer mismatch (`correction`: "logp_diff_max",
"logp_diff_mean", "mismatch_kl", "mismatch_frac", "is_ess"), "expert_agreement" (the
fraction of the sampler's expert choices the training forward took).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.model import lora as adapters
from moe_jax.model.transformer import LAYER_FRACTIONS
from moe_jax.posttrain import lora as lora_params
from moe_jax.posttrain.rl.aggregate import aggregate
from moe_jax.posttrain.rl.correction import importance_weights
from moe_jax.posttrain.rl.rollouts import expert_agreement, token_logps


def group_advantages(rewards_PG: np.ndarray, scale: bool = True) -> np.ndarray:
    """Each completion's reward less its group's mean, over the group's std + 1e-4."""
    r = np.asarray(rewards_PG, np.float64)
    adv = r - r.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return adv.astype(np.float32)


def clipped_objective(
    logp_RT, old_logp_RT, adv_R, mask_RT, rl, ref_logp_RT=None, weight=None, batch_tokens=None
):
    """-> (the loss, metrics: clip_frac, kl) of the module doc over `mask_RT`'s tokens, reduced
    by rl.loss_agg (`aggregate`); `weight`: the tokens' (or completions') importance weights
    (`correction`), None: 1; `batch_tokens`: loss_agg=dapo's normaliser."""
    eps_lo, eps_hi = rl.clip_eps, rl.clip_eps_high or rl.clip_eps
    log_ratio_RT = (logp_RT - old_logp_RT) * mask_RT
    if rl.level == "sequence":
        n_R1 = jnp.sum(mask_RT, axis=1, keepdims=True)
        ratio = jnp.exp(jnp.sum(log_ratio_RT, axis=1, keepdims=True) / jnp.maximum(n_R1, 1.0))
        unit = (n_R1 > 0).astype(jnp.float32)  # [R, 1]: a completion with sampled tokens
    else:
        ratio, unit = jnp.exp(log_ratio_RT), mask_RT
    adv = adv_R[:, None]
    unclipped, clipped = ratio * adv, jnp.clip(ratio, 1 - eps_lo, 1 + eps_hi) * adv
    loss_RT = -jnp.minimum(unclipped, clipped)  # [R, T], or [R, 1] per sequence
    if weight is not None:
        loss_RT = loss_RT * weight
    agg = rl.loss_agg or ("grpo" if rl.level == "sequence" else "bnpo")
    loss = aggregate(loss_RT, mask_RT, agg, rl.max_new_tokens, batch_tokens)
    clipped_n = jnp.sum((clipped < unclipped).astype(jnp.float32) * unit)
    metrics = {"clip_frac": clipped_n / jnp.maximum(jnp.sum(unit), 1.0), "kl": jnp.zeros(())}
    if ref_logp_RT is not None:
        d_RT = (ref_logp_RT - logp_RT) * mask_RT
        k3_RT = jnp.exp(d_RT) - d_RT - 1
        metrics["kl"] = jnp.sum(k3_RT * mask_RT) / jnp.maximum(jnp.sum(mask_RT), 1.0)
        kl = aggregate(k3_RT, mask_RT, rl.loss_agg or "bnpo", rl.max_new_tokens, batch_tokens)
        loss = loss + rl.kl_beta * kl
    return loss, metrics


def reference_logps(model, graphdef, reference, tokens, routes, temperature: float):
    """The reference's log-probs of the targets (no gradient): the frozen copy `reference`
    (a full fine-tune's), else `model` with its LoRA adapters off; `routes` replayed."""
    if reference is not None:
        model = nnx.merge(graphdef, reference)
        logp = token_logps(model, tokens, routes=routes, temperature=temperature)[0]
    else:
        if not lora_params.has_adapters(nnx.state(model, nnx.Param)):
            raise ValueError(  # a caller's slip, not a user's: train.py makes the copy
                "rl.kl_beta > 0 on a full fine-tune needs the frozen reference in the "
                "optimizer state: make_optimizer(cfg.train, dtype, rl=cfg.rl)"
            )
        with adapters.off():
            logp = token_logps(model, tokens, routes=routes, temperature=temperature)[0]
    return jax.lax.stop_gradient(logp)


def loss_fn(trained, frozen, graphdef, batch: dict, rl, reference=None):
    """-> (the GRPO loss + the MoE aux loss, metrics) of a batch of rollouts; `reference`:
    a full fine-tune's frozen params for the KL (None: LoRA's base)."""
    model = nnx.merge(graphdef, lora_params.join(trained, frozen))
    routes = jnp.swapaxes(batch["routes"], 0, 1)  # [L, R, S, K]
    replay = routes if rl.routing_replay else None
    logp_RT, aux = token_logps(model, batch["tokens"], routes=replay, temperature=rl.temperature)
    mask_RT, rollout_RT = batch["mask"][:, 1:], batch["old_logp"][:, 1:]
    sampled = jax.lax.stop_gradient(logp_RT)
    # the trainer's log-probs at the sampler's params: computed before the passes (`passes`),
    # else this update's own, which are those on the first update
    train_RT = batch.get("train_logp", sampled)
    weight, metrics = importance_weights(train_RT, rollout_RT, mask_RT, rl)
    old_RT = rollout_RT if weight is None else train_RT
    if rl.dynamic_sampling:  # groups without signal leave the loss (`collect.informative`)
        mask_RT = mask_RT * batch["keep"][:, None]
    ref_RT = None
    if rl.kl_beta > 0:
        ref_RT = reference_logps(
            model, graphdef, reference, batch["tokens"], replay, rl.temperature
        )
    loss, objective = clipped_objective(
        logp_RT, old_RT, batch["adv"], mask_RT, rl, ref_RT, weight, batch["batch_tokens"]
    )
    mask_RT = batch["mask"][:, 1:]  # the statistics below: of every sampled token
    metrics |= objective | {
        "expert_agreement": expert_agreement(routes[:, :, :-1], aux["routes"], mask_RT),
        "ce": -jnp.sum(sampled * mask_RT) / jnp.maximum(jnp.sum(mask_RT), 1.0),
    }
    metrics |= {k: aux[k] for k in ("aux_loss", "lb_loss", "z_loss", "expert_load")}
    if "seq_lb_loss" in aux:
        metrics["seq_lb_loss"] = aux["seq_lb_loss"]
    metrics |= {k: aux[k] for k in LAYER_FRACTIONS}
    return loss + aux["aux_loss"], metrics


def batch_metrics(batch: dict) -> dict:
    """The rollouts' own statistics, of the whole batch (the module doc's)."""
    mask_RT = batch["mask"][:, 1:]
    return {
        "reward_mean": jnp.mean(batch["rewards"]),
        "reward_std": jnp.std(batch["rewards"]),
        "adv_abs": jnp.mean(jnp.abs(batch["adv"])),
        "completion_len": jnp.mean(jnp.sum(mask_RT, axis=1)),
        "n_targets": jnp.sum(mask_RT),
    } | ({"zero_var_groups": 1.0 - jnp.mean(batch["keep"])} if "keep" in batch else {})


def compute_grads(params, graphdef, batch: dict, cfg, reference=None) -> tuple:
    """-> (gradients of the trained params (LoRA's A and B alone with adapters), metrics
    with "loss") of a batch of rollouts; `reference` as `loss_fn` takes it."""
    trained, frozen = lora_params.split(params)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(trained, frozen, graphdef, batch, cfg.rl, reference)
    return grads, metrics | {"loss": loss}
