"""The weights' collective bytes a train step's sharding implies, per device: the floor that
`moe_jax.aot.command` prints next to what the compiled step moves.

    floor = weight_collectives(cfg, {"data": 1, "fsdp": 64, "expert": 1, "tensor": 1}, "bfloat16")
    # {"all-gather": ..., "reduce-scatter": ..., "all-reduce": ...} in bytes

Counted the way `moe_jax.aot.hlo` counts a compiled step's collectives (the whole array an
all-gather makes, the whole array a reduce-scatter takes), for every parameter:
- split over batch axes on a dim the device computes whole (ZeRO-3: a model dim over fsdp x
  expert, an expert weight's over fsdp; `sharding.LOGICAL_RULES`): gathered whole in the
  compute dtype once for the forward, and a decoder layer's once more for the backward
  where the step rematerialises its layers (`model.remat` other than none: the backward
  needs the weight again and a gather is not kept; the embedding and the head are outside
  the layers), and its gradient reduce-scattered once, in the compute dtype;
- summed over the batch axes that split nothing of it (`data`, or every batch axis for a
  replicated weight: the norms) and over `context` (sequence shards): its gradient shard
  all-reduced, in float32 where nothing is
  gathered (the partitioner sums the float32 gradient), else in the compute dtype.
Each micro-batch of `train.grad_accum` gathers again. Tokens' all-to-alls, the loss's and
the router's statistics and the optimizer's own reductions (the gradient norm) are not
weights' and are left out. A gather run in several steps (`mesh.gather_group`,
`mesh.weight_gather=steps` over two axes) counts each step's whole result, so it reads above
this floor by the later steps' smaller ones (1/8 more for two steps of 8).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from moe_jax.config import Config
from moe_jax.sharding import BATCH_AXES, CONTEXT_AXIS, logical_to_spec


def weight_collectives(cfg: Config, mesh_shape: dict[str, int], compute_dtype) -> dict[str, int]:
    """-> {"all-gather", "reduce-scatter", "all-reduce": bytes per device per step}."""
    from moe_jax.model import Transformer  # here: the model package imports sharding only

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    itemsize = jnp.dtype(compute_dtype).itemsize
    again = cfg.model.remat != "none"
    out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        in_layers = str(path[0]) in ("prefix", "blocks", "tail")
        passes = (1 + (again and in_layers)) * cfg.train.grad_accum
        names = tuple(var.get_metadata().get("out_sharding") or ())
        shape = var.shape
        spec = logical_to_spec(names) if names else (None,) * len(shape)
        split_by, gathered = set(), 1
        local = math.prod(shape)
        for name, entry in zip(names or (None,) * len(shape), spec, strict=True):
            axes = [a for a in (entry if isinstance(entry, tuple) else (entry,)) if a]
            for ax in axes:
                split_by.add(ax)
                local //= mesh_shape[ax]
                # a device computes with its own experts only, and with a shard of `tensor`
                if ax in BATCH_AXES and name != "expert":
                    gathered *= mesh_shape[ax]
        # (`context` splits the tokens and no weight: every gradient is summed over it too)
        replicas = math.prod(mesh_shape[ax] for ax in BATCH_AXES if ax not in split_by)
        replicas *= mesh_shape.get(CONTEXT_AXIS, 1)
        if gathered > 1:
            whole = local * gathered * itemsize
            out["all-gather"] += whole * passes
            out["reduce-scatter"] += whole * cfg.train.grad_accum
            if replicas > 1:
                out["all-reduce"] += local * itemsize
        elif replicas > 1:
            out["all-reduce"] += local * 4
    return out
