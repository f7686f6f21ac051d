"""Training's gathers of the non-expert weights, one batch axis (or group) at a time.

These weights are split over every batch axis on their model dim (ZeRO-3,
`sharding.LOGICAL_RULES`: fsdp x expert). Left to XLA's partitioner, each is gathered over
all of those axes at once and its gradient reduced over all of them at once; on v5p-128's
fsdp 8 x expert 8 libtpu turns such collectives over the whole 64-chip torus into
all-reduces (a zero-padded buffer summed to gather, the whole gradient summed then sliced),
where collectives over 8 chips stay what they are (benchmarks/results/aot.md). With
`mesh.weight_gather=steps` (TPU's auto, `backends.WEIGHT_GATHER`) the matmul runs inside a
`shard_map` over each device's rows that gathers its weight over `expert`, then over `fsdp`,
in the compute dtype: two all-gathers of 8, and for the gradient their transposes, two
reduce-scatters. An axis longer than `mesh.gather_group` (fsdp 64: one axis over the whole
torus) is gathered in steps of at most that many devices too: within groups of consecutive
devices, then across the groups (`axis_index_groups`); so are the expert weights inside the
MoE's map. The embedding and the head go in blocks of the vocabulary (`TABLE_BLOCK_BYTES`).

    with gathering(backends.weight_gather(...), backends.gather_group(...)):  # train step
        q_BTHK = einsum("btd,dhk->bthk", x_BTD, attn.wq, dtype)  # w [D, H, K], D gathered
        y_BTD = einsum("bthk,hkd->btd", o_BTHK, attn.wo, dtype)  # heads' partials summed
        x_BTD = lookup(tokens_BT, embedding, dtype)               # the embedding's rows
        stats = head_statistics(loss_stats, normed_BTD, targets_BT, chunk, head_DV)  # head

Only the train step's trace gathers this way (sampling lays its weights out by other sharding rules,
`sharding.INFERENCE_RULES`), and only where two steps split the weight's model dim; a batch
the batch axes do not divide runs replicated, and a vocabulary split over `tensor` keeps the
partitioner's embedding and head.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.model import in_turn
from moe_jax.sharding import context_size, logical_to_spec, n_batch_shards, split_batch_axes

# (gather by steps, the largest group one collective spans: 0 = whole axes)
_mode: contextvars.ContextVar[tuple[bool, int]] = contextvars.ContextVar(
    "weight_gather", default=(False, 0)
)


@contextlib.contextmanager
def gathering(mode: str, group: int = 0):
    """Trace the train step with the non-expert weights gathered by `mode` ("steps" |
    "partitioner"), the steps' collectives spanning at most `group` devices (0: whole axes)."""
    token = _mode.set((mode == "steps", group if mode == "steps" else 0))
    try:
        yield
    finally:
        _mode.reset(token)


def _axes(entry, mesh) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry that split anything (size > 1)."""
    names = entry if isinstance(entry, tuple) else (entry,)
    return tuple(n for n in names if n is not None and mesh.shape[n] > 1)


def steps(axes: tuple[str, ...], mesh) -> tuple[tuple[str, list | None], ...]:
    """The collectives that gather a dim split over `axes` (major first), major first: each
    axis whole (groups None), or one longer than the traced gather group in steps of at most
    that many devices (`axis_index_groups`): the rest the groups do not tile first, within
    groups of that many consecutive indices, then the groups across them, then across those
    (fsdp 256 in groups of 8: 4, 8, 8; expert 16: 2, 8). The gradient leaves in the reverse
    order, so its first reduce-scatters divide the dim by the groups' size and the rest's
    comes last: libtpu (0.0.42) made a reduce-scatter along a weight's minor dim whose result
    is an odd multiple of 128 elements into an all-reduce, and Llama 4's 5120-wide model dim
    after fsdp 4 then a step of 2 was 640 such (benchmarks/results/aot.md)."""
    group, out = _mode.get()[1], []
    for ax in axes:
        n = mesh.shape[ax]
        if not (group and n > group and n % group == 0):
            out.append((ax, None))
            continue
        # the digits' sizes, minor first: the rest the groups do not tile, then the groups
        k = 0
        while n % group ** (k + 1) == 0:
            k += 1
        rest = n // group**k
        sizes = ([rest] if rest > 1 else []) + [group] * k
        levels, stride = [], 1  # minor first: (stride, size) of each digit of the index
        for size in sizes:
            levels.append((stride, size))
            stride *= size
        for stride, size in reversed(levels):
            bases = [i for i in range(n) if (i // stride) % size == 0]
            out.append((ax, [[b + j * stride for j in range(size)] for b in bases]))
    return tuple(out)


def gather(w, plan, dim: int):
    """w whole along `dim`, split there as `plan` (`steps`) says: gathered minor step first,
    each gather's transpose one reduce-scatter over that step's devices alone."""
    for ax, groups in reversed(plan):
        w = jax.lax.all_gather(w, ax, axis=dim, tiled=True, axis_index_groups=groups, to="varying")
    return w


def gather_leading(w, plan, dim: int):
    """`gather(w, plan, dim)` done on a new leading shard axis, then put in place (a copy):
    libtpu turned some reduce-scatters of gradients along a minor dim into all-reduces (a
    row window's expert weights, the embedding, a down projection [F, D]), where along a
    leading axis they stay reduce-scatters. Not everywhere: the attention's out-projections
    [H, K, D] gathered so came back as more all-reduces (Llama 4, 4 layers: 0.17 -> 0.27 GiB
    a step); their gradients' layout already puts D major."""
    g_S = gather(w[None], plan, 0)  # [shards, *w.shape]
    return jnp.moveaxis(g_S, 0, dim).reshape(*w.shape[:dim], -1, *w.shape[dim + 1 :])


def _steps_mesh(x_B):
    """The mesh to gather by steps on, or None where the partitioner gathers: not tracing
    the train step, no mesh, or rows `x_B` [B, ...] the batch axes do not divide. Under a
    context axis too: the steps' maps take whole rows, and would gather the sequence."""
    mesh = jax.sharding.get_abstract_mesh()
    if not _mode.get()[0] or mesh.empty or x_B.shape[0] % n_batch_shards(mesh):
        return None
    if context_size(mesh) > 1:
        return None
    return mesh


def _spec(*entries) -> P:
    return P(*(e or None for e in entries))


def einsum(subscripts: str, x_B, v: nnx.Variable, dtype) -> jax.Array:
    """`jnp.einsum(subscripts, x_B, w)` for rows `x_B` [B, ...] (B: subscripts' first
    letter) and a weight w (v's value, in `dtype`) whose model dim ("embed") is split over
    the batch axes. By steps: each device's rows, w's model dim gathered, its other dims as
    split (x's dims that w splits too split alike), the partial sums of contracted split dims
    added over their axes. A 16-bit w for a wider `dtype` is converted once x_B exists
    (`in_turn.dense`)."""
    w = in_turn.dense(v[...], dtype, x_B)
    lhs, rest = subscripts.split(",")
    rhs, out = rest.split("->")
    mesh, names = _steps_mesh(x_B), v.get_metadata().get("out_sharding")
    if mesh is None or not names:
        return rows_einsum(subscripts, x_B, w)
    # a scanned layer's weight is one slice of its stack, whose names lead with "layers"
    names = tuple(names)[len(names) - w.ndim :]
    spec = logical_to_spec(names)
    model = names.index("embed")
    plan = steps(_axes(spec[model], mesh), mesh)
    if len(plan) < 2:  # one gather either way
        return jnp.einsum(subscripts, x_B, w)
    split = {c: _axes(e, mesh) for c, e in zip(rhs, spec, strict=True)}
    split[rhs[model]] = ()
    rows = split_batch_axes(mesh)
    x_spec = _spec(rows, *(split.get(c) for c in lhs[1:]))
    y_spec = _spec(rows, *(split.get(c) for c in out[1:]))
    w_spec = _spec(*(_axes(e, mesh) for e in spec))
    summed = tuple(ax for c in rhs if c in lhs and c not in out for ax in split[c])

    # a matrix gathered along its minor dim (the MLPs' down projection [F, D]) goes on a
    # leading shard axis: Llama 4's shared experts' gradients were otherwise all-reduced
    one = gather_leading if w.ndim == 2 and model == 1 else gather

    def local(x, w):
        y = jnp.einsum(subscripts, x, one(w, plan, model))
        return jax.lax.psum(y, summed) if summed else y

    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=y_spec)(x_B, w)


# XLA:GPU makes a one-row product (decoding at batch 1) a multiply and a reduction, not a GEMM:
# the out-projection's [H, K, D] products were written whole and then summed (~10 us of a
# layer's ~170 on an H200), the q projection a reduction at ~1 TB/s (2026-11-26 profile). Two
# rows, the second zero, make it a GEMM (`experts.rows_matmul` found the same). The GPU kit
# turns this off to time the difference.
TWO_ROWS_ON_GPU = True


def rows_einsum(subscripts: str, x_B, w) -> jax.Array:
    """`jnp.einsum(subscripts, x_B, w)` for rows x_B [B, ...], a single row on a GPU with a
    zero row beside it."""
    lhs, rest = subscripts.split(",")
    rhs, out = rest.split("->")
    rows = math.prod(n for c, n in zip(lhs, x_B.shape, strict=True) if c not in rhs)
    if rows != 1 or out[0] != lhs[0] or not TWO_ROWS_ON_GPU or backends.target() != "gpu":
        return jnp.einsum(subscripts, x_B, w)
    return jnp.einsum(subscripts, jnp.concatenate([x_B, jnp.zeros_like(x_B)]), w)[:1]


# The most bytes of the embedding or the head one gather makes whole: libtpu (0.0.42) turned
# the reduce-scatters of Llama 4's 1.93 GiB head gradient and Qwen3's 0.58 into all-reduces
# (v5p-128, fsdp 4 x expert 16), where blocks of the vocabulary of 0.24 GiB each, like the
# whole of Mixtral's head, stay reduce-scatters (benchmarks/results/aot.md).
TABLE_BLOCK_BYTES = 256 * 2**20


def _gather_table(w, plan, dim: int, split: int):
    """A [V, D] / [D, V] table's local shard `w` gathered along its model dim `dim`, in
    blocks of the vocabulary (the other dim) of at most TABLE_BLOCK_BYTES once whole (the
    model dim is split `split` ways), the embedding's on a leading shard axis."""
    vocab = 1 - dim
    n, whole = 1, w.size * w.dtype.itemsize * split
    while whole // n > TABLE_BLOCK_BYTES and w.shape[vocab] % (2 * n) == 0:
        n *= 2

    one = gather if dim == 0 else gather_leading
    blocks = [one(b, plan, dim) for b in jnp.split(w, n, axis=vocab)]
    return blocks[0] if n == 1 else jnp.concatenate(blocks, axis=vocab)


def _whole_vocab_plan(mesh, d_ax, v_ax):
    """The steps gathering a [D, V] / [V, D] table's model dim, or None where the partitioner
    gathers (one step, or a vocabulary split over `tensor`)."""
    plan = steps(d_ax, mesh)
    return None if len(plan) < 2 or v_ax else plan


def lookup(tokens_BT, v: nnx.Variable, dtype) -> jax.Array:
    """The embedding table's (v: [V, D]) rows of `tokens_BT`, in `dtype`. By steps, each
    device gathers the table in `dtype` and looks up its own rows; the gradient is summed
    into the device's whole table in float32, whose transpose then leaves in steps as
    reduce-scatters (left to the partitioner, a batch of several sequences per chip became a
    scatter-add into the whole fp32 table, all-reduced over every chip)."""
    mesh = _steps_mesh(tokens_BT)
    plan = None
    if mesh is not None:
        v_ax, d_ax = (_axes(e, mesh) for e in logical_to_spec(("vocab", "embed")))
        plan = _whole_vocab_plan(mesh, d_ax, v_ax)
    if plan is None:
        return v[...][tokens_BT].astype(dtype)
    rows = split_batch_axes(mesh)

    split = math.prod(mesh.shape[ax] for ax in d_ax)

    def local(t, table):
        # the float32 round trip keeps the gradient's scatter-add in float32
        return _gather_table(table, plan, 1, split).astype(jnp.float32)[t].astype(dtype)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(_spec(rows), _spec(None, d_ax)), out_specs=_spec(rows)
    )(tokens_BT, v[...].astype(dtype))


def head_statistics(statistics, normed_BTD, targets_BT, chunk: int, head_DV):
    """`statistics` (`loss.head_statistics`, passed in: the model does not import the loss)
    of the final norm's output, the head [D, V] gathered by steps inside the shard_map that
    runs the loss's chunks over each device's rows; None where the partitioner gathers (as for
    the projections, and where `tensor` splits the vocabulary: the logsumexp would then span
    devices)."""
    mesh = _steps_mesh(normed_BTD)
    if mesh is None:
        return None
    d_ax, v_ax = (_axes(e, mesh) for e in logical_to_spec(("embed", "vocab")))
    plan = _whole_vocab_plan(mesh, d_ax, v_ax)
    if plan is None:
        return None
    rows = split_batch_axes(mesh)
    logits = lambda x_BcD, w_DV: (x_BcD @ w_DV).astype(jnp.float32)

    split = math.prod(mesh.shape[ax] for ax in d_ax)

    def local(x, t, w):
        return statistics(logits, x, t, chunk, _gather_table(w, plan, 0, split))

    return jax.shard_map(
        local, mesh=mesh, in_specs=(_spec(rows), _spec(rows), _spec(d_ax)), out_specs=_spec(rows)
    )(normed_BTD, targets_BT, head_DV)
