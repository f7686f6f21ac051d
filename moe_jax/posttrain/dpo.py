"""Direct Preference Optimization (Rafailov et al. 2023), `train.objective=dpo`.

    loss, metrics = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    grads, metrics = compute_grads(params, graphdef, batch, cfg)   # the train step's

Each pair's answers are scored by their summed log-probability (the counted tokens of each
row: the answer and its EOS, `data/preference.py`) under the policy and the reference:
    loss = -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))
averaged over the pairs, TRL's `DPOTrainer` loss (loss_type sigmoid, no label smoothing).
`train.dpo_loss` picks another form, each TRL's own, on per-token means (n: an answer's
counted tokens):
    ipo    ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2    (DPOTrainer)
    simpo  -log sigmoid(beta (pi_c / n_c - pi_r / n_r) - gamma), no reference forward
           (CPOTrainer loss_type=simpo with cpo_alpha=0; its rewards beta pi / n)
With LoRA the reference is the policy's base: the same model traced with its adapters off
(`model.lora.off`), so no second copy of the weights exists. A full fine-tune's is a
frozen copy of the params the run started from, held in the optimizer state
(`posttrain.reference_policy`; its matmul weights in the compute dtype, so bfloat16 on
accelerators).
Either way its log-probs carry no gradient. The MoE aux loss of the policy's forward is
added, as in the LM step.

Metrics (means over the pairs): "dpo_loss"; "reward_chosen" / "reward_rejected", the
implicit rewards beta (pi - ref); "reward_margin", their difference; "reward_accuracy", the
fraction of pairs whose chosen reward is the larger; "logps_chosen" / "logps_rejected",
the policy's summed log-probs; and, for the log line, "ce": the policy's mean cross-entropy
over all counted tokens of both answers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import backends
from moe_jax.model import lora as adapters
from moe_jax.model.loss import split_batch, target_statistics
from moe_jax.model.transformer import LAYER_FRACTIONS
from moe_jax.posttrain import lora as lora_params


def pair_losses(policy_c, policy_r, ref_c, ref_r, beta: float, kind="sigmoid", n_c=1.0,
                n_r=1.0, gamma=0.5) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Each pair's loss `kind` (train.dpo_loss) and implicit rewards ([P] each) of pairs'
    summed log-probs ([P] each; n_c, n_r: each answer's counted tokens, for the per-token
    forms)."""
    n_c, n_r = jnp.maximum(n_c, 1.0), jnp.maximum(n_r, 1.0)
    if kind == "simpo":  # no reference: beta times the per-token log-prob is the reward
        reward_c, reward_r = beta * policy_c / n_c, beta * policy_r / n_r
        losses = -jax.nn.log_sigmoid(reward_c - reward_r - gamma)
    else:
        reward_c, reward_r = beta * (policy_c - ref_c), beta * (policy_r - ref_r)
        if kind == "ipo":  # the squared distance of the per-token log-ratios' gap to 1/(2 beta)
            gap = (policy_c - ref_c) / n_c - (policy_r - ref_r) / n_r
            losses = (gap - 1 / (2 * beta)) ** 2
        else:
            losses = -jax.nn.log_sigmoid(reward_c - reward_r)
    return losses, reward_c, reward_r


def dpo_loss(
    policy_c, policy_r, ref_c, ref_r, beta: float, kind="sigmoid", n_c=1.0, n_r=1.0, gamma=0.5
) -> tuple[jax.Array, dict]:
    """The mean loss `kind` over pairs (`pair_losses`' arguments) and its metrics."""
    losses, reward_c, reward_r = pair_losses(
        policy_c, policy_r, ref_c, ref_r, beta, kind, n_c, n_r, gamma
    )
    loss = jnp.mean(losses)
    return loss, {
        "dpo_loss": loss,
        "reward_chosen": jnp.mean(reward_c),
        "reward_rejected": jnp.mean(reward_r),
        "reward_margin": jnp.mean(reward_c - reward_r),
        "reward_accuracy": jnp.mean((reward_c > reward_r).astype(jnp.float32)),
        "logps_chosen": jnp.mean(policy_c),
        "logps_rejected": jnp.mean(policy_r),
    }


def sequence_logps(model, rows: dict) -> tuple[jax.Array, dict, jax.Array, jax.Array]:
    """(each row's summed log-prob of its counted targets [R], the MoE aux, the sum of the
    counted targets' cross-entropies, each row's number of them [R]) of rows (a batch dict
    [R, T+1])."""
    inputs, targets_BT, weights_BT = split_batch(rows)
    x_BTD, aux = model(
        inputs["tokens"], positions=inputs.get("positions"), segments=inputs.get("segments"),
        head=False,
    )  # fmt: skip
    chunk = backends.loss_chunk(model.cfg.train.loss_chunk, x_BTD.shape[1])
    head_DV = model.head_weight() if chunk else None
    logz_BT, target_logit_BT = target_statistics(model, x_BTD, targets_BT, chunk, head_DV)
    logp_BT = (target_logit_BT - logz_BT) * weights_BT
    return jnp.sum(logp_BT, axis=1), aux, -jnp.sum(logp_BT), jnp.sum(weights_BT, axis=1)


def pair_logps(model, graphdef, batch: dict, reference=None):
    """(policy log-probs [2P], reference log-probs [2P] (no gradient), the MoE aux, the sum
    of the counted targets' cross-entropies, each row's count [2P]) of a batch of pairs
    ([P, 2, T+1] arrays, chosen first; rows c, r, c, r, ...). `reference`: the frozen params
    of a full fine-tune's reference, or None for LoRA's base (the model with its adapters
    off). SimPO runs no reference forward (its log-probs are 0)."""
    rows = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}  # [2P, T+1]: c, r, c, ...
    policy_R, aux, ce_sum, count_R = sequence_logps(model, rows)
    if model.cfg.train.dpo_loss == "simpo":
        ref_R = jnp.zeros_like(policy_R)
    elif reference is None:
        with adapters.off():
            ref_R = sequence_logps(model, rows)[0]
    else:
        ref_R = sequence_logps(nnx.merge(graphdef, reference), rows)[0]
    return policy_R, jax.lax.stop_gradient(ref_R), aux, ce_sum, count_R


def loss_fn(trained, frozen, graphdef, batch: dict, beta: float, reference=None):
    """-> (DPO loss + the MoE aux loss, metrics) of a batch of pairs (`pair_logps`)."""
    model = nnx.merge(graphdef, lora_params.join(trained, frozen))
    t = model.cfg.train
    policy_R, ref_R, aux, ce_sum, count_R = pair_logps(model, graphdef, batch, reference)
    loss, metrics = dpo_loss(
        policy_R[0::2], policy_R[1::2], ref_R[0::2], ref_R[1::2], beta, t.dpo_loss,
        count_R[0::2], count_R[1::2], t.simpo_gamma,
    )  # fmt: skip
    count = jnp.sum(count_R)
    metrics |= {"ce": ce_sum / jnp.maximum(count, 1.0), "n_targets": count}
    metrics |= {k: aux[k] for k in ("aux_loss", "lb_loss", "z_loss", "expert_load")}
    if "seq_lb_loss" in aux:
        metrics["seq_lb_loss"] = aux["seq_lb_loss"]
    metrics |= {k: aux[k] for k in LAYER_FRACTIONS}
    return loss + aux["aux_loss"], metrics


def compute_grads(params, graphdef, batch: dict, cfg, reference=None) -> tuple:
    """-> (gradients of the trained params: the adapters' A and B with LoRA, else all;
    metrics with "loss") of a batch of pairs; `reference` as `loss_fn` takes it."""
    trained, frozen = lora_params.split(params)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    beta = cfg.train.dpo_beta
    (loss, metrics), grads = grad_fn(trained, frozen, graphdef, batch, beta, reference)
    return grads, metrics | {"loss": loss}


def eval_sums(params, graphdef, batch: dict, reference=None) -> dict:
    """Sums over a batch's pairs for the held-out metrics (pairs with an answer that counts
    nothing, the padding of the last batch, left out): "pairs"; "dpo_loss",
    "reward_accuracy" (pairs whose chosen reward is the larger) and "reward_margin" summed
    over pairs; "ce_chosen" / "tokens_chosen": the chosen answers' cross-entropy and count."""
    model = nnx.merge(graphdef, params)
    t = model.cfg.train
    policy_R, ref_R, _, _, count_R = pair_logps(model, graphdef, batch, reference)
    losses, reward_c, reward_r = pair_losses(
        policy_R[0::2], policy_R[1::2], ref_R[0::2], ref_R[1::2], t.dpo_beta, t.dpo_loss,
        count_R[0::2], count_R[1::2], t.simpo_gamma,
    )  # fmt: skip
    real = (count_R[0::2] > 0) & (count_R[1::2] > 0)
    total = lambda x: jnp.sum(jnp.where(real, x, 0.0))
    return {
        "pairs": jnp.sum(real.astype(jnp.float32)),
        "dpo_loss": total(losses),
        "reward_accuracy": total((reward_c > reward_r).astype(jnp.float32)),
        "reward_margin": total(reward_c - reward_r),
        "ce_chosen": total(-policy_R[0::2]),
        "tokens_chosen": total(count_R[0::2]),
    }
