"""Mixture-of-Experts feed-forward: top-k routing with a capacity factor, sort-based dispatch.

Semantics (DESIGN.md):
- Router logits `x @ W_r (+ b)` in float32. `softmax`: probabilities over all experts, top-k,
  optionally renormalised over the k (which is exactly "top-k, then softmax over the k").
  `sigmoid` (Llama 4): top-k on the raw logits, weight = sigmoid(logit), optionally renormalised.
- `route_scale="output"` weights each expert's output (Mixtral/Qwen); `"input"` scales the
  expert's *input* by the weight and sums the outputs unweighted (Llama 4).
- Tokens are routed in groups (one group per expert-parallel shard; the batch is split into
  `n_groups` equal groups of whole sequences). Capacity per expert and group:
  `C = ceil(capacity_factor * tokens_per_group * top_k / n_experts)` (min 1); `capacity_factor
  <= 0` means C = tokens_per_group, which can never drop (an expert appears once in a top-k).
- Drop priority inside a group: every token's 1st choice before any 2nd choice, then position in
  the sequence, then row in the batch. So with top-1 a token's fate never depends on later
  tokens (causal-safe). A dropped assignment contributes 0; the residual carries the token.
- Dispatch: one sort of the assignments by (expert, priority) gives each assignment its slot
  in fixed `[E, C, D]` buffers; tokens are gathered into the buffers and results gathered back.
- Expert parallelism: under a mesh, each batch shard routes its own tokens (one group per
  shard) inside `jax.shard_map`; an `all_to_all` over the `expert` axis sends each expert's
  buffer slots (and, for the per-expert path, how many are filled) to the shard that owns the
  expert, the local experts run (hidden dim split over `tensor`, partial sums psum-ed), and a
  second `all_to_all` brings the results home. With the grouped impl on GPU / TPU
  (`backends.exchange`), only the kept assignments travel instead: sorted by expert, sent by
  `ragged_all_to_all` straight into each owner's rows grouped by its local expert, run as
  one grouped matmul and sent back the same way (no padding on the wire when dropless). Expert
  weights never move. Aux statistics are psum-ed over the batch axes, so they are global.
- Padding (`valid_BT` False, from segment 0 of a packed batch) is not routed: it takes no
  slot of any expert's capacity, its output is 0 (plus the shared expert's), and it counts
  in no statistic. Capacity stays sized by the group's token count, padding included, so
  shapes do not depend on the data.
- Aux losses over all (valid) tokens of the call: Switch load balance `E * sum_e f_e * P_e`
  with f_e the fraction of top-k assignments to e and P_e the mean router probability
  (softmax; for sigmoid the per-token normalised sigmoid), and router z-loss
  `mean(logsumexp(logits)^2)`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.config import Config, MoEConfig
from moe_jax.model import gather
from moe_jax.model.filled_rows import swiglu_filled
from moe_jax.model.grouped import grouped_buffers, grouped_swiglu, inverse, sort_rows
from moe_jax.sharding import n_batch_shards, param, split_batch_axes

EXPERT_PARAMS = ("w_gate", "w_up", "w_down", "gate_bias", "up_bias", "down_bias")
MAP_MIN_CAPACITY = 128  # expert buffers of at least this many slots run one expert at a time
# ... and are unrolled in the trace (else a lax.map) up to this many (local) experts, if each
# expert's matmuls are at least this big (rows x d_model x hidden multiply-adds).
UNROLL_MAX_EXPERTS = 32
UNROLL_MIN_MACS = 1 << 27
GROUPED_IMPLS = ("ragged", "megablox")  # moe.impl values that run a grouped matmul


def capacity(tokens_per_group: int, cfg: MoEConfig) -> int:
    if cfg.capacity_factor <= 0:
        return tokens_per_group
    return max(1, math.ceil(cfg.capacity_factor * tokens_per_group * cfg.top_k / cfg.n_experts))


def route(logits_TE: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (weights_TK, experts_TK, router probabilities_TE used by the load-balance loss)."""
    top_logits_TK, experts_TK = jax.lax.top_k(logits_TE, cfg.top_k)
    if cfg.score == "softmax":
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=-1)
    else:
        weights_TK = jax.nn.sigmoid(top_logits_TK)
        sig_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = sig_TE / jnp.sum(sig_TE, axis=-1, keepdims=True)
    if cfg.renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, experts_TK, probs_TE


def assign_slots(
    experts_BTK: jax.Array, n_experts: int, cap: int, valid_BT: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Slot of every assignment in a flat [E * C] buffer for one routing group.

    experts_BTK: expert ids of the group's B rows x T positions x K choices; `valid_BT`
    (optional): False for tokens not to route (padding), which take no slot.
    Returns slot_BTK (E * C where dropped, i.e. out of range) and keep_BTK.
    """
    B, T, K = experts_BTK.shape
    n = B * T * K
    if valid_BT is not None:  # queue padding at a virtual expert E past the real ones
        experts_BTK = jnp.where(valid_BT[..., None], experts_BTK, n_experts)
    # Priority of each assignment: choice rank first, then position, then row.
    k_idx = jnp.arange(K)[None, None, :]
    t_idx = jnp.arange(T)[None, :, None]
    b_idx = jnp.arange(B)[:, None, None]
    priority_BTK = (k_idx * T + t_idx) * B + b_idx
    key = (experts_BTK * n + priority_BTK).reshape(-1)  # unique keys: sort by expert, priority
    order = jnp.argsort(key)
    sorted_experts = experts_BTK.reshape(-1)[order]
    counts_E = jnp.bincount(sorted_experts, length=n_experts + 1)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted = jnp.arange(n) - starts_E[sorted_experts]  # position within its expert's queue
    rank = jnp.zeros(n, rank_sorted.dtype).at[order].set(rank_sorted).reshape(B, T, K)
    keep_BTK = (rank < cap) & (experts_BTK < n_experts)
    slot_BTK = jnp.where(keep_BTK, experts_BTK * cap + rank, n_experts * cap)
    return slot_BTK, keep_BTK


def dispatch(x_BTD: jax.Array, slot_BTK: jax.Array, n_slots: int) -> jax.Array:
    """Gather tokens into the flat [E * C, D] expert buffer (empty slots are zero)."""
    B, T, K = slot_BTK.shape
    token_BTK = jnp.broadcast_to(jnp.arange(B * T).reshape(B, T, 1), (B, T, K))
    # Slot -> token index; empty slots point at an appended zero row.
    token_of_slot = (
        jnp.full((n_slots,), B * T).at[slot_BTK.reshape(-1)].set(token_BTK.reshape(-1), mode="drop")
    )
    x_pad = jnp.concatenate([x_BTD.reshape(B * T, -1), jnp.zeros_like(x_BTD[0, :1])], axis=0)
    return x_pad[token_of_slot]


def combine(y_SD: jax.Array, slot_BTK: jax.Array) -> jax.Array:
    """Each assignment's expert output [B, T, K, D]; dropped assignments read zeros."""
    return y_SD.at[slot_BTK].get(mode="fill", fill_value=0)


class SwiGLU(nnx.Module):
    """Dense SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, d_model: int, hidden: int, cfg: Config, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        self.w_gate = param(rngs, init, (d_model, hidden), ("embed", "mlp"))
        self.w_up = param(rngs, init, (d_model, hidden), ("embed", "mlp"))
        self.w_down = param(rngs, init, (hidden, d_model), ("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        # As rows [B*T, D]: on [B, T, D] XLA:CPU fused the SwiGLU backward's elementwise ops
        # into slow transposing copies for the weight gradients (contracted over both B and T),
        # and the layer's forward + backward took twice as long.
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        # (each matmul's weight gathered by mesh.weight_gather, see gather.einsum)
        gate_NF = gather.einsum("nd,df->nf", x_ND, self.w_gate, self.dtype)
        up_NF = gather.einsum("nd,df->nf", x_ND, self.w_up, self.dtype)
        y_ND = gather.einsum("nf,fd->nd", jax.nn.silu(gate_NF) * up_NF, self.w_down, self.dtype)
        return y_ND.reshape(*x_BTD.shape[:-1], -1)


class Experts(nnx.Module):
    """n_experts SwiGLU MLPs, applied to their capacity buffers by `expert_swiglu`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        E, D, F = cfg.moe.n_experts, cfg.model.d_model, cfg.moe.expert_hidden
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        # fsdp splits each weight's minor dim (see sharding.LOGICAL_RULES)
        self.w_gate = param(rngs, init, (E, D, F), ("expert", None, "expert_mlp_fsdp"))
        self.w_up = param(rngs, init, (E, D, F), ("expert", None, "expert_mlp_fsdp"))
        self.w_down = param(rngs, init, (E, F, D), ("expert", "expert_mlp", "expert_embed"))
        if cfg.moe.expert_bias:
            zeros = nnx.initializers.zeros
            self.gate_bias = param(rngs, zeros, (E, F), ("expert", "expert_mlp"))
            self.up_bias = param(rngs, zeros, (E, F), ("expert", "expert_mlp"))
            self.down_bias = param(rngs, zeros, (E, D), ("expert", "expert_embed"))

    def weights(self) -> dict[str, jax.Array]:
        return {n: getattr(self, n)[...] for n in EXPERT_PARAMS if hasattr(self, n)}


def swiglu_rows(x_CD, w: dict, dtype) -> jax.Array:
    """SwiGLU of rows [..., C, D] with weights [..., D, F] (a leading expert axis on both, or
    none), without the down-projection bias (added after any tensor-parallel sum)."""
    bias = lambda n: jnp.expand_dims(w[n].astype(dtype), -2) if n in w else 0
    gate_CF = jnp.matmul(x_CD, w["w_gate"].astype(dtype)) + bias("gate_bias")
    up_CF = jnp.matmul(x_CD, w["w_up"].astype(dtype)) + bias("up_bias")
    return jnp.matmul(jax.nn.silu(gate_CF) * up_CF, w["w_down"].astype(dtype))


def expert_swiglu(
    x_ESCD,
    w: dict,
    dtype,
    filled_ES=None,
    reduce_axis: str | None = None,
    sum_partials=True,
    impl: str = "buckets",
    row_chunks: int = 1,
):
    """Each expert's SwiGLU on its buffer: E experts x S segments (routing groups) x C slots.
    A segment is filled from the front, `filled_ES` rows (None: any may be full); outputs of
    empty slots are never read. With `reduce_axis`, `w` holds a shard of the hidden dim
    (tensor parallelism) and the partial down-projections are summed over that axis, or, with
    `sum_partials=False`, returned unsummed for the caller to sum later on fewer rows (the
    down-projection bias then comes from the axis' first shard only).

    Big buffers (training) run one expert at a time on the filled rows of each segment only
    (`filled_rows`): an expert's [C, F] intermediates then stay in the CPU cache instead of
    [E, C, F] arrays going through memory (the medium training step used ~15% less CPU), and
    the capacity padding costs nothing. Big enough experts, up to UNROLL_MAX_EXPERTS of
    them, are unrolled in the trace; others run in a `lax.map`, whose compile time does not
    grow with E. Small buffers (decoding) run as batched matmuls over every slot, which
    stream the weights in one pass (the per-expert map made batch-8 decoding ~25% slower).
    `impl` (moe.impl, resolved): "ragged" / "megablox" run big buffers' filled rows as one
    grouped matmul (`grouped.grouped_buffers`); "batched" runs every slot of any buffer as
    one batched matmul, padding included (the GPU's form, see `backends.py`); the grouped
    ones in `row_chunks` windows (moe.row_chunks)."""
    E, S, C, D = x_ESCD.shape
    w_in = {n: a for n, a in w.items() if n != "down_bias"}
    grouped = S * C >= MAP_MIN_CAPACITY and impl in GROUPED_IMPLS
    if not grouped:  # the grouped matmul names its own rows (`grouped_swiglu`)
        x_ESCD = checkpoint_name(x_ESCD, "expert_in")
    if impl == "batched":  # every slot, one batched matmul: no conditionals
        y_ESCD = swiglu_rows(x_ESCD.reshape(E, S * C, D), w_in, dtype).reshape(E, S, C, D)
    elif grouped:
        if reduce_axis is not None:  # a hand-written backward again: see below
            x_ESCD = jax.lax.pcast(x_ESCD, reduce_axis, to="varying")
        if filled_ES is None:
            filled_ES = jnp.full((E, S), C, jnp.int32)
        y_ESCD = grouped_buffers(x_ESCD, w_in, dtype, filled_ES, impl, row_chunks)
    elif S * C >= MAP_MIN_CAPACITY:
        if reduce_axis is not None:
            # Each tensor shard's input cotangent is a partial sum. `filled_rows`' hand-written
            # backward must return it typed like its input, so the input is made varying here
            # and the sum of the partials (this cast's transpose) is one all-reduce for all
            # experts, after the per-expert loop.
            x_ESCD = jax.lax.pcast(x_ESCD, reduce_axis, to="varying")
        if filled_ES is None:
            filled_ES = jnp.full((E, S), C, jnp.int32)

        # Rows [S * C, D] per expert: with S = 1, XLA:CPU gave a [E, 1, C, D] operand a
        # layout with the size-1 axis first and copied it into the map's default layout.
        def one_expert(a):
            return swiglu_filled(a[0].reshape(S, C, D), a[1], a[2], dtype).reshape(S * C, D)

        per_expert = (x_ESCD.reshape(E, S * C, D), w_in, filled_ES)
        F = w["w_gate"].shape[-1]
        if E <= UNROLL_MAX_EXPERTS and S * C * D * F >= UNROLL_MIN_MACS:
            # Inside the layer scan, each unrolled expert's weights are one slice of the
            # stacked [L, E, D, F] parameters and its gradients go into their stack once. The
            # map copied the layer's [E, D, F] weights out first, per expert again, and stacked
            # the gradients and saved products twice. Medium benchmark, in turns: 13% faster
            # (Mixtral-like), 5% (Llama-4-like), 6% with 32 experts. Smaller experts ran
            # slower unrolled (small benchmark: 5-15% with 8 experts, 60% with 32; why is not
            # known), and compile time grows with E (+12 s at medium with 32 experts).
            y_ESCD = jnp.stack([one_expert(a) for a in unstack(per_expert, E)])
        else:
            y_ESCD = jax.lax.map(one_expert, per_expert)
        y_ESCD = y_ESCD.reshape(E, S, C, D)
    else:
        y_ESCD = swiglu_rows(x_ESCD.reshape(E, S * C, D), w_in, dtype).reshape(E, S, C, D)
    if "down_bias" in w:
        bias = w["down_bias"].astype(dtype)
        if reduce_axis is not None and not sum_partials:  # added once in the later sum
            bias = bias * (jax.lax.axis_index(reduce_axis) == 0).astype(dtype)
        elif reduce_axis is not None:
            y_ESCD = jax.lax.psum(y_ESCD, reduce_axis)
        y_ESCD = y_ESCD + bias[:, None, None, :]
    elif reduce_axis is not None and sum_partials:
        y_ESCD = jax.lax.psum(y_ESCD, reduce_axis)
    return y_ESCD


def rows_matmul(x_JD: jax.Array, w_JDF: jax.Array) -> jax.Array:
    """Each row times its own matrix: [..., D] x [..., D, F] -> [..., F], as a batched matmul
    of two-row operands (the second row zero). XLA:GPU turns a batched vector-matrix product
    into a reduction that read the gathered expert weights at ~0.4 TB/s (H200, 2026-11-26:
    116 us for one layer's gate and up at batch 1, a third of the decode step); with two rows
    it is a GEMM fusion. The extra row's FLOPs are nothing beside the weights' bytes."""
    lead, D = x_JD.shape[:-1], x_JD.shape[-1]
    x_J2D = jnp.stack([x_JD, jnp.zeros_like(x_JD)], axis=-2).reshape(-1, 2, D)
    w_JDF = w_JDF.reshape(-1, *w_JDF.shape[-2:])
    y_J2F = jnp.einsum("jmd,jdf->jmf", x_J2D, w_JDF)
    return y_J2F[:, 0].reshape(*lead, w_JDF.shape[-1])


def unstack(tree, n: int) -> list:
    """A tree of [n, ...] arrays -> n trees of [...] arrays, by `lax.split`: its transpose
    concatenates the n cotangents once. Taken as n slices `a[i]` instead, each slice's
    cotangent is a zero-padded full-size array and the n of them are summed (unrolled experts
    were 2.5x slower than the map at 32 experts that way)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [jax.lax.split(a, [1] * n) for a in leaves]
    return [treedef.unflatten([p[i].reshape(p[i].shape[1:]) for p in parts]) for i in range(n)]


def filled_slots(slot_bTK: jax.Array, n_experts: int, cap: int) -> jax.Array:
    """[E] slots each expert's buffer has filled (dropped assignments point past the end)."""
    return jnp.bincount(slot_bTK.reshape(-1) // cap, length=n_experts)


# The ragged exchange's collective; the CPU tests swap in an emulation (XLA:CPU has none).
ragged_all_to_all = jax.lax.ragged_all_to_all


class RaggedExchange(NamedTuple):
    """A shard's `ragged_all_to_all` arguments (input_offsets, send_sizes, output_offsets,
    recv_sizes), flat [ep * E_loc] over (peer shard, local expert of the owner): one slice per
    expert and shard, so rows arrive grouped by expert. `there`: the rows to the experts'
    owners; `back`: their results home; `sizes_e`: rows received per local expert."""

    there: tuple[jax.Array, ...]
    back: tuple[jax.Array, ...]
    sizes_e: jax.Array


def exclusive_cumsum(a: jax.Array) -> jax.Array:
    return jnp.cumsum(a) - a


def exchange_offsets(send_PE: jax.Array, axis: str) -> RaggedExchange:
    """Offsets of the exchange, from send_PE [ep, E_loc]: the rows this shard sends to peer
    p's local expert e, laid out in its send buffer sorted by (global) expert p * E_loc + e.

    Each owner lays its receive buffer out expert by expert, then by source shard, so that
    its local experts' rows are contiguous groups for the grouped matmul (no second sort);
    since ragged_all_to_all's output_offsets are offsets in the *receiver's* buffer, the
    owner computes them and sends them back to the sources (two small all_to_alls)."""
    ep, E_loc = send_PE.shape
    a2a = lambda a: jax.lax.all_to_all(a, axis, 0, 0)
    start_PE = exclusive_cumsum(send_PE.reshape(-1)).reshape(ep, E_loc)
    got = a2a(jnp.stack([send_PE, start_PE], axis=1))  # [ep, 2, E_loc] from each source
    recv_PE, home_PE = got[:, 0], got[:, 1]  # its rows for my expert e, where they start there
    land_PE = exclusive_cumsum(recv_PE.T.reshape(-1)).reshape(E_loc, ep).T  # expert-major
    out_PE = a2a(land_PE)  # where my rows land at each owner
    flat = lambda *a: tuple(x.reshape(-1) for x in a)
    return RaggedExchange(
        there=flat(start_PE, send_PE, out_PE, recv_PE),
        back=flat(land_PE, recv_PE, home_PE, send_PE),
        sizes_e=jnp.sum(recv_PE, axis=0),
    )


def move_rows(x_nD: jax.Array, n_out: int, offsets: tuple, axis: str) -> jax.Array:
    """`ragged_all_to_all` of x's row slices into a zero [n_out, D] buffer."""
    # The collective's result is typed like its `output` operand (jax 0.10.2), so the zeros
    # vary over the axes x does: an invariant result failed the grouped backward's typing.
    out_mD = jnp.zeros((n_out, x_nD.shape[1]), x_nD.dtype)
    out_mD = jax.lax.pcast(out_mD, tuple(jax.typeof(x_nD).mat.varying), to="varying")
    return ragged_all_to_all(x_nD, out_mD, *offsets, axis_name=axis)


class MoE(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        m = cfg.moe
        D, E = cfg.model.d_model, m.n_experts
        self.cfg = m
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        self.router = param(
            rngs, nnx.initializers.normal(cfg.model.init_std), (D, E), ("embed", None)
        )
        if m.router_bias:
            self.router_bias = param(rngs, nnx.initializers.zeros, (E,), (None,))
        self.experts = Experts(cfg, rngs=rngs)
        if m.shared_expert_hidden > 0:
            self.shared = SwiGLU(D, m.shared_expert_hidden, cfg, rngs=rngs)

    def router_logits(self, x_BTD: jax.Array) -> jax.Array:
        logits = x_BTD.astype(jnp.float32) @ self.router[...]
        if hasattr(self, "router_bias"):
            logits = logits + self.router_bias[...]
        return logits

    def __call__(
        self, x_BTD: jax.Array, n_groups: int = 1, valid_BT: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        """x_BTD -> (y_BTD, stats). Without a mesh the batch is routed in `n_groups` groups.
        `valid_BT` (bool, optional): False marks padding, which is not routed."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            y_BTD, stats = self._local(x_BTD, n_groups, valid_BT)
        else:  # rows split over the batch axes, or (a batch they do not divide) replicated
            replicated = x_BTD.shape[0] % n_batch_shards(mesh) != 0
            y_BTD, stats = self._expert_parallel(x_BTD, mesh, valid_BT, replicated)
        if hasattr(self, "shared"):
            y_BTD = y_BTD + self.shared(x_BTD)
        return y_BTD.astype(x_BTD.dtype), stats

    def _route_group(self, x_bTD, router, router_bias, valid_bT=None):
        """Route one group: (w_bTK, slot_bTK, keep_bTK, capacity, stat sums over the group).
        With `valid_bT`, the sums are over the valid tokens and count them ("tokens")."""
        m = self.cfg
        b, T, _ = x_bTD.shape
        logits_bTE = x_bTD.astype(jnp.float32) @ router + router_bias
        weights_bTK, experts_bTK, probs_bTE = route(logits_bTE, m)
        cap = capacity(b * T, m)
        slot_bTK, keep_bTK = assign_slots(experts_bTK, m.n_experts, cap, valid_bT)
        load_bTKE = jax.nn.one_hot(experts_bTK, m.n_experts, dtype=jnp.float32)
        z_bT = jax.nn.logsumexp(logits_bTE, axis=-1) ** 2
        if valid_bT is not None:  # padding counts in no statistic
            w_bT = valid_bT.astype(jnp.float32)
            load_bTKE = load_bTKE * w_bT[..., None, None]
            probs_bTE = probs_bTE * w_bT[..., None]
            z_bT = z_bT * w_bT
        sums = {
            "load": jnp.sum(load_bTKE, (0, 1, 2)),
            "prob": jnp.sum(probs_bTE, axis=(0, 1)),
            "z": jnp.sum(z_bT),
            "kept": jnp.sum(keep_bTK.astype(jnp.float32)),
        }
        if valid_bT is not None:
            sums["tokens"] = jnp.sum(w_bT)
        return weights_bTK.astype(self.dtype), experts_bTK, slot_bTK, keep_bTK, cap, sums

    def _stats(self, sums: dict, n_tokens: int) -> dict:
        """Global aux losses and metrics from summed per-group statistics, per token: the
        call's `n_tokens`, or the valid tokens counted in sums["tokens"] (at least 1)."""
        if "tokens" in sums:
            n_tokens = jnp.maximum(sums["tokens"], 1.0)
        E, K = self.cfg.n_experts, self.cfg.top_k
        load_E = sums["load"] / (n_tokens * K)
        return {
            "lb_loss": E * jnp.sum(load_E * sums["prob"] / n_tokens),
            "z_loss": sums["z"] / n_tokens,
            "expert_load": load_E,
            "dropped_frac": (n_tokens * K - sums["kept"]) / (n_tokens * K),  # exact 0 if none
        }

    def _router_params(self):
        bias = self.router_bias[...] if hasattr(self, "router_bias") else jnp.zeros(())
        return self.router[...], bias

    def _local(self, x_BTD: jax.Array, n_groups: int, valid_BT) -> tuple[jax.Array, dict]:
        B, T, D = x_BTD.shape
        G, K, E = n_groups, self.cfg.top_k, self.cfg.n_experts
        assert B % G == 0, f"batch {B} does not split into {G} routing groups"
        split = lambda a: a.reshape(G, B // G, *a.shape[1:])
        router, bias = self._router_params()
        valid_GbT = None if valid_BT is None else split(valid_BT)
        w, experts, slot, keep, cap, sums = jax.vmap(
            self._route_group, in_axes=(0, None, None, 0), out_axes=(0, 0, 0, 0, None, 0)
        )(split(x_BTD), router, bias, valid_GbT)
        sums = jax.tree.map(lambda a: jnp.sum(a, axis=0), sums)
        merge = lambda a: a.reshape(B, *a.shape[2:])
        if B * T * K < E:
            # Few tokens in flight (decoding): read only the picked experts' weights instead
            # of running all E experts on mostly empty buffers. Same drops as the buffers.
            y_BTD = self._gathered(x_BTD, merge(experts), merge(w), merge(keep))
        elif self._impl() in GROUPED_IMPLS:
            # With a capacity no expert takes more than the groups' slots: the weight gradient
            # runs padded to them; dropless that bound is every row (ragged_dot's own).
            bound = G * cap if self.cfg.capacity_factor > 0 else None
            y_BTD = self._grouped(x_BTD, merge(experts), merge(w), merge(keep), bound)
        else:
            y_BTD = merge(self._buffered(split(x_BTD), slot, w, cap))
        return y_BTD, self._stats(sums, B * T)

    def _expert_parallel(
        self, x_BTD: jax.Array, mesh, valid_BT, replicated: bool = False
    ) -> tuple[jax.Array, dict]:
        """The MoE layer inside `shard_map`: tokens move, expert weights stay. `replicated`
        (a batch the batch axes do not split, e.g. decoding one sequence): every device
        routes all the tokens, runs them through its own experts only and the partial outputs
        are summed over `expert`, so no all_to_all and no weight leaves its device."""
        E, D = self.cfg.n_experts, x_BTD.shape[-1]
        ep = mesh.shape["expert"]
        E_loc = E // ep
        # Experts split over `expert`, the hidden dim over `tensor`; each named only when > 1,
        # so replication stays inferable (and see batch_axes below).
        ex = "expert" if ep > 1 else None
        tp = "tensor" if mesh.shape["tensor"] > 1 else None
        fs = "fsdp" if mesh.shape["fsdp"] > 1 else None
        # The weights come in as stored, their minor dim split over `fsdp` too, and are
        # gathered inside, in the compute dtype: the gather's transpose then sends each fsdp
        # shard's gradient out as one reduce-scatter, where a gather outside the shard_map left
        # an all-reduce of the whole fp32 gradient, sliced afterwards. (name: spec, fsdp dim)
        tp_fs = tuple(a for a in (tp, fs) if a) or None
        expert_specs = {
            "w_gate": (P(ex, None, tp_fs), 2),
            "w_up": (P(ex, None, tp_fs), 2),
            "w_down": (P(ex, tp, fs), 2),
            "gate_bias": (P(ex, tp), None),
            "up_bias": (P(ex, tp), None),
            "down_bias": (P(ex, fs), 1),
        }
        weights = self.experts.weights()
        router, bias = self._router_params()
        # Only axes that split the batch are named. A size-1 axis named in the batch spec
        # would still make JAX sum the weights' gradient over it, and XLA:CPU runs that
        # one-device all-reduce as a full copy of each layer's expert gradients (0.1 s a step
        # at medium with 32 experts).
        batch_axes = () if replicated else split_batch_axes(mesh)
        data_axes = ("data",) if mesh.shape["data"] > 1 and not replicated else ()
        to_owner = (lambda a: jax.lax.all_to_all(a, "expert", 0, 0)) if ep > 1 else (lambda a: a)
        ragged = backends.exchange(self._impl(), self.cfg.exchange) == "ragged"

        fs_plan = gather.steps((fs,), mesh) if fs else ()  # mesh.gather_group's steps

        def gathered(name, a, window=False):
            """In the compute dtype, the model dim whole again: varying over fsdp then."""
            a, axis = a.astype(self.dtype), expert_specs[name][1]
            if fs is None or axis is None:
                return a
            # Replicated tokens make every fsdp shard's output the same: gathered invariant
            # (in one step: a group's gather alone varies over the axis).
            if replicated:
                return jax.lax.all_gather(a, fs, axis=axis, tiled=True, to="invarying")
            if window:
                # On v5p-128 at fsdp 64 libtpu turned the last reduce-scatter of a window's
                # gradient, along its minor dim (to a 224-wide shard), into an all-reduce.
                # (The whole layer's weights, gathered on a leading axis, went the other way
                # round: benchmarks/README.md.)
                return gather.gather_leading(a, fs_plan, axis)
            return gather.gather(a, fs_plan, axis)

        def local(x_bTD, router, bias, w, *valid):
            b, T, _ = x_bTD.shape
            wts, experts, slot, keep, cap, sums = self._route_group(x_bTD, router, bias, *valid)
            # Small exchanges (decoding) keep the buffers, whose experts then run as batched
            # matmuls over every slot (see expert_swiglu), as the ragged impl's own do.
            exchange = ragged and not replicated and ep * cap >= MAP_MIN_CAPACITY
            # Row windows cut by experts gather their own experts' weights, one window at a
            # time (grouped.grouped_swiglu's `whole`); everything else is gathered here.
            chunks = self.cfg.row_chunks
            by_experts = chunks > 1 and E_loc % chunks == 0  # grouped.chunk_plan's cut
            later = ("w_gate", "w_up", "w_down") if exchange and fs and by_experts else ()
            # The gathered weights vary over fsdp (the gather's transpose is the reduce-scatter);
            # over `data`, and the biases without a model dim over fsdp too, they are the same
            # on every shard, and their gradient is summed over those axes where they turn
            # varying. Done here, that is one collective per weight, not one per expert inside
            # the expert map's backward loop.
            w = {n: a.astype(self.dtype) if n in later else gathered(n, a) for n, a in w.items()}
            for n, a in w.items():
                no_fs_dim = fs and expert_specs[n][1] is None and not replicated
                same = data_axes + ((fs,) if no_fs_dim else ())
                if same:
                    w[n] = jax.lax.pcast(a, same, to="varying")
            if replicated:
                return self._own_experts(x_bTD, w, wts, experts, slot, keep, cap, ep, tp), sums
            # The tensor shards' partial sums travel home unsummed and are added after the
            # combine, on [b, T, D] rather than the expert rows (E C / (b T) times fewer
            # bytes with buffers: 2.5 at capacity 1.25 top-2, E when dropless).
            if exchange:
                whole = None
                if later:
                    whole = lambda w: {
                        n: gathered(n, a, window=True) if n in later else a for n, a in w.items()
                    }
                y_bTD = self._ragged_exchange(x_bTD, w, wts, experts, keep, cap, ep, tp, whole)
            else:
                buf = self._dispatch(x_bTD, slot, wts, cap)  # [E * C, D], all experts
                # Send expert e's slots (and how many are filled) to the shard that owns e:
                # [ep, E_loc, ...] -> by source shard.
                buf = to_owner(buf.reshape(ep, E_loc, cap, D))
                filled = to_owner(filled_slots(slot, E, cap).reshape(ep, E_loc))
                y_eSCD = expert_swiglu(
                    buf.transpose(1, 0, 2, 3),
                    w,
                    self.dtype,
                    filled.T,
                    tp,
                    False,
                    self._impl(),
                    self.cfg.row_chunks,
                )
                y = to_owner(y_eSCD.transpose(1, 0, 2, 3)).reshape(E * cap, D)  # back home
                y_bTD = self._combine(y, slot, wts)
            if tp is not None:
                y_bTD = jax.lax.psum(y_bTD, tp)
            if batch_axes:
                sums = jax.lax.psum(sums, batch_axes)
            return y_bTD, sums

        x_spec = P(batch_axes or None, None, None)
        valid = () if valid_BT is None else (valid_BT,)  # split like the tokens
        y_BTD, sums = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(x_spec, P(), P(), {n: expert_specs[n][0] for n in weights})
            + (P(batch_axes or None, None),) * len(valid),
            out_specs=(x_spec, P()),
        )(x_BTD, router, bias, weights, *valid)
        B, T, _ = x_BTD.shape
        return y_BTD, self._stats(sums, B * T)

    def _ragged_exchange(self, x_bTD, w, wts, experts, keep, cap, ep, tp, whole) -> jax.Array:
        """Inside the expert-parallel map: this shard's kept assignments, sorted by expert,
        sent as rows (no padding) to the shards owning their experts, run there as one grouped
        matmul and sent back (`ragged_all_to_all` both ways; offsets: `exchange_offsets`).
        The output is unsummed over `tensor`, like the buffers'. `whole`: the expert weights
        come split over fsdp, gathered by the grouped matmul (`grouped_swiglu`)."""
        E, D = self.cfg.n_experts, x_bTD.shape[-1]
        E_loc = E // ep
        b, T, K = experts.shape
        order_n, sizes_E = sort_rows(experts.reshape(-1), keep.reshape(-1), E)
        # The kept rows (the rest are past them in `order_n`): at most every assignment, and
        # with a capacity at most C per expert.
        n_send = min(b * T * K, E * cap)
        sent_s = order_n[:n_send]
        x_sD = x_bTD.reshape(b * T, D)[sent_s // K]
        if self.cfg.route_scale == "input":  # each assignment's own input: w * x
            x_sD = x_sD * wts.reshape(-1)[sent_s][:, None]
        x_sD = x_sD.astype(self.dtype)
        # Receive buffer: the most rows that can ever arrive, so nothing is ever lost. A
        # token's k experts are distinct, so at most min(k, E_loc) of its assignments go to
        # one shard, from b T tokens on each of ep shards; with a capacity, no expert takes
        # more than C rows from each shard either.
        n_recv = ep * min(b * T * min(K, E_loc), E_loc * cap)
        if ep > 1:
            offsets = exchange_offsets(sizes_E.reshape(ep, E_loc), "expert")
            x_mD, sizes_e = move_rows(x_sD, n_recv, offsets.there, "expert"), offsets.sizes_e
        else:  # every expert here: the rows are already in place (n_recv == n_send)
            x_mD, sizes_e = x_sD, sizes_E
        expert_m = jnp.repeat(jnp.arange(E_loc), sizes_e, total_repeat_length=n_recv)
        if tp is not None:  # the grouped backward types its input cotangent: see expert_swiglu
            x_mD = jax.lax.pcast(x_mD, tp, to="varying")
        w_in = {n: a for n, a in w.items() if n != "down_bias"}
        # No expert gets more than C rows from each of the ep shards: the weight gradient runs
        # padded to that (`grouped_matmul`), not as a dense product over every local expert.
        y_mD = grouped_swiglu(
            x_mD,
            w_in,
            sizes_e,
            expert_m,
            self.dtype,
            self._impl(),
            ep * cap,
            self.cfg.row_chunks,
            whole,
        )
        if "down_bias" in w:  # added once in the later sum over `tensor`
            first = 1 if tp is None else (jax.lax.axis_index(tp) == 0).astype(self.dtype)
            y_mD = y_mD + w["down_bias"][expert_m] * first
        y_sD = move_rows(y_mD, n_send, offsets.back, "expert") if ep > 1 else y_mD
        # Each assignment's row; dropped ones sort past the kept rows and read zeros.
        y_nD = y_sD.at[inverse(order_n)].get(mode="fill", fill_value=0)
        y_bTKD = y_nD.reshape(b, T, K, D)
        if self.cfg.route_scale == "output":
            y_bTKD = y_bTKD * wts[..., None]
        return jnp.sum(jnp.where(keep[..., None], y_bTKD, 0), axis=2)

    def _own_experts(self, x_bTD, w, wts, experts, slot, keep, cap, ep, tp) -> jax.Array:
        """Inside the replicated expert-parallel map: this device's experts' share of every
        token's output, summed over `expert` (and the hidden dim's partials over `tensor`)."""
        E, D = self.cfg.n_experts, x_bTD.shape[-1]
        E_loc = E // ep
        first = jax.lax.axis_index("expert") * E_loc if ep > 1 else 0
        b, T, K = experts.shape
        if b * T * K < E:  # few tokens (decoding): read only the picked experts' weights
            mine = (experts >= first) & (experts < first + E_loc)
            local = jnp.clip(experts - first, 0, E_loc - 1)
            y_bTD = self._gathered(x_bTD, local, wts, keep & mine, w, reduce_axis=tp)
        else:
            buf = self._dispatch(x_bTD, slot, wts, cap).reshape(E, cap, D)
            buf = jax.lax.dynamic_slice_in_dim(buf, first, E_loc)[:, None]  # [E_loc, 1, C, D]
            filled = jax.lax.dynamic_slice_in_dim(filled_slots(slot, E, cap), first, E_loc)
            # The tensor shards' partial sums are added after the combine: on the [b, T, D]
            # output, not the E_loc x C buffer rows (E_loc times fewer bytes, dropless).
            y_eSCD = expert_swiglu(buf, w, self.dtype, filled[:, None], tp, False, self._impl())
            own = slot - first * cap
            own = jnp.where((own >= 0) & (own < E_loc * cap), own, E_loc * cap)  # else reads 0
            y_bTD = self._combine(y_eSCD.reshape(E_loc * cap, D), own, wts)
            if tp is not None:
                y_bTD = jax.lax.psum(y_bTD, tp)
        return jax.lax.psum(y_bTD, "expert") if ep > 1 else y_bTD

    def _impl(self) -> str:
        impl = backends.choose("moe", self.cfg.impl)
        if impl == "megablox" and not jax.sharding.get_abstract_mesh().empty:
            raise backends.KernelError(
                "moe.impl=megablox runs without a mesh only (jax's megablox pallas_call "
                "declares no varying mesh axes for shard_map); use moe.impl=ragged or auto"
            )
        return impl

    def _grouped(self, x_BTD, experts_BTK, w_BTK, keep_BTK, max_group=None) -> jax.Array:
        """Every kept assignment through its expert as rows sorted by expert, one grouped
        matmul per projection: no [E, C] buffers and no padding rows (`grouped.py`).
        `max_group`: no expert has more rows (see `grouped.grouped_matmul`)."""
        B, T, K = experts_BTK.shape
        D = x_BTD.shape[-1]
        order_n, sizes_E = sort_rows(
            experts_BTK.reshape(-1), keep_BTK.reshape(-1), self.cfg.n_experts
        )
        expert_n = experts_BTK.reshape(-1)[order_n]
        x_nD = x_BTD.reshape(B * T, D)[order_n // K]
        if self.cfg.route_scale == "input":  # each assignment's own input: w * x
            x_nD = x_nD * w_BTK.reshape(-1)[order_n][:, None]
        w = self.experts.weights()
        bias = w.pop("down_bias", None)
        y_nD = grouped_swiglu(
            x_nD, w, sizes_E, expert_n, self.dtype, self._impl(), max_group, self.cfg.row_chunks
        )
        if bias is not None:
            y_nD = y_nD + bias.astype(self.dtype)[expert_n]
        y_BTKD = y_nD[inverse(order_n)].reshape(B, T, K, D)
        if self.cfg.route_scale == "output":
            y_BTKD = y_BTKD * w_BTK[..., None]
        return jnp.sum(jnp.where(keep_BTK[..., None], y_BTKD, 0), axis=2)

    def _dispatch(self, x_bTD, slot_bTK, w_bTK, cap: int) -> jax.Array:
        """Tokens into the flat [E * C, D] buffers (input-scaled for route_scale="input")."""
        E, D = self.cfg.n_experts, x_bTD.shape[-1]
        if self.cfg.route_scale == "input":  # each assignment's own input: w * x
            x_nD = (x_bTD[:, :, None, :] * w_bTK[..., None]).reshape(-1, 1, D)
            return dispatch(x_nD, slot_bTK.reshape(-1, 1, 1), E * cap)
        return dispatch(x_bTD, slot_bTK, E * cap)

    def _combine(self, y_SD, slot_bTK, w_bTK) -> jax.Array:
        y_bTKD = combine(y_SD, slot_bTK)
        if self.cfg.route_scale == "output":
            y_bTKD = y_bTKD * w_bTK[..., None]
        return jnp.sum(y_bTKD, axis=2)

    def _buffered(self, x_GbTD, slot_GbTK, w_GbTK, cap: int) -> jax.Array:
        """G routing groups through fixed [E, C, D] buffers on this device. Only dispatch and
        combine are vmapped over the groups: the experts take them as segments, so that each
        segment's filled-row bucket stays a scalar (a vmapped switch runs every branch)."""
        E, D = self.cfg.n_experts, x_GbTD.shape[-1]
        G = x_GbTD.shape[0]
        buf_GSD = jax.vmap(self._dispatch, in_axes=(0, 0, 0, None))(x_GbTD, slot_GbTK, w_GbTK, cap)
        filled_GE = jax.vmap(filled_slots, in_axes=(0, None, None))(slot_GbTK, E, cap)
        y_EGCD = expert_swiglu(
            buf_GSD.reshape(G, E, cap, D).transpose(1, 0, 2, 3),
            self.experts.weights(),
            self.dtype,
            filled_ES=filled_GE.T,
            impl=self._impl(),
        )
        y_GSD = y_EGCD.transpose(1, 0, 2, 3).reshape(G, E * cap, D)
        return jax.vmap(self._combine)(y_GSD, slot_GbTK, w_GbTK)

    def _gathered(
        self, x_BTD, experts_BTK, w_BTK, keep_BTK, weights=None, reduce_axis=None
    ) -> jax.Array:
        """Every assignment through its own expert's gathered weights: [B, T, K, D, F] reads.
        `weights`: expert weight arrays to gather from (default: the module's own, whose int8
        gather reads only the picked rows); `reduce_axis`: they hold a shard of the hidden dim
        (tensor parallelism), and the partial down projections are summed over it."""
        ex, dt = self.experts, self.dtype
        if weights is None:
            pick = lambda n: getattr(ex, n)[experts_BTK].astype(dt) if hasattr(ex, n) else 0
        else:
            pick = lambda n: weights[n][experts_BTK].astype(dt) if n in weights else 0
        if self.cfg.route_scale == "input":
            x_BTKD = x_BTD[:, :, None, :] * w_BTK[..., None]
        else:
            x_BTKD = jnp.broadcast_to(x_BTD[:, :, None, :], (*experts_BTK.shape, x_BTD.shape[-1]))
        gate = rows_matmul(x_BTKD, pick("w_gate")) + pick("gate_bias")
        up = rows_matmul(x_BTKD, pick("w_up")) + pick("up_bias")
        y_BTKD = rows_matmul(jax.nn.silu(gate) * up, pick("w_down"))
        if reduce_axis is not None:
            y_BTKD = jax.lax.psum(y_BTKD, reduce_axis)
        y_BTKD = y_BTKD + pick("down_bias")
        if self.cfg.route_scale == "output":
            y_BTKD = y_BTKD * w_BTK[..., None]
        return jnp.sum(jnp.where(keep_BTK[..., None], y_BTKD, 0), axis=2)
