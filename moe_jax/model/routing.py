"""Routing: which experts take a token, with what weight, in which capacity slot; the aux
statistics; and the two places `moe.route_scale` acts (semantics: `moe.py`'s docstring).

A new router (group-limited, bias-corrected, ...) is a new branch of `route`; everything after
it (slots, dispatch, the expert paths) takes its (weights, experts) as they are.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig
from moe_jax.named_scopes import COMBINE, DISPATCH, ROUTER, scoped


def capacity(tokens_per_group: int, cfg: MoEConfig) -> int:
    if cfg.capacity_factor <= 0:
        return tokens_per_group
    return max(1, math.ceil(cfg.capacity_factor * tokens_per_group * cfg.top_k / cfg.n_experts))


def route(
    logits_TE: jax.Array,
    cfg: MoEConfig,
    correction_E: jax.Array | None = None,
    replay_TK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (weights_TK, experts_TK, router probabilities_TE used by the load-balance loss).

    The experts: the top-k of the logits, or, with DeepSeek-V3's routing (a correction bias,
    or groups), of the scores plus the bias, inside the topk_group best groups
    (`limit_to_groups`). Ties go to the lower expert (lax.top_k). The weights: the picked
    experts' scores (softmax, sigmoid of the logit, or DeepSeek-V4's sqrt(softplus(logit))),
    never the bias, optionally renormalised over the k, times moe.routed_scaling_factor.

    `replay_TK` (routing replay, int): experts recorded elsewhere (the sampler's), taken
    instead of the top-k for every token whose first entry is >= 0 (-1: not recorded, the
    token routes itself). The weights are still this router's scores at those experts,
    renormalised as configured, so the gradient reaches the chosen experts' router columns."""
    if cfg.score == "softmax":
        scores_TE = probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    else:  # sigmoid, sqrtsoftplus: each expert's own score, per token normalised for the loss
        scores_TE = score_fn(cfg.score)(logits_TE)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    if correction_E is None and cfg.n_group == 1:
        experts_TK = jax.lax.top_k(logits_TE, cfg.top_k)[1]  # the scores' order (monotone)
    else:
        choice_TE = scores_TE
        if correction_E is not None:  # chooses, never weighs: no gradient through it
            choice_TE = choice_TE + jax.lax.stop_gradient(correction_E)
        if cfg.n_group > 1:
            choice_TE = limit_to_groups(choice_TE, cfg.n_group, cfg.topk_group)
        experts_TK = jax.lax.top_k(choice_TE, cfg.top_k)[1]
    if replay_TK is not None:
        recorded_T1 = replay_TK[..., :1] >= 0
        experts_TK = jnp.where(recorded_T1, replay_TK.astype(experts_TK.dtype), experts_TK)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if cfg.renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    if cfg.routed_scaling_factor != 1.0:
        weights_TK = weights_TK * cfg.routed_scaling_factor
    return weights_TK, experts_TK, probs_TE


def score_fn(score: str):
    """A per-expert score of the logit: sigmoid (DeepSeek-V3, Llama 4) or sqrtsoftplus,
    sqrt(softplus(x)) (DeepSeek-V4: transformers' SqrtSoftplusActivation)."""
    if score == "sqrtsoftplus":
        return lambda x: jnp.sqrt(jax.nn.softplus(x))
    return jax.nn.sigmoid


def limit_to_groups(choice_TE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Group-limited routing (DeepSeek-V3): the experts in n_group equal consecutive groups,
    each group scored by the sum of its two best choice scores; the experts outside the token's
    topk_group best groups get -inf, so the top-k never picks them while k fits."""
    *lead, E = choice_TE.shape
    choice_TGe = choice_TE.reshape(*lead, n_group, E // n_group)
    group_TG = jnp.sum(jax.lax.top_k(choice_TGe, 2)[0], axis=-1)
    best_Tg = jax.lax.top_k(group_TG, topk_group)[1]
    kept_TG = jnp.any(jax.nn.one_hot(best_Tg, n_group, dtype=bool), axis=-2)
    return jnp.where(kept_TG[..., None], choice_TGe, -jnp.inf).reshape(choice_TE.shape)


def assign_slots(
    experts_BTK: jax.Array, n_experts: int, cap: int, valid_BT: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Slot of every assignment in a flat [E * C] buffer for one routing group.

    experts_BTK: expert ids of the group's B rows x T positions x K choices; `valid_BT`
    (optional): False for tokens not to route (padding), which take no slot.
    Returns slot_BTK (E * C where dropped, i.e. out of range) and keep_BTK.
    """
    B, T, K = experts_BTK.shape
    n = B * T * K
    if valid_BT is not None:  # queue padding at a virtual expert E past the real ones
        experts_BTK = jnp.where(valid_BT[..., None], experts_BTK, n_experts)
    # Priority of each assignment: choice rank first, then position, then row.
    k_idx = jnp.arange(K)[None, None, :]
    t_idx = jnp.arange(T)[None, :, None]
    b_idx = jnp.arange(B)[:, None, None]
    priority_BTK = (k_idx * T + t_idx) * B + b_idx
    key = (experts_BTK * n + priority_BTK).reshape(-1)  # unique keys: sort by expert, priority
    order = jnp.argsort(key)
    sorted_experts = experts_BTK.reshape(-1)[order]
    counts_E = jnp.bincount(sorted_experts, length=n_experts + 1)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted = jnp.arange(n) - starts_E[sorted_experts]  # position within its expert's queue
    rank = jnp.zeros(n, rank_sorted.dtype).at[order].set(rank_sorted).reshape(B, T, K)
    keep_BTK = (rank < cap) & (experts_BTK < n_experts)
    slot_BTK = jnp.where(keep_BTK, experts_BTK * cap + rank, n_experts * cap)
    return slot_BTK, keep_BTK


class Routing(NamedTuple):
    """One routing group's decisions: each assignment's weight (compute dtype), expert, slot
    in the flat [E * cap] buffers and whether it is kept, and the group's statistic sums."""

    weights: jax.Array  # [b, T, K]
    experts: jax.Array  # [b, T, K]
    slot: jax.Array  # [b, T, K]; E * cap where dropped
    keep: jax.Array  # [b, T, K]
    cap: int
    sums: dict


@scoped(ROUTER)
def route_group(
    x_bTD: jax.Array,
    router_DE: jax.Array,
    router_bias_E: jax.Array,
    cfg: MoEConfig,
    dtype,
    valid_bT: jax.Array | None = None,
    correction_E: jax.Array | None = None,
    replay_bTK: jax.Array | None = None,
) -> Routing:
    """Route one group of tokens (`correction_E`: the choice's bias; `replay_bTK`: recorded
    experts to reuse; see `route`). With `valid_bT`, the statistic sums are over the valid
    tokens and count them ("tokens"). Replayed experts take their capacity slots as the
    group's own choices would: the drops are this group's, of the replayed choices."""
    b, T, _ = x_bTD.shape
    logits_bTE = x_bTD.astype(jnp.float32) @ router_DE + router_bias_E
    weights_bTK, experts_bTK, probs_bTE = route(logits_bTE, cfg, correction_E, replay_bTK)
    cap = capacity(b * T, cfg)
    slot_bTK, keep_bTK = assign_slots(experts_bTK, cfg.n_experts, cap, valid_bT)
    if cap >= b * T and replay_bTK is None:
        # No expert can take more than the group's b * T tokens (a token's top-k are
        # distinct), so every routed assignment is kept. Said without the slots' sort and
        # scatters, a program that reads `keep` alone (decoding's picked experts) drops them:
        # ~4 of a decode step's ~28 kernels a layer on a GPU (benchmarks/results/gpu.md).
        keep_bTK = jnp.ones(experts_bTK.shape, bool)
        if valid_bT is not None:
            keep_bTK = keep_bTK & valid_bT[..., None]
    load_bTKE = jax.nn.one_hot(experts_bTK, cfg.n_experts, dtype=jnp.float32)
    z_bT = jax.nn.logsumexp(logits_bTE, axis=-1) ** 2
    if valid_bT is not None:  # padding counts in no statistic
        w_bT = valid_bT.astype(jnp.float32)
        load_bTKE = load_bTKE * w_bT[..., None, None]
        probs_bTE = probs_bTE * w_bT[..., None]
        z_bT = z_bT * w_bT
    sums = {
        "load": jnp.sum(load_bTKE, (0, 1, 2)),
        "prob": jnp.sum(probs_bTE, axis=(0, 1)),
        "z": jnp.sum(z_bT),
        "kept": jnp.sum(keep_bTK.astype(jnp.float32)),
    }
    if valid_bT is not None:
        sums["tokens"] = jnp.sum(w_bT)
    if cfg.seq_aux_loss_weight > 0:
        sums |= sequence_balance(logits_bTE, probs_bTE, None if valid_bT is None else w_bT, cfg)
    return Routing(weights_bTK.astype(dtype), experts_bTK, slot_bTK, keep_bTK, cap, sums)


def sequence_balance(logits_bTE, probs_bTE, valid_bT, cfg: MoEConfig) -> dict:
    """DeepSeek-V3's sequence-wise balance loss, summed over the group's rows: each row's
    E sum_e f_e P_e over its own (valid) tokens, f its fraction of the top-k assignments and
    P its mean normalised score (`probs_bTE`, zero on padding): the load-balance loss of one
    sequence. The top-k is of each token's own scores, not the choice the correction bias and
    the groups make (the report's eq. 18, as Megatron-LM's seq_aux_loss computes it). A row
    is the sequence (packed documents share it); rows without a valid token count in neither
    sum."""
    b, T, E = logits_bTE.shape
    load_bTKE = jax.nn.one_hot(jax.lax.top_k(logits_bTE, cfg.top_k)[1], E, dtype=jnp.float32)
    if valid_bT is not None:
        load_bTKE = load_bTKE * valid_bT[..., None, None]
    n_b = jnp.full((b,), float(T)) if valid_bT is None else jnp.sum(valid_bT, 1)
    f_bE = jnp.sum(load_bTKE, axis=(1, 2)) / jnp.maximum(n_b * cfg.top_k, 1.0)[:, None]
    p_bE = jnp.sum(probs_bTE, axis=1) / jnp.maximum(n_b, 1.0)[:, None]
    return {
        "seq_lb": cfg.n_experts * jnp.sum(f_bE * p_bE),
        "seqs": jnp.sum((n_b > 0).astype(jnp.float32)),
    }


def aux_stats(sums: dict, n_tokens: int, cfg: MoEConfig) -> dict:
    """Global aux losses and metrics from summed per-group statistics, per token: the
    call's `n_tokens`, or the valid tokens counted in sums["tokens"] (at least 1). Sums of
    the ragged exchange, where it ran: "rounds" and "overflow" rows."""
    if "tokens" in sums:
        n_tokens = jnp.maximum(sums["tokens"], 1.0)
    E, K = cfg.n_experts, cfg.top_k
    load_E = sums["load"] / (n_tokens * K)
    stats = {
        "lb_loss": E * jnp.sum(load_E * sums["prob"] / n_tokens),
        "z_loss": sums["z"] / n_tokens,
        "expert_load": load_E,
        "dropped_frac": (n_tokens * K - sums["kept"]) / (n_tokens * K),  # exact 0 if none
        # The ragged exchange's rounds (exchange_rounds.py), and the fraction of the kept rows
        # that did not fit the first: 1 and 0 on every other path.
        "exchange_rounds": sums.get("rounds", jnp.ones((), jnp.float32)),
        "overflow_frac": sums.get("overflow", 0.0) / jnp.maximum(sums["kept"], 1.0),
    }
    if "seq_lb" in sums:  # moe.seq_aux_loss_weight > 0: the mean over the sequences
        stats["seq_lb_loss"] = sums["seq_lb"] / jnp.maximum(sums["seqs"], 1.0)
    return stats


def aux_loss(aux: dict, cfg: MoEConfig) -> jax.Array:
    """The MoE's term of the training loss from the model's aux statistics: the Switch
    load-balance and router z losses as means over the MoE layers (DESIGN.md), DeepSeek-V3's
    sequence-wise loss as their sum ("seq_lb_loss"), as DeepSeek's code adds each MoE layer's
    alpha * loss to the total (its modeling_deepseek.py: MoEGate's seq_aux, AddAuxiliaryLoss
    in every layer): alpha is per layer, as published."""
    loss = cfg.lb_loss_weight * aux["lb_loss"] + cfg.z_loss_weight * aux["z_loss"]
    if "seq_lb_loss" in aux:
        loss = loss + cfg.seq_aux_loss_weight * aux["seq_lb_loss"]
    return loss


# ----------------------------------------------------------------------------- route_scale


def scale_inputs(x_nD: jax.Array, w_n: jax.Array, route_scale: str) -> jax.Array:
    """Each assignment's expert input: `route_scale="input"` (Llama 4) scales it by the
    assignment's weight; "output" leaves it (the weight applies in `sum_choices`)."""
    return x_nD * w_n[..., None] if route_scale == "input" else x_nD


def sum_choices(y_BTKD: jax.Array, w_BTK: jax.Array, keep_BTK, route_scale: str) -> jax.Array:
    """Each token's output: the sum over its K choices, weighted for `route_scale="output"`,
    dropped assignments (`keep_BTK` False; None: none dropped here) counting 0."""
    if route_scale == "output":
        y_BTKD = y_BTKD * w_BTK[..., None]
    if keep_BTK is not None:
        y_BTKD = jnp.where(keep_BTK[..., None], y_BTKD, 0)
    return jnp.sum(y_BTKD, axis=2)


# ----------------------------------------------------------------------------- buffers


def dispatch(x_BTD: jax.Array, slot_BTK: jax.Array, n_slots: int) -> jax.Array:
    """Gather tokens into the flat [E * C, D] expert buffer (empty slots are zero)."""
    B, T, K = slot_BTK.shape
    token_BTK = jnp.broadcast_to(jnp.arange(B * T).reshape(B, T, 1), (B, T, K))
    # Slot -> token index; empty slots point at an appended zero row.
    token_of_slot = (
        jnp.full((n_slots,), B * T).at[slot_BTK.reshape(-1)].set(token_BTK.reshape(-1), mode="drop")
    )
    x_pad = jnp.concatenate([x_BTD.reshape(B * T, -1), jnp.zeros_like(x_BTD[0, :1])], axis=0)
    return x_pad[token_of_slot]


def combine(y_SD: jax.Array, slot_BTK: jax.Array) -> jax.Array:
    """Each assignment's expert output [B, T, K, D]; dropped assignments read zeros."""
    return y_SD.at[slot_BTK].get(mode="fill", fill_value=0)


@scoped(DISPATCH)
def to_buffers(x_bTD: jax.Array, r: Routing, n_experts: int, route_scale: str) -> jax.Array:
    """A group's tokens into the flat [E * C, D] buffers, input-scaled for "input"."""
    if route_scale == "input":  # each assignment's own input: one row per assignment
        D = x_bTD.shape[-1]
        x_nD = scale_inputs(x_bTD[:, :, None, :], r.weights, route_scale).reshape(-1, 1, D)
        return dispatch(x_nD, r.slot.reshape(-1, 1, 1), n_experts * r.cap)
    return dispatch(x_bTD, r.slot, n_experts * r.cap)


@scoped(COMBINE)
def from_buffers(y_SD: jax.Array, slot_bTK: jax.Array, w_bTK, route_scale: str) -> jax.Array:
    """The tokens' outputs [b, T, D] from the buffers' rows (slots outside them read 0)."""
    return sum_choices(combine(y_SD, slot_bTK), w_bTK, None, route_scale)
