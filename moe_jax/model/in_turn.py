"""Weights stored in 16 bits, converted to a wider compute dtype in their turn and in parts.

    w_DF = in_turn.dense(v[...], dtype, x_ND)        # once x_ND exists
    logits_BTV = in_turn.vocab_logits(x_BTD, head_DV, 1, dtype)   # a chunk of V at a time
    y_ECD = in_turn.by_expert_groups(fn, x_ECD, w, dtype)          # a group of experts at a time

Sampling a checkpoint's bf16 weights on CPU (`sample.weights=bfloat16`) computes in float32
(`backends.COMPUTE_DTYPE`), so every weight is converted where it is used: XLA:CPU has no bf16
matmul (a bf16 dot converts both operands to float32), nor bf16 gathers and dynamic slices
(float normalization turns them into ones of a float32 copy of the whole array). Left to XLA,
those float32 copies were alive together: Qwen3-30B-A3B's width cut to one layer (2.32 GiB
of bf16 weights) compiled to a sampler with 4.78 GiB of temporaries
(benchmarks/results/hf_memory.md), for three reasons:
- the decode loop's invariant code motion hoists every conversion out of the loop, so a float32
  copy of each weight lives as long as the loop (an optimization barrier does not stop it:
  XLA:CPU removes barriers before it hoists);
- a conversion that depends on nothing but its weight is scheduled at the start of the
  program: every layer's float32 copies at once (4 layers: 10.4 GiB of temporaries even
  with the motion off);
- the head (1.16 GiB as float32) and a batched matmul over all experts (0.75 GiB a stack)
  convert a whole weight at once.

So where the backend converts in turn (`backends.converts_in_turn`: CPU), a 16-bit weight meets
a wider compute dtype through
- `dense`: whole, but only once its matmul's input x exists: the weight's bits get
  k = uint16(x[0] * 0) or-ed in, always 0 (a float 0 * x is 0 or NaN, which XLA converts to
  integer 0) and never folded by XLA, so the conversion waits for x (`int8.after` does the
  same for int8 weights);
- `vocab_logits`: the head a chunk of the vocabulary at a time (CHUNK_BYTES as float32);
- `by_expert_groups`: a batched matmul over the experts a group of them at a time, likewise;
and the sampler compiles without the loop-invariant code motion (`backends.loop_compiler_options`),
which would otherwise hoist these conversions, or the tie's bitcast as a copy of the weight,
out of the decode loop again. Gathered rows (the embedding's, the picked experts') need
nothing more: once not hoisted, a gather converts only the rows it reads.

Only where and when a conversion runs changes, and the values converted are the same. The
head's chunks are smaller matmuls, which XLA:CPU sums in another order where several rows
share them (one row, as a batch of one decodes, gives the same logits bit for bit; four rows,
logits ~1e-7 apart), so a sampled token could change only at a tie within float32 rounding
(none did: tests/test_sampling_memory.py). Elsewhere (float32 weights; the accelerators,
whose compute dtype is the weights' bf16) each weight is `w.astype(dtype)` as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax import backends

# The most bytes of one part of a weight in the compute dtype: a chunk of the head, a group of
# experts (Qwen3-30B-A3B: 19 chunks of its 1.16 GiB float32 head, groups of 8 of 128 experts).
CHUNK_BYTES = 64 * 2**20


def in_turn(stored, dtype) -> bool:
    """Whether a weight stored as `stored` is converted in turn and in parts for `dtype`: a
    16-bit float widened, on a backend that converts in turn."""
    stored, dtype = jnp.dtype(stored), jnp.dtype(dtype)
    narrow = jnp.issubdtype(stored, jnp.floating) and stored.itemsize == 2
    return narrow and dtype.itemsize > 2 and backends.converts_in_turn()


def any_in_turn(tree, dtype) -> bool:
    """Whether any array of `tree` (params, abstract or not) is converted in turn."""
    return any(in_turn(a.dtype, dtype) for a in jax.tree.leaves(tree))


def dense(w: jax.Array, dtype, x: jax.Array) -> jax.Array:
    """`w` in `dtype`; converted in turn: only once `x` (its matmul's input) exists."""
    if not in_turn(w.dtype, dtype):
        return w.astype(dtype)
    return _converted_after(w, x, jnp.dtype(dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _converted_after(w, x, dtype):
    k = (x.reshape(-1)[0].astype(jnp.float32) * 0.0).astype(jnp.uint16)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16) | k
    return jax.lax.bitcast_convert_type(bits, w.dtype).astype(dtype)


@_converted_after.defjvp
def _converted_after_jvp(dtype, primals, tangents):
    # w's conversion, whose bits' detour has no derivative of its own; none in x (k is 0)
    return _converted_after(*primals, dtype), tangents[0].astype(dtype)


def vocab_logits(x_BTD: jax.Array, table: jax.Array, vocab_axis: int, dtype) -> jax.Array:
    """float32 logits [B, T, V] of `x_BTD` and the head `table` ([D, V] with `vocab_axis` 1; a
    tied embedding [V, D] with 0), in `dtype`. Converted in turn, the vocabulary goes in
    chunks of at most CHUNK_BYTES once converted, in a loop: one chunk's copy at a time."""
    V, D = table.shape[vocab_axis], table.shape[1 - vocab_axis]

    def logits(w, x_tied):
        w_DC = dense(w, dtype, x_tied)
        return (x_BTD @ (w_DC.T if vocab_axis == 0 else w_DC)).astype(jnp.float32)

    n = -(-V * D * jnp.dtype(dtype).itemsize // CHUNK_BYTES)
    if not in_turn(table.dtype, dtype) or n == 1:
        return logits(table, x_BTD)
    width = -(-V // n)

    def chunk(i, out_BTV):
        # The last chunk ends at V, overlapping the one before: the same logits again.
        start = jnp.minimum(i * width, V - width)
        w = jax.lax.dynamic_slice_in_dim(table, start, width, axis=vocab_axis)
        return jax.lax.dynamic_update_slice_in_dim(out_BTV, logits(w, x_BTD), start, axis=-1)

    return jax.lax.fori_loop(0, n, chunk, jnp.zeros((*x_BTD.shape[:-1], V), jnp.float32))


def by_expert_groups(fn: Callable, x_E: jax.Array, w: dict, dtype) -> jax.Array:
    """`fn(x_E, w)` (experts leading every array, or none: `fn` takes one expert's arrays
    too; `fn` converts `w`) run on groups of experts whose weights come to at most
    CHUNK_BYTES each once converted, in a loop, where `w` is converted in turn; else at
    once."""
    if not any_in_turn(w, dtype):
        return fn(x_E, w)
    E = x_E.shape[0]
    per_expert = max(a[0].size for a in w.values()) * jnp.dtype(dtype).itemsize
    G = max(g for g in range(1, E + 1) if E % g == 0 and (g == 1 or g * per_expert <= CHUNK_BYTES))
    if G == E:  # one group: the whole stacks, converted once x_E exists
        return fn(x_E, {n: dense(a, dtype, x_E) for n, a in w.items()})
    if G == 1:  # one expert at a time, without a size-1 group axis (XLA:CPU laid the
        # bf16 stacks reshaped to [E, 1, ...] out with that axis first: a copy of each)
        return jax.lax.map(lambda xw: fn(*xw), (x_E, w))
    groups = lambda a: a.reshape(E // G, G, *a.shape[1:])
    y = jax.lax.map(lambda xw: fn(*xw), (groups(x_E), {n: groups(a) for n, a in w.items()}))
    return y.reshape(E, *y.shape[2:])
