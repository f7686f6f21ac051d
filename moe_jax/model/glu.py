"""The experts' gated activation h = act(gate, up), and its backward for the kernels whose
backward is written by hand (`buckets`, `grouped`).

    act = Activation.from_config(cfg.moe)  # static: a hashable NamedTuple
    h_NF = glu(gate_NF, up_NF, act)
    h_NF, dgate_NF, dup_NF = glu_vjp(gate_NF, up_NF, dh_NF, act)

SwiGLU (Llama, Mixtral, Qwen, DeepSeek): h = silu(gate) * up.
gpt-oss's clamped SwiGLU (transformers' `GptOssExperts._apply_gate`): the gate clamped from
above and the up projection on both sides at `limit`, then
h = gate * sigmoid(alpha * gate) * (up + 1). The clamps pass no gradient to values beyond
them and pass it at the limit itself, as torch's clamp (`_clamp`; jnp.clip would pass half).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Activation(NamedTuple):
    """limit 0: SwiGLU; limit > 0: gpt-oss's clamped form with `alpha` (up + 1 included)."""

    alpha: float = 1.0
    limit: float = 0.0

    @classmethod
    def from_config(cls, moe) -> Activation:
        return cls(moe.swiglu_alpha, moe.swiglu_limit) if moe.swiglu_limit > 0 else SWIGLU


SWIGLU = Activation()


def glu(gate: jax.Array, up: jax.Array, act: Activation = SWIGLU) -> jax.Array:
    if act.limit <= 0:
        return jax.nn.silu(gate) * up
    gate, up = _clamp(gate, None, act.limit), _clamp(up, -act.limit, act.limit)
    return gate * jax.nn.sigmoid(act.alpha * gate) * (up + 1)


def _clamp(x, lo, hi):
    """x clamped to [lo, hi] (lo None: no lower bound), its gradient 1 inside and on the
    bounds, 0 beyond them."""
    x = jnp.where(x > hi, hi, x)
    return x if lo is None else jnp.where(x < lo, lo, x)


def glu_vjp(gate, up, dh, act: Activation = SWIGLU):
    """(h, dgate, dup) of `glu` at (gate, up) for the cotangent dh (all [..., F])."""
    if act.limit <= 0:
        sig = jax.nn.sigmoid(gate)
        silu = gate * sig
        return silu * up, dh * up * sig * (1 + gate * (1 - sig)), dh * silu
    a, limit = act.alpha, act.limit
    gate_c = _clamp(gate, None, limit)
    up_c1 = _clamp(up, -limit, limit) + 1
    sig = jax.nn.sigmoid(a * gate_c)
    act_gate = gate_c * sig
    dgate = dh * up_c1 * sig * (1 + a * gate_c * (1 - sig))
    dgate = jnp.where(gate <= limit, dgate, 0)
    dup = jnp.where(jnp.abs(up) <= limit, dh * act_gate, 0)
    return act_gate * up_c1, dgate, dup
