"""Context parallelism: every sequence split over the mesh's `context` axis (mesh.context = N)
through the whole layer stack, and attention across the shards.

Layout. Under causal attention the last tokens of a row see the most keys, so N contiguous
shards would give the last one N times the first one's attention work. The row is instead
cut into 2N chunks of C = T / 2N tokens and shard i holds chunks i and 2N-1-i, in that order
(the order torchtitan and Llama 3 use): every shard then attends (i + 1) + (2N - i) = 2N + 1
chunks' worth of keys. The step works on the row in this order (`to_layout`: a fixed
permutation of the tokens, their targets, positions, segments and loss weights alike, which
leaves a mean loss unchanged), so the layers' per-token work (norms, MLP, MoE, the head and
the loss) never needs to know; only attention does, for which token index ("order": the
causal mask and the window are by index in the row, see attention.py) each slot holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moe_jax.sharding import CONTEXT_AXIS, context_size, split_batch_axes


def layout_order(T: int, N: int) -> np.ndarray:
    """int32 [T]: the row index of the token at each slot of the load-balanced layout (shard
    i's slots hold chunks i then 2N-1-i)."""
    assert T % (2 * N) == 0, f"{T} tokens do not cut into 2 x {N} equal chunks"
    C = T // (2 * N)
    chunks = np.array([c for i in range(N) for c in (i, 2 * N - 1 - i)])
    return (chunks[:, None] * C + np.arange(C)).reshape(T).astype(np.int32)


def to_layout(a_BT: jax.Array, N: int) -> jax.Array:
    """[B, T, ...] in row order -> the same tokens in the layout of N context shards."""
    return a_BT if N == 1 else jnp.take(a_BT, layout_order(a_BT.shape[1], N), axis=1)


def from_layout(a_BT: jax.Array, N: int) -> jax.Array:
    """The inverse of `to_layout`: [B, T, ...] in the layout -> in row order."""
    if N == 1:
        return a_BT
    return jnp.take(a_BT, np.argsort(layout_order(a_BT.shape[1], N)), axis=1)


def layout_inputs(inputs: dict, targets_BT, weights_BT):
    """The step's inputs (tokens, positions, segments), targets and loss weights [B, T], all
    in row order -> in the layout of the active mesh's context axis, split over it. Positions
    are made explicit first (0..T-1 by default): in the layout they are no longer the slots."""
    mesh = jax.sharding.get_abstract_mesh()
    N = context_size(mesh)
    if N == 1:
        return inputs, targets_BT, weights_BT
    B, T = targets_BT.shape
    if "positions" not in inputs:
        inputs = inputs | {"positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}
    spec = P(split_batch_axes(mesh) or None, CONTEXT_AXIS)
    split = lambda a: jax.lax.with_sharding_constraint(to_layout(a, N), spec)
    return {k: split(a) for k, a in inputs.items()}, split(targets_BT), split(weights_BT)


def default_positions(B: int, T: int) -> jax.Array:
    """int32 [B, T] positions of unpacked rows: 0..T-1, in the layout of the active mesh's
    context axis (the model's inputs are in it under one)."""
    N = context_size()
    pos_T = layout_order(T, N) if N > 1 and T % (2 * N) == 0 else np.arange(T, dtype=np.int32)
    return jnp.broadcast_to(jnp.asarray(pos_T), (B, T))


def row_order(a_bS: jax.Array, N: int) -> jax.Array:
    """Gathered [b, S, ...] in shard order (shard i: chunks i, 2N-1-i) -> in row order: the
    first chunks of the shards in order, then their second chunks in reverse."""
    b, S = a_bS.shape[:2]
    C = S // (2 * N)
    a = a_bS.reshape(b, N, 2, C, *a_bS.shape[2:])
    first, second = a[:, :, 0], jnp.flip(a[:, :, 1], axis=1)
    return jnp.concatenate([first, second], axis=1).reshape(a_bS.shape)
