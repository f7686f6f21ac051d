"""The decoder's per-layer statistics gathered in layer order: the MoE layers' aux statistics
and losses, and QK-clip's per-head max logits (`transformer.Transformer`'s `aux`).

The layers come as the model runs them: the prefix (moe.first_dense_layers dense, then
moe.hash_layers hash-routed MoE layers), the stacked blocks (each block layer's stats stacked
[n_blocks, ...]) and the tail; layer numbers follow `Config.prefix_layers` and
`Config.layer_period`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.config import Config
from moe_jax.model.routing import aux_loss

# Per-MoE-layer scalars of `aux` ([n_moe_layers] each): what capacity dropped, and how the
# ragged exchange's rounds went (model/exchange_rounds.py).
LAYER_FRACTIONS = ("dropped_frac", "exchange_rounds", "overflow_frac")


def max_logits(cfg: Config, n_blocks: int, prefix: list, blocks: list, tail: list):
    """-> (prefix, blocks, tail stats without "max_logit", the layers' max logits [n_layers,
    H] in layer order, or None where no layer took them: without train.qk_clip)."""
    P, k = cfg.layer_period, cfg.prefix_layers
    found = {i: s["max_logit"] for i, s in enumerate(prefix) if s and "max_logit" in s}
    strip = lambda s: {n: v for n, v in s.items() if n != "max_logit"} or None
    for j, stats in enumerate(blocks):
        if stats and "max_logit" in stats:
            found |= {k + b * P + j: stats["max_logit"][b] for b in range(n_blocks)}
    for j, stats in enumerate(tail):
        if stats and "max_logit" in stats:
            found[k + n_blocks * P + j] = stats["max_logit"]
    if not found:
        return prefix, blocks, tail, None
    prefix, blocks, tail = ([strip(s) if s else s for s in part] for part in (prefix, blocks, tail))
    return prefix, blocks, tail, jnp.stack([found[i] for i in sorted(found)])


def moe_aux(cfg: Config, n_blocks: int, prefix: list, blocks: list, tail: list) -> dict:
    """Per-MoE-layer stats in layer order, and the mean aux losses; "routes" [n_moe_layers,
    B, T, K]: the experts each MoE layer's tokens took."""
    moe = cfg.moe
    P, k = cfg.layer_period, cfg.prefix_layers
    per_layer = [(i, s) for i, s in enumerate(prefix) if s is not None]  # hash-routed layers
    for j, stats in enumerate(blocks):
        if stats is not None:
            for b in range(n_blocks):
                per_layer.append((k + b * P + j, jax.tree.map(lambda a, b=b: a[b], stats)))
    for j, stats in enumerate(tail):
        if stats is not None:
            per_layer.append((k + n_blocks * P + j, stats))
    per_layer = [s for _, s in sorted(per_layer, key=lambda p: p[0])]
    if not per_layer:
        zero = jnp.zeros((), jnp.float32)
        return {
            "aux_loss": zero,
            "lb_loss": zero,
            "z_loss": zero,
            "expert_load": jnp.zeros((0, moe.n_experts), jnp.float32),
            **{k: jnp.zeros((0,), jnp.float32) for k in LAYER_FRACTIONS},
        }
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    aux = {
        "lb_loss": jnp.mean(stacked["lb_loss"]),
        "z_loss": jnp.mean(stacked["z_loss"]),
        "expert_load": stacked["expert_load"],
        "routes": stacked["experts"],
        **{name: stacked[name] for name in LAYER_FRACTIONS},
    }
    if "seq_lb_loss" in stacked:  # moe.seq_aux_loss_weight > 0: summed (routing.aux_loss)
        aux["seq_lb_loss"] = jnp.sum(stacked["seq_lb_loss"])
    return aux | {"aux_loss": aux_loss(aux, moe)}
