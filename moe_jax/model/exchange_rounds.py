"""The ragged exchange's rows, moved to their experts' owners in rounds of a bounded receive
buffer, and never dropped (`exchange.ragged_exchange` runs the experts between the moves).

Each owner lays the rows it receives out expert by expert, then by source shard: its
*unbounded layout*, as long as the rows that happen to arrive (at worst every token of every
shard). Each round moves the rows of a window of that layout: each slice (source, local
expert) is clipped to the window on both sides, the sender sending the part inside it and the
owner placing it at the same place less the window's start, so every round's rows are again
grouped by local expert for one grouped matmul. The first window holds `moe.recv_factor`
times the average rows a shard receives; the later ones EXTRA_FRACTION of the average each,
so an overflow costs work in proportion to it, not a whole second round. The rounds run until
the fullest owner's rows are done (the same count on every device, since the rounds'
collectives meet), and the common case, a router no more unbalanced than the factor allows,
is one round.

The backward is written by hand (`exchange_in_rounds`): `while_loop` has no reverse mode, and a
loop of a static worst-case length would keep every round's residuals. The first round keeps
its residuals as an unbounded exchange would; later rounds recompute their forward in the
backward (an extra expert forward only for the rows that overflowed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.named_scopes import COMBINE, DISPATCH

# The exchange's collective; the CPU tests swap in a stand-in (XLA:CPU has none):
# tests/ragged_stand_in.py.
ragged_all_to_all = jax.lax.ragged_all_to_all

# The name scope of the rounds' loops: `moe_jax.aot.hlo` counts their FLOPs and collectives at
# ROUND_LOOP_TRIPS extra rounds (a loop of unknown trip count otherwise).
ROUND_LOOP_SCOPE = "exchange_rounds"
ROUND_LOOP_TRIPS = 0  # the common case, one round (the first runs outside the loops)

# The later rounds' windows, as a fraction of the average rows a shard receives.
EXTRA_FRACTION = 0.25

# A round's rows are a multiple of this (sublane-aligned), so factors a little apart share
# a compiled shape.
ROW_MULTIPLE = 8


class RaggedExchange(NamedTuple):
    """A round's `ragged_all_to_all` arguments (input_offsets, send_sizes, output_offsets,
    recv_sizes), flat [ep * E_loc] over (peer shard, local expert of the owner). `there`: the
    rows to the experts' owners; `back`: their results home; `sizes_e`: rows received per
    local expert in this round."""

    there: tuple[jax.Array, ...]
    back: tuple[jax.Array, ...]
    sizes_e: jax.Array


class Plan(NamedTuple):
    """Where every slice of the exchange lies, [ep, E_loc]. As a sender, over (owner,
    its local expert): `start` in my send rows, `send` rows, `land` in the owner's unbounded
    layout. As an owner, over (source, my local expert): `recv` rows, `recv_land` in my
    layout, `home` where they start in the source's send rows."""

    start: jax.Array
    send: jax.Array
    land: jax.Array
    recv: jax.Array
    recv_land: jax.Array
    home: jax.Array


def exclusive_cumsum(a: jax.Array) -> jax.Array:
    return jnp.cumsum(a) - a


def exchange_plan(send_PE: jax.Array, axis: str) -> Plan:
    """From send_PE [ep, E_loc], the rows this shard sends to peer p's local expert e, laid out
    in its send rows sorted by (global) expert p * E_loc + e. The owners' layouts are theirs
    to compute, so they send each source where its slices land (two small all_to_alls)."""
    ep, E_loc = send_PE.shape
    a2a = lambda a: jax.lax.all_to_all(a, axis, 0, 0)
    start_PE = exclusive_cumsum(send_PE.reshape(-1)).reshape(ep, E_loc)
    got = a2a(jnp.stack([send_PE, start_PE], axis=1))  # [ep, 2, E_loc] from each source
    recv_PE, home_PE = got[:, 0], got[:, 1]  # its rows for my expert e, where they start there
    land_PE = exclusive_cumsum(recv_PE.T.reshape(-1)).reshape(E_loc, ep).T  # expert-major
    out_PE = a2a(land_PE)  # where my rows land at each owner
    return Plan(start_PE, send_PE, out_PE, recv_PE, land_PE, home_PE)


def round_offsets(plan: Plan, lo, rows: int) -> RaggedExchange:
    """The exchange of the window [lo, lo + rows) of every owner's layout: every slice
    clipped to it. Slices with nothing in the window get offsets 0 (in range)."""

    def clip(land, size):  # -> (where the part in the window starts, its rows)
        a = jnp.clip(land, lo, lo + rows)
        return a, jnp.clip(land + size, lo, lo + rows) - a

    at_s, n_s = clip(plan.land, plan.send)  # my slices at their owners
    at_o, n_o = clip(plan.recv_land, plan.recv)  # the slices sent to me
    some = lambda n, offset: jnp.where(n > 0, offset, 0).reshape(-1)
    flat = lambda a: a.reshape(-1)
    skip_s, skip_o = at_s - plan.land, at_o - plan.recv_land  # rows of the slice before it
    there = (some(n_s, plan.start + skip_s), flat(n_s), some(n_s, at_s - lo), flat(n_o))
    back = (some(n_o, at_o - lo), flat(n_o), some(n_o, plan.home + skip_o), flat(n_s))
    return RaggedExchange(there, back, jnp.sum(n_o, axis=0))


def move_rows(x_nD: jax.Array, n_out: int, offsets: tuple, axis: str) -> jax.Array:
    """`ragged_all_to_all` of x's row slices into a zero [n_out, D] buffer."""
    # The collective's result is typed like its `output` operand (jax 0.10.2), so the zeros
    # vary over the axes x does: an invariant result failed the grouped backward's typing.
    out_mD = jnp.zeros((n_out, x_nD.shape[1]), x_nD.dtype)
    out_mD = jax.lax.pcast(out_mD, tuple(jax.typeof(x_nD).mat.varying), to="varying")
    return ragged_all_to_all(x_nD, out_mD, *offsets, axis_name=axis)


class Buffers(NamedTuple):
    """Rows of the first round's receive buffer and of each later one's."""

    first: int
    extra: int


def receive_rows(n_send: int, n_worst: int, factor: float) -> Buffers:
    """The receive buffers: the first `factor` times the rows a shard sends (what it receives
    on average), the later ones EXTRA_FRACTION of that, each a multiple of ROW_MULTIPLE and
    none past what can ever arrive. factor <= 0: the worst case, one round always."""
    aligned = lambda x: max(ROW_MULTIPLE, math.ceil(x / ROW_MULTIPLE) * ROW_MULTIPLE)
    first = n_worst if factor <= 0 else min(n_worst, aligned(factor * n_send))
    return Buffers(first, max(1, min(n_worst - first, aligned(EXTRA_FRACTION * n_send))))


class Rounds(NamedTuple):
    """How a step's exchange went, the same on every device: `count` rounds, and `overflow`
    rows that did not fit the first round's buffers (summed over the owners it is given)."""

    count: jax.Array
    overflow: jax.Array


def plan_rounds(plan: Plan, buffers: Buffers) -> Rounds:
    """Rounds for the fullest owner of the whole mesh: every device runs them (the rounds'
    collectives, and any gathers inside the expert computation, must meet)."""
    over = jnp.maximum(jnp.sum(plan.recv) - buffers.first, 0)
    count = 1 + (over + buffers.extra - 1) // buffers.extra
    axes = tuple(jax.typeof(count).mat.varying)
    if axes:
        count = jax.lax.pmax(count, axes)
    return Rounds(count, over)


RunRows = Callable[[jax.Array, dict, jax.Array], jax.Array]
Prep = Callable[[tuple, jax.Array], jax.Array]


def exchange_in_rounds(
    x_in: tuple,
    w: dict,
    index: jax.Array,
    plan: Plan,
    count: jax.Array,
    *,
    prep: Prep,
    run: RunRows,
    buffers: Buffers,
    axis: str,
    bounded: bool = True,
) -> jax.Array:
    """My send rows `prep(x_in, index)` each through `run(x_mD, w, sizes_e)` at its expert's
    owner, in `count` rounds of `buffers`' received rows: -> y_sD, the results at home, in my
    send rows' order. The send rows are made again from `x_in` (the layer's tokens) where a
    round needs them, not kept: k times the tokens' bytes a layer otherwise. `index`:
    integers (no gradient). `bounded` False: the first buffer holds whatever can arrive, one
    round (no loop)."""
    if not bounded:
        return _one_round(prep, run, axis, x_in, w, index, plan, 0, buffers.first)
    return _in_rounds(prep, run, buffers, axis, x_in, w, index, plan, count)


def _one_round(prep, run, axis, x_in, w, index, plan, lo, rows: int):
    """The part of the result of the window [lo, lo + rows) (its rows; zeros elsewhere)."""
    x_sD = prep(x_in, index)
    off = round_offsets(plan, lo, rows)
    with jax.named_scope(DISPATCH):
        x_mD = move_rows(x_sD, rows, off.there, axis)
    y_mD = run(x_mD, w, off.sizes_e)
    with jax.named_scope(COMBINE):
        return move_rows(y_mD, x_sD.shape[0], off.back, axis)


def _later(buffers: Buffers, r):
    """Round r >= 1's window: (its start, its rows)."""
    return buffers.first + (r - 1) * buffers.extra, buffers.extra


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _in_rounds(prep, run, buffers, axis, x_in, w, index, plan, count):
    return _in_rounds_fwd(prep, run, buffers, axis, x_in, w, index, plan, count)[0]


def _in_rounds_fwd(prep, run, buffers, axis, x_in, w, index, plan, count):
    one = functools.partial(_one_round, prep, run, axis)
    first = lambda x, w: one(x, w, index, plan, 0, buffers.first)
    y_sD, first_vjp = jax.vjp(first, x_in, w)

    def body(carry):
        r, y_sD = carry
        return r + 1, y_sD + one(x_in, w, index, plan, *_later(buffers, r))

    with jax.named_scope(ROUND_LOOP_SCOPE):
        _, y_sD = jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.int32(1), y_sD))
    return y_sD, (first_vjp, x_in, w, index, plan, count)


def _in_rounds_bwd(prep, run, buffers, axis, residuals, dy_sD):
    first_vjp, x_in, w, index, plan, count = residuals
    one = functools.partial(_one_round, prep, run, axis)

    def body(carry):  # round r's forward again, then its transpose
        r, dx_in, dw = carry
        _, vjp = jax.vjp(lambda x, w: one(x, w, index, plan, *_later(buffers, r)), x_in, w)
        ddx_in, ddw = vjp(dy_sD)
        return r + 1, jax.tree.map(jnp.add, dx_in, ddx_in), jax.tree.map(jnp.add, dw, ddw)

    dx_in, dw = first_vjp(dy_sD)
    with jax.named_scope(ROUND_LOOP_SCOPE):
        loop = jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.int32(1), dx_in, dw))
    _, dx_in, dw = loop
    return dx_in, dw, None, None, None


_in_rounds.defvjp(_in_rounds_fwd, _in_rounds_bwd)
