"""QK-clip, MuonClip's second half (Kimi K2 report, section 2.1; `train.qk_clip` = tau): after
each optimizer update, every attention head h whose largest pre-softmax logit over the step's
batch, S_h = max_{b,t,s} scale * q_h(t) . k_h(s), exceeded tau has its query and key
projections scaled so that the same inputs would give S_h * gamma_h = tau, gamma_h = tau / S_h.
Heads at or under tau are left exactly as they were (their factors are exactly 1).

    params = clip(params, max_logit_LH, cfg)     # the train step's, after the update

The statistic comes from the step's own forward: the blocked attention kernel returns each
row's largest logit beside its output (`attention_core.block_attention_max`), reduced to
"max_logit" [n_layers, H] in the model's aux (`layer_stats.max_logits`); no second forward.

How a head's logits are scaled by gamma_h:
- MHA (K = H): q_h and k_h each by sqrt(gamma_h), the report's split.
- GQA (K < H: G = H / K query heads share key head k): the key head by
  sqrt(max_g gamma_g) (1 unless every head of the group is over tau), each query head by
  gamma_h / that. Each head's logits scale by exactly gamma_h, the shared key never takes a
  factor that would move a head under tau, and MHA's split is the case G = 1.
  A q / k bias (attention.qkv_bias) is part of the projection and is scaled with it.
- MLA (per the report): the head-specific q_nope_h and k_nope_h (wq or wq_b's first
  qk_nope_head_dim columns of head h, and W_uk = wk_b's head h) by sqrt(gamma_h), q_pe_h
  (the rest of head h's query columns) by gamma_h, the shared rotary key k_pe untouched.

Attention kinds with no logits to read this way (linear layers, QK-norm, the context axis,
MTP layers, LoRA's frozen base) are refused by the config (`config.tree._check_muon`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import Config


def head_factors(max_H: jax.Array, tau: float) -> jax.Array:
    """gamma_h = tau / S_h where S_h > tau, else exactly 1 (float32, [..., H])."""
    max_H = max_H.astype(jnp.float32)
    return jnp.where(max_H > tau, tau / jnp.maximum(max_H, tau), 1.0)


def gqa_factors(gamma_H: jax.Array, n_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """(query factors [..., H], key factors [..., K]) whose products are gamma_h (module doc)."""
    *lead, H = gamma_H.shape
    gamma_KG = gamma_H.reshape(*lead, n_kv_heads, H // n_kv_heads)
    k_K = jnp.sqrt(jnp.max(gamma_KG, axis=-1))
    return (gamma_KG / k_K[..., None]).reshape(*lead, H), k_K


def _layer_of(path: tuple, cfg: Config, n_blocks: int):
    """The layers' indices a params path's attention weight holds: a list (one per stacked
    block, `blocks`) or one index; None for anything else."""
    P, k = cfg.layer_period, cfg.prefix_layers
    if "attn" not in path:
        return None
    if path[0] == "blocks":  # blocks/layers/j/attn/...: [n_blocks, ...]
        return [k + b * P + path[2] for b in range(n_blocks)]
    if path[0] == "tail":
        return k + n_blocks * P + path[1]
    return path[1] if path[0] == "prefix" else None


def _factors(name: str, gamma_H: jax.Array, cfg: Config):
    """The factor [lead..., heads, head_dim or 1] of weight `name`'s [heads, head_dim] dims,
    or None for a weight QK-clip leaves alone."""
    a = cfg.attention
    if a.kind == "mla":
        if name in ("wq", "wq_b"):  # [.., H, N + P]: q_nope by sqrt(gamma), q_pe by gamma
            N, P = a.qk_nope_head_dim, a.qk_rope_head_dim
            root = jnp.broadcast_to(jnp.sqrt(gamma_H)[..., None], (*gamma_H.shape, N))
            full = jnp.broadcast_to(gamma_H[..., None], (*gamma_H.shape, P))
            return jnp.concatenate([root, full], axis=-1)
        return jnp.sqrt(gamma_H)[..., None] if name == "wk_b" else None
    q_H, k_K = gqa_factors(gamma_H, a.n_kv_heads)
    per_head = {"wq": q_H, "q_bias": q_H, "wk": k_K, "k_bias": k_K}.get(name)
    return None if per_head is None else per_head[..., None]


def _scaled(value: jax.Array, factor: jax.Array) -> jax.Array:
    """`value` [lead..., (in,) heads, head_dim] times `factor` [lead..., heads, head_dim or 1]
    (a weight has the input dim, a bias none)."""
    f = factor[..., None, :, :] if value.ndim == factor.ndim + 1 else factor
    return (value * f).astype(value.dtype)


def clip(params, max_logit_LH: jax.Array, cfg: Config):
    """`params` (an nnx params State) with the attention heads whose max logit in
    `max_logit_LH` [n_layers, H] exceeded train.qk_clip scaled down (module doc)."""
    tau = float(cfg.train.qk_clip)
    gamma_LH = head_factors(max_logit_LH, tau)
    n_blocks = (cfg.model.n_layers - cfg.prefix_layers) // cfg.layer_period
    out = []
    for path, v in nnx.to_flat_state(params):
        layers = _layer_of(path, cfg, n_blocks)
        if layers is not None:
            factor = _factors(path[-1], gamma_LH[jnp.asarray(layers)], cfg)
            if factor is not None:
                v = v.replace(_scaled(v[...], factor))
        out.append((path, v))
    return nnx.from_flat_state(out)


def clipped_heads(max_logit_LH: jax.Array, tau: float) -> jax.Array:
    """How many heads of how many layers QK-clip scaled this step (int32 scalar)."""
    return jnp.sum(max_logit_LH > tau, dtype=jnp.int32)
