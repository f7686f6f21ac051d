"""Rematerialisation policies of the scanned blocks: what the backward keeps, what it recomputes.

`model.remat` picks the base policy: `none` keeps every activation the backward needs, `dots`
keeps matmul outputs (and the named kernel outputs below), `full` keeps only each block's input
and recomputes its forward. On top of `dots` or `full`, activations the model names
(`moe_jax.config.REMAT_NAMES`, via `jax.ad_checkpoint.checkpoint_name`) can be kept by name:

    model.remat_save=qkv_proj            kept in device memory
    model.remat_offload=layer_input,...  moved to host memory in the forward, back in the backward

Offloading trades device memory for host<->device copies that XLA overlaps with compute on
TPU and GPU (MaxText's v6e recipe offloads `layer_input,qkv_proj,out_proj`). On TPU (libtpu
0.0.42) the layer input's offload saves device memory with `moe.row_chunks` (Mixtral on
v6e-256, 12 x 4096 per chip: peak 22.99 -> 14.04 GiB) and costs it without, and the
attention projections' costs it at full depth (benchmarks/results/aot.md). On CPU host memory is
the device's memory: it computes the same values and saves nothing.

An offloaded `layer_input` replaces the block input the scan would otherwise keep on device:
every use of a layer's input goes through its named copy, so the recomputation reads that.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import Recompute, Saveable

from moe_jax.model.attention import ATTENTION_OUT
from moe_jax.model.row_buckets import SAVED_NAMES

# Kept by `dots` besides matmul outputs: the experts' matmuls run inside `buckets`' switch
# and attention's are batched matmuls (not saved by `dots_with_no_batch_dims_saveable`).
DOTS_NAMES = (*SAVED_NAMES, ATTENTION_OUT)
HOST = "pinned_host"


def policy(base: str, save: tuple[str, ...] = (), offload: tuple[str, ...] = ()):
    """The `jax.checkpoint` policy of `base` (dots | full) keeping `save` and offloading
    `offload` by name. An offloaded name overrides `dots`' keeping the same tensor."""
    saved = set(save) | (set(DOTS_NAMES) if base == "dots" else set())
    saved -= set(offload)
    named = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=set(offload),
        offload_src="device",
        offload_dst=HOST,
    )
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def choose(prim, *args, **params):
        by_name = named(prim, *args, **params)
        if by_name is not Recompute:  # Saveable or Offloadable
            return by_name
        if base == "dots" and dots(prim, *args, **params):
            return Saveable
        return Recompute

    return choose


def remat(
    fn, base: str, save: tuple[str, ...] = (), offload: tuple[str, ...] = (), *, scanned=True
):
    """A block's `fn` under `model.remat` = `base`, keeping the named `save` and `offload`
    too: what its backward needs is recomputed from the block's input rather than kept, but
    for what the policy keeps (none: `fn` unchanged). `scanned`: `fn` is a scan's body."""
    if base == "none":
        return fn
    # The scan's loop boundary already keeps XLA from merging the recomputation into the
    # forward, so CSE prevention would only cost (JAX's advice for checkpoint inside scan).
    # A layer outside the scan (the dense prefix, the tail, the MTP layer) needs it.
    return jax.checkpoint(fn, policy=policy(base, save, offload), prevent_cse=not scanned)
