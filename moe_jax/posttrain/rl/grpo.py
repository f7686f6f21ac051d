"""GRPO (Shao et al. 2024) and GSPO (Zheng et al. 2025), `train.objective=grpo`.

    A_R = group_advantages(rewards_PG, scale)                  # host side, numpy
    loss, metrics = clipped_objective(logp, old_logp, adv, mask, rl)
    grads, metrics = compute_grads(params, graphdef, batch, cfg, reference)   # an update's

Each prompt's G completions are compared among themselves: advantage (r - mean) / (std +
1e-4) over the group (std with Bessel's correction, as TRL computes it; `rl.scale_rewards=
false`: r - mean). The objective, with ratio rho = pi / pi_old of the sampled tokens:
- rl.level=token (GRPO): -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A) per sampled
  token, averaged over all the batch's sampled tokens (the token-level mean of DAPO / TRL's
  loss_type="dapo": a long completion weighs by its tokens);
- rl.level=sequence (GSPO): rho = exp(mean over a completion's tokens of log rho_t), the same
  clipped term per completion, averaged over the completions;
plus rl.kl_beta times k3 = exp(ref - logp) - (ref - logp) - 1 per token (mean over the
sampled tokens), and the MoE aux loss. The reference: with LoRA the base with its adapters
off; in a full fine-tune the frozen copy of the starting params in the optimizer state
(`moe_jax.posttrain.reference_policy`); either runs the rollout's experts too under routing replay.
pi_old is the sampler's log-prob of the token, not recomputed by the trainer: with replay
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
[R], "routes" [R, n_moe_layers, S, K] (the sampler's experts, row-major for the mesh).

Metrics: "reward_mean"/"reward_std", "adv_abs" (mean |A|), "completion_len" (`batch_metrics`,
of the whole batch); of each update (`loss_fn`): "clip_frac" (the fraction of sampled tokens,
or completions, whose clipped term was the smaller), "kl", "logp_diff_max" (the largest
|trainer - sampler| log-prob of a sampled token), "expert_agreement" (the fraction of the
sampler's expert choices the training forward took).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.model import lora as adapters
from moe_jax.model.transformer import LAYER_FRACTIONS
from moe_jax.posttrain import lora as lora_params
from moe_jax.posttrain.rl.rollouts import expert_agreement, token_logps


def group_advantages(rewards_PG: np.ndarray, scale: bool = True) -> np.ndarray:
    """Each completion's reward less its group's mean, over the group's std + 1e-4."""
    r = np.asarray(rewards_PG, np.float64)
    adv = r - r.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return adv.astype(np.float32)


def clipped_objective(logp_RT, old_logp_RT, adv_R, mask_RT, rl, ref_logp_RT=None):
    """-> (the loss, metrics: clip_frac, kl) of the module doc, masked to sampled tokens."""
    eps_lo, eps_hi = rl.clip_eps, rl.clip_eps_high or rl.clip_eps
    n_tokens = jnp.maximum(jnp.sum(mask_RT), 1.0)
    log_ratio_RT = (logp_RT - old_logp_RT) * mask_RT
    if rl.level == "sequence":
        n_R = jnp.maximum(jnp.sum(mask_RT, axis=1), 1.0)
        ratio = jnp.exp(jnp.sum(log_ratio_RT, axis=1) / n_R)  # [R]
        adv, weight = adv_R, (jnp.sum(mask_RT, axis=1) > 0).astype(jnp.float32)
        total = jnp.maximum(jnp.sum(weight), 1.0)
    else:
        ratio, adv, weight, total = jnp.exp(log_ratio_RT), adv_R[:, None], mask_RT, n_tokens
    unclipped, clipped = ratio * adv, jnp.clip(ratio, 1 - eps_lo, 1 + eps_hi) * adv
    loss = -jnp.sum(jnp.minimum(unclipped, clipped) * weight) / total
    clip_frac = jnp.sum((clipped < unclipped).astype(jnp.float32) * weight) / total
    metrics = {"clip_frac": clip_frac, "kl": jnp.zeros(())}
    if ref_logp_RT is not None:
        d_RT = (ref_logp_RT - logp_RT) * mask_RT
        kl = jnp.sum((jnp.exp(d_RT) - d_RT - 1) * mask_RT) / n_tokens
        loss, metrics["kl"] = loss + rl.kl_beta * kl, kl
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
    mask_RT, old_RT = batch["mask"][:, 1:], batch["old_logp"][:, 1:]
    ref_RT = None
    if rl.kl_beta > 0:
        ref_RT = reference_logps(
            model, graphdef, reference, batch["tokens"], replay, rl.temperature
        )
    loss, metrics = clipped_objective(logp_RT, old_RT, batch["adv"], mask_RT, rl, ref_RT)
    sampled = jax.lax.stop_gradient(logp_RT)
    metrics |= {
        "logp_diff_max": jnp.max(jnp.abs(sampled - old_RT) * mask_RT),
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
    }


def compute_grads(params, graphdef, batch: dict, cfg, reference=None) -> tuple:
    """-> (gradients of the trained params (LoRA's A and B alone with adapters), metrics
    with "loss") of a batch of rollouts; `reference` as `loss_fn` takes it."""
    trained, frozen = lora_params.split(params)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(trained, frozen, graphdef, batch, cfg.rl, reference)
    return grads, metrics | {"loss": loss}
