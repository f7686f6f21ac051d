"""Expert parallelism: the MoE layer inside `jax.shard_map` over the mesh, tokens moving to
their experts' owners and back; expert weights never move (semantics: `moe.py`'s docstring).

Each batch shard routes its own tokens (one routing group), then one of three paths:
- `buffer_exchange`: the fixed [E, C] capacity buffers by `all_to_all` (CPU; small exchanges);
- `ragged_exchange`: only the kept assignments' rows, by `ragged_all_to_all`, run as one
  grouped matmul at the owner (moe.impl=ragged on GPU / TPU, `backends.exchange`);
- `own_experts`: a batch the batch axes do not split (decoding one sequence): every device
  routes all the tokens through its own experts and the partial outputs are summed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.config import MoEConfig
from moe_jax.model import exchange_rounds as rounds_lib
from moe_jax.model import experts as experts_lib
from moe_jax.model import weight_gather
from moe_jax.model.experts import down_bias, expert_swiglu, filled_slots, picked_swiglu
from moe_jax.model.glu import Activation
from moe_jax.model.grouped import grouped_swiglu, inverse, sort_rows, spread_rows, unsort_rows
from moe_jax.model.routing import (
    Routing,
    from_buffers,
    route_group,
    scale_inputs,
    sum_choices,
    to_buffers,
)
from moe_jax.named_scopes import COMBINE, DISPATCH, scoped
from moe_jax.sharding import seq_axis, split_batch_axes


class Axes(NamedTuple):
    """The mesh as the expert-parallel map sees it. Experts split over `expert`, the hidden
    dim over `tensor`; each named (ex, tp, fs) only when > 1, so replication stays inferable.
    `batch_axes`: the axes that split the tokens' rows (none when `replicated`); `seq`: the
    axis that splits their sequence (`context`, or None): a context shard's tokens route
    as one more group, the exchange taking them as more rows. `data_axes`: the token axes
    over which the weights are the same (replicated), their gradient summed over them."""

    ep: int
    ex: str | None
    tp: str | None
    fs: str | None
    batch_axes: tuple
    data_axes: tuple
    replicated: bool
    seq: str | None = None

    @property
    def token_axes(self) -> tuple:
        """Every axis that splits the tokens: the statistics are summed over these."""
        return self.batch_axes + ((self.seq,) if self.seq else ())


def mesh_axes(mesh, replicated: bool, T: int = 1) -> Axes:
    """`T`: the tokens' sequence length, split over `context` where that divides it."""
    ep = mesh.shape["expert"]
    seq = None if replicated else seq_axis(mesh, T)
    # Only axes that split the batch are named. A size-1 axis named in the batch spec would
    # still make JAX sum the weights' gradient over it, and XLA:CPU runs that one-device
    # all-reduce as a full copy of each layer's expert gradients (0.1 s a step at medium
    # with 32 experts).
    return Axes(
        ep=ep,
        ex="expert" if ep > 1 else None,
        tp="tensor" if mesh.shape["tensor"] > 1 else None,
        fs="fsdp" if mesh.shape["fsdp"] > 1 else None,
        batch_axes=() if replicated else split_batch_axes(mesh),
        data_axes=(("data",) if mesh.shape["data"] > 1 and not replicated else ())
        + ((seq,) if seq else ()),
        replicated=replicated,
        seq=seq,
    )


def expert_specs(ax: Axes) -> dict:
    """name -> (its spec into the map, its dim split over fsdp or None). The weights come in
    as stored, their minor dim split over `fsdp` too, and are gathered inside, in the compute
    dtype: the gather's transpose then sends each fsdp shard's gradient out as one
    reduce-scatter, where a gather outside the map left an all-reduce of the whole fp32
    gradient, sliced afterwards."""
    ex, tp, fs = ax.ex, ax.tp, ax.fs
    tp_fs = tuple(a for a in (tp, fs) if a) or None
    return {
        "w_gate": (P(ex, None, tp_fs), 2),
        "w_up": (P(ex, None, tp_fs), 2),
        "w_down": (P(ex, tp, fs), 2),
        "gate_bias": (P(ex, tp), None),
        "up_bias": (P(ex, tp), None),
        "down_bias": (P(ex, fs), 1),
    }


def expert_parallel(
    x_BTD,
    valid_BT,
    replay_BTK=None,
    *,
    weights: dict,
    router: dict,
    cfg: MoEConfig,
    dtype,
    impl: str,
    mesh,
    replicated: bool,
) -> tuple[jax.Array, dict]:
    """The MoE layer over `mesh`: -> (y_BTD, the statistic sums over all tokens, the
    experts every token took [B, T, K]). `router`: route_group's router arguments by name,
    the same on every device. `replay_BTK`: recorded experts to reuse (`routing.route`).
    `replicated`: a batch the batch axes do not split (see `own_experts`)."""
    ax = mesh_axes(mesh, replicated, x_BTD.shape[1])
    specs = expert_specs(ax)
    step = functools.partial(
        _shard_step,
        cfg=cfg,
        dtype=dtype,
        impl=impl,
        ax=ax,
        specs=specs,
        fs_plan=weight_gather.steps((ax.fs,), mesh) if ax.fs else (),  # mesh.gather_group's steps
        ragged=backends.exchange(impl, cfg.exchange) == "ragged",
    )
    x_spec = P(ax.batch_axes or None, ax.seq, None)
    # the optional per-token inputs, split like the tokens
    rows = {k: a for k, a in (("valid_bT", valid_BT), ("replay_bTK", replay_BTK)) if a is not None}
    row_spec = lambda a: P(ax.batch_axes or None, ax.seq, *(None,) * (a.ndim - 2))
    row_specs = {k: row_spec(a) for k, a in rows.items()}
    return jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(x_spec, {n: P() for n in router}, {n: specs[n][0] for n in weights})
        + (row_specs,),
        out_specs=(x_spec, P(), x_spec),
    )(x_BTD, router, weights, rows)


def _gathered_weight(a, name, *, specs, ax: Axes, fs_plan, dtype, window=False):
    """In the compute dtype, the model dim whole again: varying over fsdp then."""
    a, axis = a.astype(dtype), specs[name][1]
    if ax.fs is None or axis is None:
        return a
    # Replicated tokens make every fsdp shard's output the same: gathered invariant (in one
    # step: a group's gather alone varies over the axis).
    if ax.replicated:
        return jax.lax.all_gather(a, ax.fs, axis=axis, tiled=True, to="invarying")
    if window:
        # On v5p-128 at fsdp 64 libtpu turned the last reduce-scatter of a window's gradient,
        # along its minor dim (to a 224-wide shard), into an all-reduce. (The whole layer's
        # weights, gathered on a leading axis, went the other way round: benchmarks/results/aot.md.)
        return weight_gather.gather_leading(a, fs_plan, axis)
    return weight_gather.gather(a, fs_plan, axis)


def _shard_step(x_bTD, router, w, rows, *, cfg, dtype, impl, ax, specs, fs_plan, ragged):
    """One shard's part: route its tokens, gather its expert weights, run a path.
    `rows`: valid_bT and replay_bTK where given. -> (y_bTD, sums, experts_bTK)."""
    E_loc = cfg.n_experts // ax.ep
    r = route_group(x_bTD, **router, cfg=cfg, dtype=dtype, **rows)
    # Small exchanges (decoding) keep the buffers, whose experts then run as batched matmuls
    # over every slot (see expert_swiglu), as the ragged impl's own do.
    exchange = ragged and not ax.replicated and ax.ep * r.cap >= experts_lib.MAP_MIN_CAPACITY
    # Row windows cut by experts gather their own experts' weights, one window at a time
    # (grouped.grouped_swiglu's `whole`); everything else is gathered here.
    # (grouped.chunk_plan's cut: by experts where a capacity bounds each expert's rows;
    # dropless, by rows, every window through every local expert, gathered once up front)
    by_experts = cfg.row_chunks > 1 and E_loc % cfg.row_chunks == 0 and cfg.capacity_factor > 0
    later = ("w_gate", "w_up", "w_down") if exchange and ax.fs and by_experts else ()
    gathered = functools.partial(_gathered_weight, specs=specs, ax=ax, fs_plan=fs_plan, dtype=dtype)
    # The gathered weights vary over fsdp (the gather's transpose is the reduce-scatter); over
    # `data`, and the biases without a model dim over fsdp too, they are the same on every
    # shard, and their gradient is summed over those axes where they turn varying. Done here,
    # that is one collective per weight, not one per expert inside the expert map's backward.
    w = {n: a.astype(dtype) if n in later else gathered(a, n) for n, a in w.items()}
    for n, a in w.items():
        no_fs_dim = ax.fs and specs[n][1] is None and not ax.replicated
        same = ax.data_axes + ((ax.fs,) if no_fs_dim else ())
        if same:
            w[n] = jax.lax.pcast(a, same, to="varying")
    run = dict(cfg=cfg, dtype=dtype, impl=impl, ep=ax.ep, tp=ax.tp)
    if ax.replicated:
        return own_experts(x_bTD, w, r, **run), r.sums, r.experts
    b, T, K = r.experts.shape
    exchanged = {}
    if ax.ep == 1 and b * T * K < cfg.n_experts:
        # Every expert is here and few tokens (decoding a batch the batch axes split, or one
        # device's mesh): only the picked experts' weights are read (`own_experts`). The
        # buffers read all of them: gpt-oss-20b's batch-1 decode on one H100 held a float32
        # product of every expert weight a layer, 36 GiB of temporaries (AOT, 2026-11-26).
        y_bTD = own_experts(x_bTD, w, r, **run)
    else:
        # The tensor shards' partial sums travel home unsummed and are added after the
        # combine, on [b, T, D] rather than the expert rows (E C / (b T) times fewer bytes
        # with buffers: 2.5 at capacity 1.25 top-2, E when dropless).
        if exchange:
            whole = None
            if later:
                whole = lambda w: {
                    n: gathered(a, n, window=True) if n in later else a for n, a in w.items()
                }
            y_bTD, exchanged = chunked_exchange(x_bTD, w, r, **run, whole=whole)
        else:
            y_bTD = buffer_exchange(x_bTD, w, r, **run)
        if ax.tp is not None:
            y_bTD = jax.lax.psum(y_bTD, ax.tp)
    # "rounds" is the same everywhere already; "overflow" sums over the owners.
    sums = r.sums | {k: v for k, v in exchanged.items() if k == "overflow"}
    sums = jax.lax.psum(sums, ax.token_axes) if ax.token_axes else sums
    return y_bTD, sums | {k: v for k, v in exchanged.items() if k == "rounds"}, r.experts


def buffer_exchange(x_bTD, w: dict, r: Routing, *, cfg: MoEConfig, dtype, impl, ep, tp):
    """The [E * C, D] buffers of all experts, each expert's slots (and how many are filled)
    sent to the shard that owns it by `all_to_all`, run there, and sent back. The output is
    unsummed over `tensor`."""
    E, D = cfg.n_experts, x_bTD.shape[-1]
    E_loc = E // ep
    to_owner = (lambda a: jax.lax.all_to_all(a, "expert", 0, 0)) if ep > 1 else (lambda a: a)
    buf = to_buffers(x_bTD, r, E, cfg.route_scale)
    with jax.named_scope(DISPATCH):  # [ep, E_loc, ...] -> by source shard
        buf = to_owner(buf.reshape(ep, E_loc, r.cap, D))
        filled = to_owner(filled_slots(r.slot, E, r.cap).reshape(ep, E_loc))
    y_eSCD = expert_swiglu(
        buf.transpose(1, 0, 2, 3),
        w,
        dtype,
        filled_ES=filled.T,
        reduce_axis=tp,
        sum_partials=False,
        impl=impl,
        row_chunks=cfg.row_chunks,
        act=Activation.from_config(cfg),
    )
    with jax.named_scope(COMBINE):  # back home
        y = to_owner(y_eSCD.transpose(1, 0, 2, 3)).reshape(E * r.cap, D)
    return from_buffers(y, r.slot, r.weights, cfg.route_scale)


def chunked_exchange(x_bTD, w, r: Routing, *, cfg: MoEConfig, **run) -> tuple[jax.Array, dict]:
    """`ragged_exchange` of this shard's tokens in moe.row_chunks consecutive slices, one
    after the other (a scan), when dropless: every buffer of k x the tokens' rows (the sent
    rows, the received ones, their gradients) then exists for one slice at a time. Each
    slice is checkpointed: the backward keeps its tokens only and runs its exchange and
    experts' forward again (one more expert forward and two more exchanges a layer), where
    the scan's stacked residuals were every slice's rows. Each slice's received rows are cut
    in row_chunks windows again (`grouped_swiglu`). The routing is the shard's, made before
    (a capacity's drops decide over all its tokens: that exchange is not sliced).
    DeepSeek-V3 at 6 x 8192 tokens a chip (v5p, expert 8): the MoE backward's [491,520,
    7168] received rows, their gradient and copies were its largest buffers, 7 GB each."""
    b, T, K = r.experts.shape
    n, c = b * T, cfg.row_chunks
    if c <= 1 or n % c or cfg.capacity_factor > 0:
        return ragged_exchange(x_bTD, w, r, cfg=cfg, **run)
    cut = lambda a: a.reshape(c, n // c, 1, *a.shape[2:])  # slice i: rows [1, T'] of tokens

    @jax.checkpoint  # in a scan: no CSE to prevent
    def slice_out(w, xs):
        x, weights, experts, slot, keep = xs
        r_i = Routing(weights, experts, slot, keep, r.cap, {})
        return ragged_exchange(x, w, r_i, cfg=cfg, **run)

    one = lambda _, xs: (None, slice_out(w, xs))

    xs = (cut(x_bTD), cut(r.weights), cut(r.experts), cut(r.slot), cut(r.keep))
    _, (y, stats) = jax.lax.scan(one, None, xs)
    stats = {"rounds": jnp.max(stats["rounds"]), "overflow": jnp.sum(stats["overflow"])}
    return y.reshape(b, T, x_bTD.shape[-1]), stats


def ragged_exchange(
    x_bTD, w, r: Routing, *, cfg: MoEConfig, dtype, impl, ep, tp, whole=None
) -> tuple[jax.Array, dict]:
    """This shard's kept assignments, sorted by expert, sent as rows (no padding) to the
    shards owning their experts, run there as one grouped matmul and sent back
    (`ragged_all_to_all` both ways, in rounds of a bounded receive buffer:
    `exchange_rounds.py`). -> (the output, unsummed over `tensor` like the buffers', and the
    exchange's statistics: "rounds", and "overflow" rows past the first round, summed here
    over this owner). `whole`: the expert weights come split over fsdp, gathered by the
    grouped matmul (`grouped_swiglu`)."""
    E, D = cfg.n_experts, x_bTD.shape[-1]
    E_loc = E // ep
    b, T, K = r.experts.shape
    with jax.named_scope(DISPATCH):
        order_n, sizes_E = sort_rows(r.experts.reshape(-1), r.keep.reshape(-1), E)
    # The kept rows (the rest are past them in `order_n`): at most every assignment, and
    # with a capacity at most C per expert.
    n_send = min(b * T * K, E * r.cap)
    sent_s = order_n[:n_send]
    x_in = (x_bTD.reshape(b * T, D), r.weights.reshape(-1))
    prep = functools.partial(_send_rows, K=K, route_scale=cfg.route_scale, dtype=dtype)
    # The most rows that can ever arrive: a token's k experts are distinct, so at most
    # min(k, E_loc) of its assignments go to one shard, from b T tokens on each of ep shards;
    # with a capacity, no expert takes more than C rows from each shard either.
    n_worst = ep * min(b * T * min(K, E_loc), E_loc * r.cap)
    run = functools.partial(
        _grouped_rows, cfg=cfg, dtype=dtype, impl=impl, tp=tp, whole=whole, max_rows=ep * r.cap
    )
    inv_n = inverse(order_n)
    if ep == 1:  # every expert here: the rows are already in place, one round
        y_sD = run(prep(x_in, sent_s, inv_n=inv_n), w, sizes_E)
        stats = {"rounds": jnp.ones(()), "overflow": jnp.zeros(())}
    else:
        buffers = rounds_lib.receive_rows(n_send, n_worst, cfg.recv_factor)
        plan = rounds_lib.exchange_plan(sizes_E.reshape(ep, E_loc), "expert")
        rounds = rounds_lib.plan_rounds(plan, buffers)
        y_sD = rounds_lib.exchange_in_rounds(
            x_in, w, sent_s, plan, rounds.count, prep=prep, run=run, buffers=buffers,
            axis="expert", bounded=buffers.first < n_worst,
        )  # fmt: skip
        stats = {"rounds": rounds.count, "overflow": rounds.overflow}
    stats = {k: v.astype(jnp.float32) for k, v in stats.items()}
    with jax.named_scope(COMBINE):  # each assignment's row; dropped ones read zeros
        y_nD = unsort_rows(y_sD, inv_n, sent_s)
        y_bTD = sum_choices(y_nD.reshape(b, T, K, D), r.weights, r.keep, cfg.route_scale)
    return y_bTD, stats


@scoped(DISPATCH)
def _send_rows(x_in, sent_s, *, K, route_scale, dtype, inv_n=None):
    """The rows this shard sends, in expert order: each kept assignment's token (`sent_s`:
    the assignments, token-major), input-scaled for route_scale "input". `inv_n` (every
    assignment's position in the sort, where `sent_s` is all the sent rows): the gradient
    gathers rather than scatters (`grouped.spread_rows`)."""
    x_nD, weights_n = x_in
    rows = x_nD[sent_s // K] if inv_n is None else spread_rows(x_nD, sent_s, inv_n, K)
    x_sD = scale_inputs(rows, weights_n[sent_s], route_scale)
    return x_sD.astype(dtype)


def _grouped_rows(x_mD, w, sizes_e, *, cfg: MoEConfig, dtype, impl, tp, whole, max_rows):
    """Received rows, grouped by local expert (`sizes_e`; rows past them are padding),
    through their experts: SwiGLU and the down bias, unsummed over `tensor`."""
    E_loc, n = sizes_e.shape[0], x_mD.shape[0]
    expert_m = jnp.repeat(jnp.arange(E_loc), sizes_e, total_repeat_length=n)
    if tp is not None:  # the grouped backward types its input cotangent: see expert_swiglu
        x_mD = jax.lax.pcast(x_mD, tp, to="varying")
    w_in = {k: a for k, a in w.items() if k != "down_bias"}
    # No expert gets more than C rows from each of the ep shards, nor more than the round's
    # rows: the bound that picks the weight gradient's method (`grouped.weight_grad_plan`).
    y_mD = grouped_swiglu(
        x_mD, w_in, sizes_e, expert_m, dtype, impl, min(max_rows, n), cfg.row_chunks, whole,
        act=Activation.from_config(cfg),
    )  # fmt: skip
    if "down_bias" in w:  # added once, in the later sum over `tensor`
        y_mD = y_mD + down_bias(w["down_bias"][expert_m], dtype, tp, summed=False)
    return y_mD


def own_experts(x_bTD, w, r: Routing, *, cfg: MoEConfig, dtype, impl, ep, tp) -> jax.Array:
    """Inside the replicated map (or where every expert is local): this device's experts'
    share of every token's output, summed over `expert` (and the hidden dim's partials over
    `tensor`)."""
    E, D = cfg.n_experts, x_bTD.shape[-1]
    E_loc = E // ep
    first = jax.lax.axis_index("expert") * E_loc if ep > 1 else 0
    b, T, K = r.experts.shape
    if b * T * K < E:  # few tokens (decoding): read only the picked experts' weights
        mine = (r.experts >= first) & (r.experts < first + E_loc)
        local = jnp.clip(r.experts - first, 0, E_loc - 1)
        y_bTD = picked_swiglu(
            x_bTD, local, r.weights, r.keep & mine, w, dtype,
            route_scale=cfg.route_scale, reduce_axis=tp, act=Activation.from_config(cfg),
            impl=cfg.decode_impl,
        )  # fmt: skip
    else:
        buf = to_buffers(x_bTD, r, E, cfg.route_scale).reshape(E, r.cap, D)
        buf = jax.lax.dynamic_slice_in_dim(buf, first, E_loc)[:, None]  # [E_loc, 1, C, D]
        filled = jax.lax.dynamic_slice_in_dim(filled_slots(r.slot, E, r.cap), first, E_loc)
        # The tensor shards' partial sums are added after the combine: on the [b, T, D]
        # output, not the E_loc x C buffer rows (E_loc times fewer bytes, dropless).
        y_eSCD = expert_swiglu(
            buf, w, dtype, filled_ES=filled[:, None], reduce_axis=tp, sum_partials=False,
            impl=impl, act=Activation.from_config(cfg),
        )  # fmt: skip
        own = r.slot - first * r.cap
        own = jnp.where((own >= 0) & (own < E_loc * r.cap), own, E_loc * r.cap)  # else reads 0
        y_bTD = from_buffers(y_eSCD.reshape(E_loc * r.cap, D), own, r.weights, cfg.route_scale)
        if tp is not None:
            y_bTD = jax.lax.psum(y_bTD, tp)
    return jax.lax.psum(y_bTD, "expert") if ep > 1 else y_bTD
