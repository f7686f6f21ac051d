"""The named parts of a train step: `jax.named_scope` names that its ops carry in their HLO
`op_name` (`jit(train_step)/.../transpose(jvp(attention))/dot_general`), so HLO dumps,
TensorBoard / Perfetto traces and `python -m moe_jax.profile` name the parts.

One name a part, whichever path computes it (local or expert-parallel, buffers or grouped
rows). Where scopes nest, the innermost names the op: the experts' matmuls inside the
exchange are "experts", its collectives "dispatch" (there) and "combine" (back).
"""

from __future__ import annotations

import functools

import jax

ATTENTION = "attention"  # the attention block: projections, RoPE, the kernel, the output
ROUTER = "router"  # router logits, scores, top-k, capacity slots, the aux statistics
DISPATCH = "dispatch"  # tokens into the experts' buffers or sorted rows, and to their owners
EXPERTS = "experts"  # the routed experts' SwiGLU
COMBINE = "combine"  # the experts' outputs back to their tokens, weighted and summed
SHARED_EXPERT = "shared_expert"  # the always-on expert of an MoE layer
MLP = "mlp"  # the dense layers' SwiGLU
HEAD_LOSS = "head_loss"  # final norm, output head, cross-entropy (and the MTP's)
OPTIMIZER = "optimizer"  # gradient norm, clipping, AdamW, the correction bias's update

PARTS = (ATTENTION, ROUTER, DISPATCH, EXPERTS, COMBINE, SHARED_EXPERT, MLP, HEAD_LOSS, OPTIMIZER)


def scoped(name: str):
    """Decorator: the function's ops under `jax.named_scope(name)`."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return run

    return wrap
