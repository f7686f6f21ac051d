"""A stand-in for `jax.lax.ragged_all_to_all` on XLA:CPU, which has no ragged-all-to-all
("not supported by XLA:CPU ThunkEmitter"): every test of the ragged exchange and of the
dropless rounds runs on it (the `ragged_on_cpu` fixture), so it implements the operation's
whole documented semantics (jax's docstring; XLA's RaggedAllToAll), and is strict where the
hardware's result is undefined.

For sender s, slice i (of K = ep * per; slice i goes to shard i // per) is
operand_s[input_offsets_s[i] : + send_sizes_s[i]]; receiver r writes the slice that sender s
sent as its slice r * per + j at output_offsets_s[r * per + j] of its own output, recv_sizes_r[s
* per + j] rows; every other row of r's result is r's `output` operand unchanged.

Undefined on hardware, poisoned here (every element of every shard's result NaN, or an
integer dtype's minimum), so that no test passes by the stand-in's leniency: a receive size
that is not the matching send size (the docstring's `send_sizes == all_to_all(recv_sizes)`),
a negative size or offset, a slice past its operand or output, and two slices writing the
same output row.

The gradient is jax's transpose rule for the primitive (`_ragged_all_to_all_transpose`, jax
0.10.2) with this stand-in as the collective: the operand's cotangent comes back by a second
exchange, the output's is the incoming one with the written rows zeroed. That backward writes
each received cotangent slice over the sender's input slice, so it is undefined too (poisoned)
where a sender's input slices overlap: a forward that reads a row twice cannot be
differentiated by the real collective, and a gradient derived here by autodiff would hide it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _receive(a, axis_name):
    """all_to_all(a, tiled), as the docstring writes it: [s * per + j] is what sender s says
    of its slice to me. (By all_gather: the tests count the layer's all_to_alls.)"""
    per = a.shape[0] // jax.lax.axis_size(axis_name)
    every_ek = jax.lax.all_gather(a, axis_name)
    me = jax.lax.axis_index(axis_name)
    return jax.lax.dynamic_slice_in_dim(every_ek, me * per, per, axis=1).reshape(-1)


def _poison(dtype):
    return jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min


def _check_args(operand, output, offsets, axis_name):
    ep = jax.lax.axis_size(axis_name)
    K = offsets[0].shape[0]
    if any(a.shape != (K,) for a in offsets) or K % ep:
        raise ValueError(f"offsets and sizes: 4 x [K] with K a multiple of {ep}")
    if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        raise ValueError(f"operand {operand.shape} {operand.dtype}, output {output.shape}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _stand_in(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """The result, poisoned on every shard where any shard's call is undefined."""
    N, M = operand.shape[0], output.shape[0]
    start_k = _receive(input_offsets, axis_name)  # where each of my slices starts at its sender
    sent_k = _receive(send_sizes, axis_name)  # how many rows its sender sends
    at_k = _receive(output_offsets, axis_name)  # where it goes in my output
    size_k = recv_sizes
    per = size_k.shape[0] // jax.lax.axis_size(axis_name)
    rows_m = jnp.arange(M)
    covers_km = (rows_m >= at_k[:, None]) & (rows_m < (at_k + size_k)[:, None])
    bad = (
        jnp.any(sent_k != size_k)
        | jnp.any((size_k < 0) | (start_k < 0) | (at_k < 0))
        | jnp.any((start_k + sent_k > N) | (at_k + size_k > M))
        | jnp.any(jnp.sum(covers_km, axis=0) > 1)
    )
    # Each written row's source: slice k (sender k // per), row start + (m - at) there.
    k_m = jnp.argmax(covers_km, axis=0)
    src_row_m = jnp.clip(start_k[k_m] + rows_m - at_k[k_m], 0, N - 1)
    every_operand = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
    got = every_operand[k_m // per, src_row_m]
    written = jnp.any(covers_km, axis=0).reshape(M, *(1,) * (output.ndim - 1))
    bad = jax.lax.pmax(bad.astype(jnp.int32), axis_name)
    result = jnp.where(written, got, output)
    return jnp.where(bad > 0, jnp.full_like(output, _poison(output.dtype)), result)


def _stand_in_fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    out = _stand_in(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)
    return out, (operand, input_offsets, send_sizes, output_offsets, recv_sizes)


def _stand_in_bwd(axis_name, residuals, t):
    """jax's transpose rule, run on the stand-in (see the module's docstring)."""
    operand, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
    at_k = _receive(output_offsets, axis_name)
    home_k = _receive(input_offsets, axis_name)
    back = (at_k, recv_sizes, home_k, send_sizes)
    operand_t = _stand_in(t, jnp.zeros_like(operand), *back, axis_name)
    # jax 0.10.2's mask, as it is: an empty slice whose offset is another slice's start
    # cancels that start, so the written rows keep their cotangent (our callers' `output` is
    # a constant; its cotangent is discarded).
    mask = jnp.zeros(t.shape[0], jnp.int32).at[at_k].set(1).at[at_k + recv_sizes].add(-1)
    mask = jnp.cumsum(mask).reshape(-1, *(1,) * (t.ndim - 1))
    output_t = jnp.where(mask != 0, jnp.zeros_like(t), t)
    return operand_t, output_t, None, None, None, None


_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` over `axis_name` (one axis, no axis_index_groups) inside
    `jax.shard_map`, on any backend: the module's docstring."""
    offsets = (input_offsets, send_sizes, output_offsets, recv_sizes)
    _check_args(operand, output, offsets, axis_name)
    return _stand_in(operand, output, *offsets, axis_name)
