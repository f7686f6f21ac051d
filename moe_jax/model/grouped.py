"""Experts as one grouped matmul over rows sorted by expert (the accelerators' MoE kernel).

The CPU path (`buckets`) runs each expert on its capacity buffer's filled rows, picked
from a few static buckets by `lax.switch`: on a GPU every such conditional waits on the host,
and a TPU serialises them. Here the routed rows are sorted by expert instead, so that expert
e's rows are one contiguous group, and each projection is one grouped matmul whose groups are
those runs (`jax.lax.ragged_dot`, or megablox's Pallas kernel on TPU): no conditionals, no
padding rows computed, and the FLOPs are the routed rows' only.

    y_nD = grouped_swiglu(x_nD, w, group_sizes_E, expert_n, dtype, impl)   # rows sorted
    order_n, sizes_E = sort_rows(expert_n, keep_n, E)                         # the sort

The routing and its drops are the capacity path's (`routing.assign_slots`): a dropped assignment
is kept out of every group and reads zeros, as it reads an empty slot there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_jax import backends
from moe_jax.kernels import mosaic_gmm
from moe_jax.model.glu import SWIGLU, Activation, glu, glu_vjp
from moe_jax.model.row_buckets import SAVED_NAMES
from moe_jax.named_scopes import EXPERTS, scoped

MEGABLOX_TILE = (512, 1024, 1024)  # rows, contracted, output: MaxText's default tiling


def sort_rows(expert_n: jax.Array, keep_n: jax.Array, n_experts: int):
    """-> (order_n, group_sizes_E): rows in expert order (kept ones first, by expert, stable),
    and each expert's count of kept rows. Rows past sum(group_sizes) are the dropped ones."""
    key_n = jnp.where(keep_n, expert_n, n_experts)
    order_n = jnp.argsort(key_n, stable=True)
    sizes_E = jnp.bincount(key_n, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    return order_n, sizes_E


def inverse(order_n: jax.Array) -> jax.Array:
    """The permutation that undoes `order_n` (a scatter of indices, no second sort)."""
    n = order_n.shape[0]
    return jnp.zeros(n, order_n.dtype).at[order_n].set(jnp.arange(n, dtype=order_n.dtype))


# The rows' permutations, by gathers both ways. Autodiff turns a gather's gradient into a
# scatter-add, which XLA:GPU runs with atomics: the ~1B-active model's dropless step on an
# H200 spent 100 of its 777 busy ms in the two such scatters of every layer's backward
# (benchmarks/gpu, 2026-11-27). A permutation's transpose is a gather by its inverse.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def spread_rows(x_tD, order_s, inv_n, k: int) -> jax.Array:
    """x_tD[order_s // k]: the token row of each of the S sent assignments (`order_s`, the
    sorted assignments, token-major ids t k + j). `inv_n`: each assignment's position in the
    sort (>= S: not sent). The gradient sums each token's k assignments' rows, by gathers."""
    return x_tD[order_s // k]


def _spread_rows_fwd(x_tD, order_s, inv_n, k):
    return x_tD[order_s // k], (inv_n, order_s)


def _spread_rows_bwd(k, residuals, dy_sD):
    inv_n, order_s = residuals
    rows_nD = dy_sD.at[inv_n].get(mode="fill", fill_value=0)  # not sent: zeros
    dx_tD = jnp.sum(rows_nD.reshape(-1, k, dy_sD.shape[-1]).astype(jnp.float32), axis=1)
    return dx_tD.astype(dy_sD.dtype), None, None


spread_rows.defvjp(_spread_rows_fwd, _spread_rows_bwd)


@jax.custom_vjp
def unsort_rows(y_sD, inv_n, order_s) -> jax.Array:
    """y_sD[inv_n], positions past S reading zeros: each assignment's row back in token
    order. The gradient is the gather by `order_s` (the permutation's inverse)."""
    return y_sD.at[inv_n].get(mode="fill", fill_value=0)


def _unsort_rows_fwd(y_sD, inv_n, order_s):
    return unsort_rows(y_sD, inv_n, order_s), order_s


def _unsort_rows_bwd(order_s, dy_nD):
    return dy_nD[order_s], None, None


unsort_rows.defvjp(_unsort_rows_fwd, _unsort_rows_bwd)


def grouped_matmul(x_nK, w_EKN, sizes_E, impl: str, max_group: int | None = None) -> jax.Array:
    """Rows in groups of sizes_E (in expert order) times their expert's [K, N] weight; rows
    past the groups give zeros. The weight gradient is written by hand (`ragged_hand_grad`);
    `max_group` (static): no group has more rows. impl "mosaic": jax's Mosaic GPU kernels
    (`kernels.mosaic_gmm`) where they take the operands, XLA's ragged_dot otherwise."""
    if impl == "mosaic" and mosaic_gmm.takes(x_nK, w_EKN):
        return mosaic_gmm.grouped_matmul(x_nK, w_EKN, sizes_E)
    if impl == "megablox":
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        n, K = x_nK.shape
        N = w_EKN.shape[-1]
        tm = min(MEGABLOX_TILE[0], -(-n // 8) * 8)
        pad = -n % tm
        tiling = (tm, min(MEGABLOX_TILE[1], K), min(MEGABLOX_TILE[2], N))
        in_groups_n = jnp.arange(n) < jnp.sum(sizes_E)
        x_nK = rows_only(x_nK, in_groups_n)
        x_pad = jnp.pad(x_nK, ((0, pad), (0, 0))) if pad else x_nK
        y = gmm(x_pad, w_EKN, sizes_E, x_nK.dtype, tiling, None, None, False, backends.interpret())
        y = y[:n] if pad else y
        return jnp.where(in_groups_n[:, None], y, 0)
    return ragged_hand_grad(x_nK, w_EKN, sizes_E, max_group)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_hand_grad(x_nK, w_EKN, sizes_E, max_group: int | None) -> jax.Array:
    """`ragged_dot` with its weight gradient written by hand. Left to autodiff, that gradient
    (a ragged_dot with ragged contracting dims) compiled on TPU to a dense product over every
    expert for every row: E times the FLOPs (Qwen3-30B-A3B on v5p-128: compiled/model FLOPs
    1.89 for the whole step). Here it is the cheaper of two, both exact (`weight_grad_plan`):
    a batched matmul over the groups each padded to `max_group` rows (where a capacity makes
    that tight), or a loop over the rows' segments (`tiled_weight_grad`)."""
    return jax.lax.ragged_dot(x_nK, w_EKN, sizes_E)


def _ragged_hand_grad_fwd(x_nK, w_EKN, sizes_E, max_group):
    return jax.lax.ragged_dot(x_nK, w_EKN, sizes_E), (x_nK, w_EKN, sizes_E)


def _ragged_hand_grad_bwd(max_group, residuals, dy_nN):
    x_nK, w_EKN, sizes_E = residuals
    dx_nK = jax.lax.ragged_dot(dy_nN, jnp.swapaxes(w_EKN, 1, 2), sizes_E)
    if weight_grad_plan(x_nK.shape[0], sizes_E.shape[0], max_group) == "padded":
        dw_EKN = padded_weight_grad(x_nK, dy_nN, sizes_E, max_group)
    else:
        dw_EKN = tiled_weight_grad(x_nK, dy_nN, sizes_E)
    return dx_nK, dw_EKN.astype(w_EKN.dtype), None


ragged_hand_grad.defvjp(_ragged_hand_grad_fwd, _ragged_hand_grad_bwd)

# Rows of a `tiled_weight_grad` segment's window: megablox's row tile (MaxText's default).
WGRAD_TILE = MEGABLOX_TILE[0]


def weight_grad_plan(n: int, n_groups: int, max_group: int | None) -> str:
    """ "padded" where the groups padded to `max_group` have no more rows than the segments'
    windows (at most n / tile + groups of `tile` rows), else "tiled"."""
    tile = min(WGRAD_TILE, n)
    tiled_rows = (-(-n // tile) + n_groups + 1) * tile
    return "padded" if max_group is not None and n_groups * max_group <= tiled_rows else "tiled"


def padded_weight_grad(x_nK, dy_nN, sizes_E, max_group: int) -> jax.Array:
    """dW_e = x_e^T dy_e as one batched matmul over the groups, each padded to max_group rows."""
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    rows_ER = starts_E[:, None] + jnp.arange(max_group)[None, :]
    in_group_ER = jnp.arange(max_group)[None, :] < sizes_E[:, None]
    rows_ER = jnp.where(in_group_ER, rows_ER, x_nK.shape[0])  # past the end: reads zeros
    x_ERK = x_nK.at[rows_ER].get(mode="fill", fill_value=0)
    dy_ERN = dy_nN.at[rows_ER].get(mode="fill", fill_value=0)
    return jnp.einsum("erk,ern->ekn", x_ERK, dy_ERN, preferred_element_type=jnp.float32)


def tiled_weight_grad(x_nK, dy_nN, sizes_E) -> jax.Array:
    """dW_e = x_e^T dy_e (float32) as a loop over *segments*: the rows cut at every tile
    boundary and every group boundary, so each segment lies in one tile and one group (at
    most n / tile + E + 1 of them); each adds the product of its `tile`-row window, masked to
    its rows, to its group's gradient. The FLOPs are those of (n + E tile) rows, whatever
    the groups' sizes, and nothing of the rows' size is materialised."""
    n, K = x_nK.shape
    E, N = sizes_E.shape[0], dy_nN.shape[1]
    tile = min(WGRAD_TILE, n)
    ends_E = jnp.cumsum(sizes_E)
    # cut at every tile and group start, and where the groups end (the rows past them)
    cuts_S = jnp.sort(jnp.concatenate([jnp.arange(0, n, tile), ends_E - sizes_E, ends_E[-1:]]))
    next_S = jnp.minimum(jnp.concatenate([cuts_S[1:], jnp.array([n])]), n)
    # a segment's group: the first whose rows end past its start (E: past every group)
    group_S = jnp.searchsorted(ends_E, cuts_S, side="right")
    rows_t = jnp.arange(tile)

    def add_segment(dw_EKN, seg):
        start, stop, group = seg
        at = jnp.minimum(start, n - tile)  # the window stays inside the rows
        mine_t = (at + rows_t >= start) & (at + rows_t < stop)
        x_tK = jax.lax.dynamic_slice_in_dim(x_nK, at, tile)
        dy_tN = jnp.where(mine_t[:, None], jax.lax.dynamic_slice_in_dim(dy_nN, at, tile), 0)
        prod_KN = jnp.einsum("tk,tn->kn", x_tK, dy_tN, preferred_element_type=jnp.float32)
        return dw_EKN.at[group].add(prod_KN, mode="drop"), None  # group E: dropped

    dw_EKN = jnp.zeros((E, K, N), jnp.float32)
    # Inside a shard_map the carry must vary over the axes the products do.
    varying = tuple(jax.typeof(x_nK).mat.varying | jax.typeof(dy_nN).mat.varying)
    if varying:
        dw_EKN = jax.lax.pcast(dw_EKN, varying, to="varying")
    return jax.lax.scan(add_segment, dw_EKN, (cuts_S, next_S, group_S))[0]


@jax.custom_vjp
def rows_only(x_nK, keep_n):
    """x with the rows not kept zeroed, and their cotangent too. The megablox kernels leave
    the rows past the groups unwritten, in their output and in the input's gradient; zeroing
    the output (a `where`) does not reach that gradient, which held garbage (NaN when
    interpreted)."""
    return jnp.where(keep_n[:, None], x_nK, 0)


def _rows_only_fwd(x_nK, keep_n):
    return rows_only(x_nK, keep_n), keep_n


def _rows_only_bwd(keep_n, dx_nK):
    return jnp.where(keep_n[:, None], dx_nK, 0), None


rows_only.defvjp(_rows_only_fwd, _rows_only_bwd)


@scoped(EXPERTS)
def grouped_swiglu(
    x_nD,
    w: dict,
    sizes_E,
    expert_n,
    dtype,
    impl: str,
    max_group: int | None = None,
    row_chunks: int = 1,
    whole=None,
    act: Activation = SWIGLU,
) -> jax.Array:
    """SwiGLU of rows sorted by expert, without the down-projection bias (added by the caller
    after any tensor-parallel sum, like `experts.swiglu_rows`). `expert_n`: each row's expert,
    for the biases. The backward is written by hand (`_swiglu_sorted`). `row_chunks` > 1
    runs the rows in that many windows, one after the other (`_swiglu_chunked`).

    `whole`: None, or `w` is still split (fsdp) and `whole(w)` gathers it (a dict of the
    same names, in the experts' order). Windows cut by experts then gather their own experts'
    weights only, forward and again backward, their gradients reduce-scattered window by
    window: one window's experts are gathered at a time instead of every expert's."""
    w = {n: a.astype(dtype) for n, a in w.items()}
    x_nD = checkpoint_name(x_nD.astype(dtype), "expert_in")  # for remat policies (remat.py)
    if row_chunks > 1 and x_nD.shape[0] >= 2 * row_chunks:
        plan = chunk_plan(x_nD.shape[0], sizes_E.shape[0], row_chunks, max_group)
        if whole is not None and plan.experts == sizes_E.shape[0]:  # by rows: all at once
            w, whole = whole(w), None
        return _swiglu_chunked(x_nD, w, sizes_E, expert_n, impl, max_group, row_chunks, act, whole)
    if whole is not None:
        w = whole(w)
    return _swiglu_sorted(x_nD, w, sizes_E, expert_n, impl, max_group, act)


def _projections(x_nD, w, sizes_E, expert_n, impl):
    gate_nF = grouped_matmul(x_nD, w["w_gate"], sizes_E, impl)
    up_nF = grouped_matmul(x_nD, w["w_up"], sizes_E, impl)
    if "gate_bias" in w:
        gate_nF = gate_nF + w["gate_bias"][expert_n]
        up_nF = up_nF + w["up_bias"][expert_n]
    return gate_nF, up_nF


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _swiglu_sorted(x_nD, w, sizes_E, expert_n, impl, max_group, act):
    """The grouped SwiGLU with a hand-written backward that keeps only the rows and the
    gate/up products (by `buckets`' checkpoint names, so `model.remat=dots` keeps the
    same ones on both paths) and recomputes the rest: left to autodiff, every layer also kept
    silu(gate) * up and the sigmoid, [rows, F] each (Qwen3-30B-A3B on v5p-128: ~5 GiB a step)."""
    return _swiglu_sorted_fwd(x_nD, w, sizes_E, expert_n, impl, max_group, act)[0]


def _swiglu_sorted_fwd(x_nD, w, sizes_E, expert_n, impl, max_group, act):
    gate_nF, up_nF = _projections(x_nD, w, sizes_E, expert_n, impl)
    gate_nF, up_nF = checkpoint_name((gate_nF, up_nF), SAVED_NAMES[1])
    y_nD = grouped_matmul(glu(gate_nF, up_nF, act), w["w_down"], sizes_E, impl)
    y_nD = checkpoint_name(y_nD, SAVED_NAMES[0])
    return y_nD, (x_nD, w, sizes_E, expert_n, gate_nF, up_nF)


def _swiglu_sorted_bwd(impl, max_group, act, residuals, dy_nD):
    x_nD, w, sizes_E, expert_n, gate_nF, up_nF = residuals

    def matmul_vjp(a_nK, w_EKN, dout_nN):  # each kernel's own transposes (and max_group's)
        mm = lambda a, b: grouped_matmul(a, b, sizes_E, impl, max_group)
        return jax.vjp(mm, a_nK, w_EKN)[1](dout_nN)

    h_nF = glu(gate_nF, up_nF, act)
    dh_nF, dw_down = matmul_vjp(h_nF, w["w_down"], dy_nD)
    _, dgate_nF, dup_nF = glu_vjp(gate_nF, up_nF, dh_nF, act)
    dx_gate, dw_gate = matmul_vjp(x_nD, w["w_gate"], dgate_nF)
    dx_up, dw_up = matmul_vjp(x_nD, w["w_up"], dup_nF)
    dw = {"w_gate": dw_gate, "w_up": dw_up, "w_down": dw_down}
    if "gate_bias" in w:
        by_expert = lambda d_nF: jnp.zeros(w["gate_bias"].shape, d_nF.dtype).at[expert_n].add(d_nF)
        dw["gate_bias"], dw["up_bias"] = by_expert(dgate_nF), by_expert(dup_nF)
    return dx_gate + dx_up, dw, None, None


_swiglu_sorted.defvjp(_swiglu_sorted_fwd, _swiglu_sorted_bwd)


class Chunks(NamedTuple):
    """How `_swiglu_chunked` cuts the sorted rows: `count` windows of `rows` rows, each
    running `experts` consecutive experts (every expert when cut by rows)."""

    count: int
    rows: int
    experts: int


def chunk_plan(n: int, n_experts: int, n_chunks: int, max_group: int | None) -> Chunks:
    """By experts where a capacity bounds each expert's rows (`max_group`) and the experts
    split evenly into the chunks: chunk c runs experts [c e, (c + 1) e) on a window of e
    max_group rows, each expert's rows and weight gradient in one chunk only. Otherwise by
    rows: chunk c is rows [c R, (c + 1) R) through every expert, a group cut at a boundary
    running as two, each chunk's weight gradient covering every expert; also where a window
    of e max_group rows would hold every row (dropless), which would not cut at all."""
    e = n_experts // n_chunks
    if max_group is not None and n_experts % n_chunks == 0 and e * max_group < n:
        return Chunks(n_chunks, e * max_group, e)
    return Chunks(n_chunks, -(-n // n_chunks), n_experts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _swiglu_chunked(x_nD, w, sizes_E, expert_n, impl, max_group, n_chunks, act, whole):
    """`_swiglu_sorted` over `n_chunks` windows of the sorted rows, one after the other,
    forward and backward (`chunk_plan`): the [rows, F] intermediates (gate, up, their product
    and gradients: 3.3 GiB each for Mixtral's 122,880 received rows a chip at 12 x 4096
    tokens) exist for one window at a time. The backward recomputes each window's gate/up
    products (two grouped matmuls more) and keeps only the rows, so the checkpoint names
    `expert_gate_up` / `expert_out` have nothing to keep here (the config refuses them).
    Outputs and gradients are summed over the windows (rows past a window's groups add
    zeros), in the compute dtype. `whole`: see `grouped_swiglu` (by experts only)."""
    args = (x_nD, w, sizes_E, expert_n, impl, max_group, n_chunks, act, whole)
    return _swiglu_chunked_fwd(*args)[0]


def _window(plan: Chunks, c, x_pD, w, sizes_E, expert_p, max_group):
    """Chunk c's first row, rows, weights (its experts', as split as `w`), group sizes in its
    window, rows' experts (local to the chunk, for the biases) and its weight-gradient
    bound."""
    ends_E = jnp.cumsum(sizes_E)
    starts_E = ends_E - sizes_E
    R, e = plan.rows, plan.experts
    if e == sizes_E.shape[0]:  # by rows: every expert, the groups clipped to the window
        lo = c * R
        sizes_cE = jnp.clip(ends_E, lo, lo + R) - jnp.clip(starts_E, lo, lo + R)
        w_c, expert_c = w, jax.lax.dynamic_slice_in_dim(expert_p, lo, R)
    else:  # by experts: experts [c e, (c + 1) e), whose rows start the window
        first = c * e
        lo = starts_E[first]
        sizes_cE = jax.lax.dynamic_slice_in_dim(sizes_E, first, e)
        w_c = {n: jax.lax.dynamic_slice_in_dim(a, first, e) for n, a in w.items()}
        local = jax.lax.dynamic_slice_in_dim(expert_p, lo, R) - first
        expert_c = jnp.clip(local, 0, e - 1)  # rows past the groups: any, they give zeros
    group_max = None if max_group is None else min(max_group, R)
    x_cD = jax.lax.dynamic_slice_in_dim(x_pD, lo, R)
    return lo, x_cD, w_c, sizes_cE.astype(sizes_E.dtype), expert_c, group_max


def _add_at(acc, lo, part, axis=0):
    """acc with `part` added at `lo` along `axis`."""
    here = jax.lax.dynamic_slice_in_dim(acc, lo, part.shape[axis], axis)
    return jax.lax.dynamic_update_slice_in_dim(acc, here + part, lo, axis)


def _padded(plan: Chunks, n, by_rows: bool, *arrays):
    """The arrays with rows appended so that every window lies inside (no clamped slice).
    Windows by rows end at count x rows, so rows that divide evenly need no copy: a padded
    copy of the rows and of their gradient, [n + rows, D] each, was DeepSeek-V3's largest
    buffer pair in the backward (7.9 GB each for 491,520 received rows a chip at 6 x 8192
    tokens, v5p). Windows by experts start anywhere: n + rows."""
    end = plan.count * plan.rows if by_rows else max(plan.count * plan.rows, n + plan.rows)
    if end == n:
        return list(arrays)
    return [jnp.pad(a, ((0, end - n),) + ((0, 0),) * (a.ndim - 1)) for a in arrays]


def _swiglu_chunked_fwd(x_nD, w, sizes_E, expert_n, impl, max_group, n_chunks, act, whole):
    n, D = x_nD.shape
    plan = chunk_plan(n, sizes_E.shape[0], n_chunks, max_group)
    x_pD, expert_p = _padded(plan, n, plan.experts == sizes_E.shape[0], x_nD, expert_n)
    whole = whole or (lambda w: w)

    def one(y_pD, c):
        lo, x_cD, w_c, sizes_cE, expert_c, group_max = _window(
            plan, c, x_pD, w, sizes_E, expert_p, max_group
        )
        y_cD = _swiglu_sorted_fwd(x_cD, whole(w_c), sizes_cE, expert_c, impl, group_max, act)[0]
        return _add_at(y_pD, lo, y_cD), None

    y_pD, _ = jax.lax.scan(one, jnp.zeros_like(x_pD), jnp.arange(plan.count))
    return y_pD[:n], (x_nD, w, sizes_E, expert_n)


def _swiglu_chunked_bwd(impl, max_group, n_chunks, act, whole, residuals, dy_nD):
    x_nD, w, sizes_E, expert_n = residuals
    n, D = x_nD.shape
    plan = chunk_plan(n, sizes_E.shape[0], n_chunks, max_group)
    by_rows = plan.experts == sizes_E.shape[0]
    x_pD, expert_p, dy_pD = _padded(plan, n, by_rows, x_nD, expert_n, dy_nD)
    whole = whole or (lambda w: w)

    def one(carry, c):
        dx_pD, dw = carry
        lo, x_cD, w_c, sizes_cE, expert_c, group_max = _window(
            plan, c, x_pD, w, sizes_E, expert_p, max_group
        )
        dy_cD = jax.lax.dynamic_slice_in_dim(dy_pD, lo, plan.rows)
        # gathered again, and the gradient split back: the gather's transpose
        w_c, split_back = jax.vjp(whole, w_c)
        _, res = _swiglu_sorted_fwd(x_cD, w_c, sizes_cE, expert_c, impl, group_max, act)
        dx_cD, dw_c, _, _ = _swiglu_sorted_bwd(impl, group_max, act, res, dy_cD)
        (dw_c,) = split_back(dw_c)
        first = 0 if plan.experts == sizes_E.shape[0] else c * plan.experts
        dw = {k: _add_at(dw[k], first, dw_c[k]) for k in dw}
        return (_add_at(dx_pD, lo, dx_cD), dw), None

    zeros = (jnp.zeros_like(x_pD), jax.tree.map(jnp.zeros_like, w))
    (dx_pD, dw), _ = jax.lax.scan(one, zeros, jnp.arange(plan.count))
    return dx_pD[:n], dw, None, None


_swiglu_chunked.defvjp(_swiglu_chunked_fwd, _swiglu_chunked_bwd)


def grouped_buffers(
    x_ESCD, w: dict, dtype, filled_ES, impl: str, row_chunks=1, act: Activation = SWIGLU
) -> jax.Array:
    """`experts.expert_swiglu`'s computation on capacity buffers (E experts x S segments x C
    slots, each segment filled from the front) as one grouped matmul over the filled rows
    only: the rows are compacted by expert, run, and put back (empty slots give zeros).
    Without the down bias and any tensor-parallel sum, like `grouped_swiglu` (`row_chunks`:
    its windows)."""
    E, S, C, D = x_ESCD.shape
    expert_n = jnp.repeat(jnp.arange(E), S * C)
    filled_n = (jnp.arange(C)[None, None, :] < filled_ES[:, :, None]).reshape(-1)
    order_n, sizes_E = sort_rows(expert_n, filled_n, E)
    x_nD = x_ESCD.reshape(E * S * C, D)[order_n]
    y_nD = grouped_swiglu(
        x_nD, w, sizes_E, expert_n[order_n], dtype, impl, S * C, row_chunks, act=act
    )
    return y_nD[inverse(order_n)].reshape(E, S, C, D)
