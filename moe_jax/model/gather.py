"""Training's gathers of the attention weights and the head, one batch axis at a time.

These weights are split over every batch axis on their model dim (ZeRO-3,
`sharding.LOGICAL_RULES`: fsdp x expert). Left to XLA's partitioner, each is gathered over
all of those axes at once and its gradient reduced over all of them at once; on v5p-128's
fsdp 8 x expert 8 libtpu turns such collectives over the whole 64-chip torus into
all-reduces (a zero-padded buffer summed to gather, the whole gradient summed then sliced),
where collectives over 8 chips stay what they are (benchmarks/README.md). With
`mesh.weight_gather=steps` (TPU's auto, `backends.WEIGHT_GATHER`) the matmul runs inside a
`shard_map` over each device's rows that gathers its weight over `expert`, then over `fsdp`,
in the compute dtype: two all-gathers of 8, and for the gradient their transposes, two
reduce-scatters.

    with gathering(backends.weight_gather(cfg.mesh.weight_gather)):   # the train step's trace
        q_BTHK = project(x_BTD, attn.wq, dtype)      # x [B, T, D] @ w [D, H, K]
        y_BTD = out_project(o_BTHK, attn.wo, dtype)  # o [B, T, H, K] @ w [H, K, D]
        stats = head_statistics(loss_stats, normed_BTD, targets_BT, chunk, head_DV)  # head

Only the train step's trace gathers this way (sampling lays its weights out by other rules,
`sharding.INFERENCE_RULES`), and only where two axes split the weight; a batch the batch
axes do not divide runs replicated, and a vocabulary split over `tensor` keeps the
partitioner's head.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.sharding import logical_to_spec, n_batch_shards, split_batch_axes

_steps: contextvars.ContextVar[bool] = contextvars.ContextVar("weight_gather_steps", default=False)


@contextlib.contextmanager
def gathering(mode: str):
    """Trace the train step with the attention weights and the head gathered by `mode`
    ("steps" | "partitioner")."""
    token = _steps.set(mode == "steps")
    try:
        yield
    finally:
        _steps.reset(token)


def _axes(entry, mesh) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry that split anything (size > 1)."""
    names = entry if isinstance(entry, tuple) else (entry,)
    return tuple(n for n in names if n is not None and mesh.shape[n] > 1)


def _steps_mesh(x_B):
    """The mesh to gather by steps on, or None where the partitioner gathers: not tracing
    the train step, no mesh, or rows `x_B` [B, ...] the batch axes do not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if not _steps.get() or mesh.empty or x_B.shape[0] % n_batch_shards(mesh):
        return None
    return mesh


def _by_steps(x, v: nnx.Variable, w, dim: int):
    """-> (mesh, the split axes of each dim of `w` (v's value), the rows' axes), or None where
    the partitioner gathers (`_steps_mesh`, or a model dim `dim` split over fewer than two
    axes: one gather either way)."""
    mesh = _steps_mesh(x)
    names = v.get_metadata().get("out_sharding")
    if mesh is None or not names:
        return None
    spec = logical_to_spec(tuple(names))
    # a scanned layer's weight is one slice of its stack, whose names lead with "layers"
    split = [_axes(e, mesh) for e in spec[len(spec) - w.ndim :]]
    return (mesh, split, split_batch_axes(mesh)) if len(split[dim]) > 1 else None


def _gather(w, axes: tuple[str, ...], dim: int):
    """w whole along `dim`, split there over `axes` (major first): gathered minor axis first,
    each gather's transpose one reduce-scatter over that axis alone."""
    for ax in reversed(axes):
        w = jax.lax.all_gather(w, ax, axis=dim, tiled=True, to="varying")
    return w


def _spec(*entries) -> P:
    return P(*(e or None for e in entries))


def project(x_BTD: jax.Array, v: nnx.Variable, dtype) -> jax.Array:
    """x [B, T, D] @ w [D, H, K] -> [B, T, H, K], w's model dim split over batch axes."""
    w_DHK = v[...].astype(dtype)
    plan = _by_steps(x_BTD, v, w_DHK, 0)
    if plan is None:
        return jnp.einsum("btd,dhk->bthk", x_BTD, w_DHK)
    mesh, (d_ax, h_ax, k_ax), rows = plan

    def local(x, w):
        return jnp.einsum("btd,dhk->bthk", x, _gather(w, d_ax, 0))

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(_spec(rows), _spec(d_ax, h_ax, k_ax)),
        out_specs=_spec(rows, None, h_ax, k_ax),
    )(x_BTD, w_DHK)


def out_project(o_BTHK: jax.Array, v: nnx.Variable, dtype) -> jax.Array:
    """o [B, T, H, K] @ w [H, K, D] -> [B, T, D], w's model dim split over batch axes (the
    heads' partial sums added over the axis that splits them)."""
    w_HKD = v[...].astype(dtype)
    plan = _by_steps(o_BTHK, v, w_HKD, 2)
    if plan is None:
        return jnp.einsum("bthk,hkd->btd", o_BTHK, w_HKD)
    mesh, (h_ax, k_ax, d_ax), rows = plan

    def local(o, w):
        y = jnp.einsum("bthk,hkd->btd", o, _gather(w, d_ax, 2))
        return jax.lax.psum(y, h_ax + k_ax) if h_ax + k_ax else y

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(_spec(rows, None, h_ax, k_ax), _spec(h_ax, k_ax, d_ax)),
        out_specs=_spec(rows),
    )(o_BTHK, w_HKD)


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
    if len(d_ax) < 2 or v_ax:
        return None
    rows = split_batch_axes(mesh)
    logits = lambda x_BcD, w_DV: (x_BcD @ w_DV).astype(jnp.float32)

    def local(x, t, w):
        return statistics(logits, x, t, chunk, _gather(w, d_ax, 0))

    return jax.shard_map(
        local, mesh=mesh, in_specs=(_spec(rows), _spec(rows), _spec(d_ax)), out_specs=_spec(rows)
    )(normed_BTD, targets_BT, head_DV)
