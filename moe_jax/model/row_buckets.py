"""One expert's SwiGLU on the filled rows of its capacity buffers only.

Dispatch fills an expert's slots from the front (`routing.assign_slots`: slot = rank in the
expert's queue), so of a [C, D] buffer segment only the first `filled` rows hold tokens; the
rest are zeros whose outputs combine never reads. Computing them anyway is the capacity
factor's padding (25% more expert work at 1.25) and, without drops (C = every token of the
group), E / k times the active work. Shapes must be static, so the rows computed are the
smallest of a few static *buckets* (0, q, 2q, ..., C) holding `filled`, picked with
`lax.switch`; outputs past the bucket are zeros.

The backward is written by hand (`jax.custom_vjp`) for two reasons: autodiff of a switch
keeps the residuals of every branch (the sum of all bucket sizes), and the same bucket must
serve the weight gradients, which then contract over the bucket's rows only. It keeps the
gate and up projections, padded to C rows. Under `model.remat=dots` those and the output are
kept by name (`SAVED_NAMES`): left to the policy, the switch would keep the down-projection
output of every branch, and 0.7 GB more for the medium benchmark.

    y_SCD = swiglu_filled(x_SCD, w, filled_S, dtype)   # w: w_gate/w_up [D, F], w_down [F, D]
                                                       #    (+ gate_bias/up_bias [F])
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_jax.model import in_turn
from moe_jax.model.glu import SWIGLU, Activation, glu, glu_vjp

# Checkpoint names of the expert's output (what combine's backward needs) and of the
# residuals of its own backward: `model.remat=dots` keeps both (see `remat.py`).
SAVED_NAMES = ("expert_out", "expert_gate_up")
MAX_BUCKETS = 8  # non-empty buckets (the switch has one more branch, for 0 rows); more
# would cut padding further, at compile time's cost
MIN_BUCKET_ROWS = 32  # below this a matmul's rows cost about the same as none skipped


def row_buckets(capacity: int) -> tuple[int, ...]:
    """Static row counts a segment of `capacity` slots is computed on: 0, q, 2q, ..., C."""
    q = max(MIN_BUCKET_ROWS, 8 * math.ceil(capacity / MAX_BUCKETS / 8))
    return (0, *range(q, capacity, q), capacity)


def bucket_index(filled_S: jax.Array, buckets: tuple[int, ...]) -> jax.Array:
    """Index of the smallest bucket holding each segment's filled rows."""
    return jnp.searchsorted(jnp.asarray(buckets[1:]), filled_S, side="left") + (filled_S > 0)


def _pad_rows(a_RX: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(a_RX, ((0, rows - a_RX.shape[0]), (0, 0)))


def _cast(w: dict, dtype, x) -> dict:
    """The weights in `dtype` (16-bit ones converted once `x` exists: `in_turn.dense`)."""
    return {n: in_turn.dense(a, dtype, x) for n, a in w.items()}


def _forward_rows(r: int, x_CD, w, dtype, act: Activation):
    """SwiGLU of the first r rows, outputs padded to C rows: (y_CD, gate_CF, up_CF)."""
    # r = 0 (nothing filled) goes through the same code: its matmuls are empty, and the zeros
    # it pads with carry the inputs' sharding types, as a switch needs under shard_map.
    C = x_CD.shape[0]
    w = _cast(w, dtype, x_CD)
    x_rD = x_CD[:r]
    gate_rF = x_rD @ w["w_gate"] + w.get("gate_bias", 0)
    up_rF = x_rD @ w["w_up"] + w.get("up_bias", 0)
    y_rD = glu(gate_rF, up_rF, act) @ w["w_down"]
    return tuple(_pad_rows(a, C) for a in (y_rD, gate_rF, up_rF))


def _backward_rows(r: int, x_CD, w, gate_CF, up_CF, dy_CD, dtype, act: Activation):
    """Cotangents of x (padded to C rows) and of each weight, from the first r rows."""
    C = x_CD.shape[0]
    wc = _cast(w, dtype, dy_CD)
    x_rD, gate_rF, up_rF, dy_rD = (a[:r].astype(dtype) for a in (x_CD, gate_CF, up_CF, dy_CD))
    dh_rF = dy_rD @ wc["w_down"].T
    h_rF, dgate_rF, dup_rF = glu_vjp(gate_rF, up_rF, dh_rF, act)
    dx_rD = dgate_rF @ wc["w_gate"].T + dup_rF @ wc["w_up"].T
    rows_T = lambda a, b: jnp.einsum("rd,rf->df", a, b)  # contracted over the r rows
    grads = {
        "w_gate": rows_T(x_rD, dgate_rF),
        "w_up": rows_T(x_rD, dup_rF),
        "w_down": rows_T(h_rF, dy_rD),
        "gate_bias": jnp.sum(dgate_rF, axis=0),
        "up_bias": jnp.sum(dup_rF, axis=0),
    }
    grads = {n: grads[n].astype(a.dtype) for n, a in w.items()}
    return _pad_rows(dx_rD, C).astype(x_CD.dtype), grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def swiglu_filled(x_SCD, w: dict, filled_S, dtype, act: Activation = SWIGLU) -> jax.Array:
    """SwiGLU (`act`) of each segment's first filled rows (rounded up to a bucket); zeros past
    them."""
    return _swiglu_filled_fwd(x_SCD, w, filled_S, dtype, act)[0]


def _swiglu_filled_fwd(x_SCD, w, filled_S, dtype, act=SWIGLU):
    buckets = row_buckets(x_SCD.shape[1])
    index_S = bucket_index(filled_S, buckets)
    branches = [functools.partial(_forward_rows, r, dtype=dtype, act=act) for r in buckets]
    ys, gates, ups = zip(
        *(jax.lax.switch(index_S[s], branches, x_SCD[s], w) for s in range(x_SCD.shape[0])),
        strict=True,
    )
    # Saved as rows [S * C, .]: stacked over the experts and by the layer scan, a size-1 S axis
    # got a permuted layout and a copy back on every slice.
    S, C = x_SCD.shape[:2]
    rows = lambda parts: jnp.stack(parts).reshape(S * C, -1)
    y_SCD = checkpoint_name(rows(ys), SAVED_NAMES[0]).reshape(S, C, -1)
    gate_up = checkpoint_name((rows(gates), rows(ups)), SAVED_NAMES[1])
    return y_SCD, (x_SCD, w, index_S, gate_up)


def _swiglu_filled_bwd(dtype, act, residuals, dy_SCD):
    x_SCD, w, index_S, gate_up = residuals
    gate_SCF, up_SCF = (a.reshape(*x_SCD.shape[:2], -1) for a in gate_up)
    buckets = row_buckets(x_SCD.shape[1])
    branches = [functools.partial(_backward_rows, r, dtype=dtype, act=act) for r in buckets]
    dxs, dws = zip(
        *(
            jax.lax.switch(index_S[s], branches, x_SCD[s], w, gate_SCF[s], up_SCF[s], dy_SCD[s])
            for s in range(x_SCD.shape[0])
        ),
        strict=True,
    )
    dw = jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *dws)
    return jnp.stack(dxs), dw, None


swiglu_filled.defvjp(_swiglu_filled_fwd, _swiglu_filled_bwd)
