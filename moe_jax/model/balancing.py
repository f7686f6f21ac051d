"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3 sec. 2.1.2).

Each MoE layer with `moe.correction_bias` adds a per-expert bias b_e to its scores to choose
the top-k, never to the weights (`routing.route`). The bias has no gradient (the router
sees it through `stop_gradient`, so the optimizer's update of it is exactly 0: Adam's moments
stay 0 and no weight decay applies to a `*bias`); instead, after every train step,

    b_e += moe.bias_update_rate * sign(mean_e' load_e' - load_e)

with load the layer's fraction of the step's top-k assignments per expert (the train step's
`expert_load` metric: global over the mesh, so every device computes the same bias), raising
the bias of under-loaded experts and lowering that of over-loaded ones. The bias lives with
the params: checkpointed, resumed exactly, imported from and exported to HF's
`e_score_correction_bias`. The MTP layers' biases (model/mtp.py) move by their own loads
(the step's `mtp_expert_load`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.config import Config


def moe_rows(cfg: Config) -> dict[int, int]:
    """layer index -> its row in the model's per-MoE-layer stats (layer order)."""
    layers = [i for i in range(cfg.model.n_layers) if cfg.is_moe(i)]
    return {layer: row for row, layer in enumerate(layers)}


def update_correction_bias(params, metrics: dict, cfg: Config):
    """`params` with every MoE layer's `correction_bias` moved by the rule above, from the
    step's `metrics`: "expert_load" [n_moe_layers, E] (fractions summing to 1 over E), and
    "mtp_expert_load" [mtp_depth, E] where the MTP layers are MoE."""
    rate = cfg.moe.bias_update_rate
    if rate == 0 or not cfg.moe.correction_bias:
        return params
    steps = lambda load_LE: rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)
    step_LE = steps(metrics["expert_load"])
    mtp_LE = steps(metrics["mtp_expert_load"]) if "mtp_expert_load" in metrics else None
    rows = moe_rows(cfg)
    P, k = cfg.layer_period, cfg.prefix_layers
    n_blocks = (cfg.model.n_layers - k) // P

    def update(path, a):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]  # as a State nests
        if names[-1] != "correction_bias":
            return a
        if names[0] == "blocks":  # ("blocks", "layers", j, ...): [n_blocks, E]
            j = int(names[2])
            step_bE = step_LE[jnp.array([rows[k + b * P + j] for b in range(n_blocks)])]
            return a + step_bE.astype(a.dtype)
        if names[0] == "tail":  # ("tail", j, ...): [E]
            return a + step_LE[rows[k + n_blocks * P + int(names[1])]].astype(a.dtype)
        if names[0] == "mtp" and mtp_LE is not None:  # ("mtp", depth - 1, "layer", ...): [E]
            return a + mtp_LE[int(names[1])].astype(a.dtype)
        return a

    return jax.tree_util.tree_map_with_path(update, params)
