"""The frozen reference model of a full fine-tune (DPO, and GRPO's KL, without LoRA): a copy of
the params the run starts from, held in the optimizer state and never updated.

    tx = with_reference(tx, dtype)           # make_optimizer: dpo, or grpo with rl.kl_beta > 0
    ref = reference_params(state["opt_state"])  # the copy; None with LoRA adapters

With LoRA the reference is the base with the adapters off (`model.lora.off`) and no copy
is made (`init` finds adapters in the params and keeps nothing).

Why the optimizer state: the copy is then made wherever an optimizer state is made, from the
params the run starts with (a fresh run's `init_state`, a run from `init_from` after its
params are restored, an import's first step), saved with every checkpoint and restored on
resume, laid out like the params (its Variables carry their logical axes), donated and
updated in place with the rest of the state (it passes through unchanged), and counted by
the memory check; the run directory gets no new item.

Its dtype: the matmul weights the model casts to its compute dtype as it reads them
(`weights.MATMUL_WEIGHTS`) are stored in `dtype`, the compute dtype (`make_optimizer`'s
`reference_dtype`): with bfloat16 compute the copy takes half the bytes of float32 params
and holds the very values the policy's forward reads at the start, so the reference's
log-probs are the initial policy's bit for bit. Everything else (norms, biases, the router,
MLA's projections) stays float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax
from flax import nnx

from moe_jax.inference.weights import MATMUL_WEIGHTS
from moe_jax.posttrain.lora import has_adapters


class ReferenceState(NamedTuple):
    reference: Any  # the params the run started from; () where LoRA adapters are the policy
    inner: Any  # the wrapped transform's state


def with_reference(tx: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """`tx` whose state also holds a frozen copy of the params it was made for (see the
    module doc); updates are `tx`'s."""

    def init(params):
        reference = () if has_adapters(params) else frozen_copy(params, dtype)
        return ReferenceState(reference, tx.init(params))

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state.inner, params)
        return updates, ReferenceState(state.reference, inner)

    return optax.GradientTransformation(init, update)


def frozen_copy(params, dtype: str):
    """A new array for every param (never the params' own buffers, which the train step
    donates), the matmul weights the model casts as it reads them in `dtype`."""

    def one(path, v):
        a = v[...]
        to = dtype if path[-1] in MATMUL_WEIGHTS and jnp.issubdtype(a.dtype, jnp.floating) else None
        return v.replace(jnp.array(a, dtype=to, copy=True))

    return nnx.from_flat_state([(p, one(p, v)) for p, v in nnx.to_flat_state(params)])


def reference_params(opt_state):
    """The frozen copy in an optimizer state made by `with_reference`, or None (no copy:
    another objective, or LoRA's base with its adapters off is the reference)."""
    if isinstance(opt_state, ReferenceState) and not isinstance(opt_state.reference, tuple):
        return opt_state.reference
    return None
