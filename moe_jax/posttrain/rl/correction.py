"""The sampler / trainer mismatch: its correction (`rl.correction`) and the metrics that show it.

    w, metrics = importance_weights(train_RT, rollout_RT, mask_RT, rl)

The sampler's log-prob of a sampled token (recorded at draw time) and the trainer's at the
same params differ by the two programs' numerics (kernels, the reduction order, bf16; an
engine's batching; capacity drops: `grpo`'s module doc), so the rollouts come from a policy a
little off the one trained. Their ratio w = pi_train / pi_rollout re-weights each token's loss
(verl's rollout correction; TRL's vllm_importance_sampling_correction, whose formulas these
are), with no gradient through it:
- rl.correction_level=token: w per token; sequence: one w per completion, the product of its
  tokens' ratios (exp of the summed log-ratios);
- tis (truncated importance sampling): w clipped to [rl.correction_min, rl.correction_max];
- mis (masked importance sampling): w inside that range, 0 outside (the token, or the whole
  completion, then adds nothing to the loss but still counts in its denominators, as in TRL).
The log-ratios are clamped to [-20, 20] before exp (as verl's), which no range short of
e^20 notices and which keeps a long completion's product finite.

Metrics (of the sampled tokens, whatever rl.correction): "logp_diff_mean" / "logp_diff_max",
the mean and largest |train - rollout| log-prob; "mismatch_kl", the k3 estimate of
KL(rollout || train) (exp(d) - d - 1 with d = train - rollout, the tokens drawn from the
rollout's policy); "mismatch_frac", the fraction of tokens (or completions) whose ratio lies
outside [rl.correction_min, rl.correction_max] (truncated under tis, masked under mis);
"is_ess", the weights' effective sample size over their count, (sum w)^2 / (n sum w^2) (1 when
all are equal; the raw ratios' without a correction).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOG_RATIO_BOUND = 20.0  # see the module doc


def importance_weights(train_RT, rollout_RT, mask_RT, rl):
    """-> (w [R, T] (token level) or [R, 1] (sequence level), or None with rl.correction=none;
    the metrics of the module doc). `train_RT`: the trainer's log-probs at the sampler's params."""
    d_RT = jax.lax.stop_gradient(train_RT - rollout_RT) * mask_RT
    n_tokens = jnp.maximum(jnp.sum(mask_RT), 1.0)
    metrics = {
        "logp_diff_mean": jnp.sum(jnp.abs(d_RT)) / n_tokens,
        "logp_diff_max": jnp.max(jnp.abs(d_RT)),
        "mismatch_kl": jnp.sum((jnp.exp(d_RT) - d_RT - 1) * mask_RT) / n_tokens,
    }
    if rl.correction_level == "sequence":
        log_ratio = jnp.sum(d_RT, axis=1, keepdims=True)  # [R, 1]
        unit = (jnp.sum(mask_RT, axis=1, keepdims=True) > 0).astype(jnp.float32)
    else:
        log_ratio, unit = d_RT, mask_RT
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    lo, hi = rl.correction_min, rl.correction_max
    outside = ((ratio < lo) | (ratio > hi)).astype(jnp.float32) * unit
    n_units = jnp.maximum(jnp.sum(unit), 1.0)
    w = None
    if rl.correction == "tis":
        w = jnp.clip(ratio, lo, hi)
    elif rl.correction == "mis":
        w = ratio * (1.0 - outside)
    shown = (ratio if w is None else w) * unit
    metrics |= {
        "mismatch_frac": jnp.sum(outside) / n_units,
        "is_ess": jnp.sum(shown) ** 2 / (n_units * jnp.maximum(jnp.sum(shown**2), 1e-30)),
    }
    return w, metrics
