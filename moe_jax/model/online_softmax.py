"""Attention of a chunk of queries to a long run of keys, one block of keys at a time with an
online softmax (flash-attention's loop, in XLA): the context axis's attention
(context_parallel.py), where a shard's queries face a whole row's keys (all-gather) or
another shard's block of them (ring), and neither a [C, T] array of logits nor one of
probabilities may exist at 128k tokens.

Forward: a loop over key blocks of `block` keys keeps each query row's running max, softmax
denominator and value sum, rescaled when a later block raises the max; each step's logits
are [Tq, block]. Backward (`jax.custom_vjp`): keeps only q, k, v, the output and the rows'
log-sum-exp, and loops over the key blocks again, recomputing each block's probabilities
from them, so memory grows with the sequence, not its square.

The keys' row indices must increase along the keys (row order after an all-gather; a ring
block's two chunks, i then 2N-1-i): the blocks a causal (and windowed) query chunk cannot
see are then those past its last query (or before its first query's window), and the loops
skip them, their bounds computed on the device (a shard's chunk index is known only there).
The backward is written by hand, never derived from the loops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax.model.attention_core import attention_mask

NEG = jnp.finfo(jnp.float32).min  # a masked logit: exp(NEG - a real max) is 0


def pick_block(C: int, largest: int) -> int:
    """The key block: the largest divisor of `C` (a chunk's tokens, which the blocks tile)
    at most `largest`."""
    return max(d for d in range(1, min(C, largest) + 1) if C % d == 0)


def block_range(q_idx_T, k_idx_S, block: int, window: int):
    """(lo, hi) int32: the key blocks [lo, hi) that queries at row indices `q_idx_T` can see
    (keys at indices <= the last query's, and with a window > the first query's - window),
    `k_idx_S` increasing. Every query sees its own key, so hi > lo."""
    first_S = k_idx_S[::block]  # each block's first and last key index
    last_S = k_idx_S[block - 1 :: block]
    hi = jnp.sum(first_S <= jnp.max(q_idx_T)).astype(jnp.int32)
    lo = jnp.int32(0)
    if window > 0:
        lo = jnp.sum(last_S <= jnp.min(q_idx_T) - window).astype(jnp.int32)
    return lo, jnp.maximum(hi, lo + 1)


def _block_logits(statics, q_bTKGD, k_bSKD, qinfo, kinfo, j):
    """Key block `j`: (its keys, `take(a, axis)` slicing another per-key array to it, the
    masked logits [b, K, G, Tq, block], the mask [b, 1, 1, Tq, block])."""
    block, window, chunk_size, _ = statics
    q_pos, q_idx, q_seg = qinfo
    k_pos, k_idx, k_seg = kinfo
    start = j * block
    take = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, start, block, axis)
    k_bBKD = take(k_bSKD, 1)
    segments = None if q_seg is None else (q_seg, take(k_seg, 1))
    mask_bTB = attention_mask(q_pos, take(k_pos, 1), order=(q_idx, take(k_idx, 0)),
                              segments=segments, window=window, chunk_size=chunk_size)  # fmt: skip
    logits = jnp.einsum("btkgd,bskd->bkgts", q_bTKGD, k_bBKD, preferred_element_type=jnp.float32)
    mask = mask_bTB[:, None, None]
    return k_bBKD, take, jnp.where(mask, logits, NEG), mask


def _carry_maker(*operands):
    """-> `full(shape, value)`: float32 arrays to start a loop's carry, varying over the mesh
    axes the `operands` vary over inside a `shard_map`, as the loop's body makes them (the
    sum of none of their elements: a 0 of that type, whatever jax version names it)."""
    zero = sum(jnp.sum(a.ravel()[:0]).astype(jnp.float32) for a in operands)
    return lambda shape, value: jnp.full(shape, value, jnp.float32) + zero


def _over_blocks(statics, qinfo, kinfo, step, init):
    """`step(j, carry)` over the key blocks j the queries can see, in order: a loop of a
    static number of trips (`statics`' max_blocks, or every block), so that the compiled
    program's loops have known trip counts (aot's FLOPs count them), each trip past the
    visible blocks skipped by a `cond`."""
    block, window, _, max_blocks = statics
    lo, hi = block_range(qinfo[1], kinfo[1], block, window)
    n_blocks = kinfo[1].shape[0] // block
    trips = min(max_blocks or n_blocks, n_blocks)

    def trip(t, carry):
        j = lo + t
        return jax.lax.cond(j < hi, lambda c: step(j, c), lambda c: c, carry)

    return jax.lax.fori_loop(0, trips, trip, init)


def _forward(statics, q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo):
    b, T, K, G, _ = q_bTKGD.shape
    hv = v_bSKD.shape[-1]

    def step(j, carry):  # one key block: the running max, denominator and value sum
        max_bKGT, denom_bKGT, acc_bKGTV = carry
        _, take, logits, _ = _block_logits(statics, q_bTKGD, k_bSKD, qinfo, kinfo, j)
        new_max = jnp.maximum(max_bKGT, jnp.max(logits, axis=-1))
        weights = jnp.exp(logits - new_max[..., None])
        rescale = jnp.exp(max_bKGT - new_max)
        pv = jnp.einsum("bkgts,bskv->bkgtv", weights.astype(v_bSKD.dtype), take(v_bSKD, 1),
                        preferred_element_type=jnp.float32)  # fmt: skip
        denom = denom_bKGT * rescale + jnp.sum(weights, axis=-1)
        return new_max, denom, acc_bKGTV * rescale[..., None] + pv

    full = _carry_maker(q_bTKGD, k_bSKD, v_bSKD)
    init = (full((b, K, G, T), NEG), full((b, K, G, T), 0.0), full((b, K, G, T, hv), 0.0))
    max_bKGT, denom_bKGT, acc_bKGTV = _over_blocks(statics, qinfo, kinfo, step, init)
    out_bTKGV = (acc_bKGTV / denom_bKGT[..., None]).transpose(0, 3, 1, 2, 4)
    lse_bTKG = (max_bKGT + jnp.log(denom_bKGT)).transpose(0, 3, 1, 2)
    return out_bTKGV, lse_bTKG


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(statics, q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo):
    """Softmax attention of queries (scaled) [b, Tq, K, G, hd] to keys [b, S, K, hd] and
    values [b, S, K, hv], grouped by key/value head: (out float32 [b, Tq, K, G, hv]
    normalised over these keys, the rows' log-sum-exp float32 [b, Tq, K, G]; both
    differentiable). `statics` = (block, window, chunk_size, max_blocks): the key block
    (dividing S), attention_mask's window and chunks, and at least as many key blocks as
    these queries can see (0: all); `qinfo`, `kinfo` = (positions [b, n], row
    indices [n], segments [b, n] or None) of the queries and keys. A row that sees no key
    here gets a log-sum-exp near float32's min: a merge with other keys weighs it 0."""
    return _forward(statics, q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo)


def _attend_fwd(statics, q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo):
    out, lse = _forward(statics, q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo)
    return (out, lse), (q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo, out, lse)


def _attend_bwd(statics, residuals, cotangents):
    q_bTKGD, k_bSKD, v_bSKD, qinfo, kinfo, out, lse = residuals
    dout_bTKGV, dlse_bTKG = cotangents
    f32 = jnp.float32
    block = statics[0]
    heads_first = lambda a: jnp.moveaxis(a, 1, -1 if a.ndim == 4 else -2)  # T after K, G
    dout_bKGTV, lse_bKGT = heads_first(dout_bTKGV.astype(f32)), heads_first(lse)
    # d logits = P (dP - rowsum(dO O) + d lse): the softmax's backward, and lse's (its
    # gradient in the logits is P)
    shift_bKGT = heads_first(dlse_bTKG) - jnp.sum(dout_bKGTV * heads_first(out), axis=-1)

    def step(j, carry):  # one key block, its probabilities recomputed from lse
        dq_bTKGD, dk_bSKD, dv_bSKD = carry
        k_bBKD, take, logits, mask = _block_logits(statics, q_bTKGD, k_bSKD, qinfo, kinfo, j)
        probs = jnp.where(mask, jnp.exp(logits - lse_bKGT[..., None]), 0.0)
        v_bBKV = take(v_bSKD, 1)
        dprobs = jnp.einsum("bkgtv,bskv->bkgts", dout_bKGTV, v_bBKV, preferred_element_type=f32)
        dlogits = probs * (dprobs + shift_bKGT[..., None])
        dq = jnp.einsum("bkgts,bskd->btkgd", dlogits, k_bBKD, preferred_element_type=f32)
        dk = jnp.einsum("bkgts,btkgd->bskd", dlogits, q_bTKGD, preferred_element_type=f32)
        dv = jnp.einsum("bkgts,bkgtv->bskv", probs, dout_bKGTV, preferred_element_type=f32)
        put = lambda a, d: jax.lax.dynamic_update_slice_in_dim(a, d, j * block, 1)
        return dq_bTKGD + dq, put(dk_bSKD, dk), put(dv_bSKD, dv)  # each block visited once

    full = _carry_maker(q_bTKGD, k_bSKD, v_bSKD, dout_bTKGV, dlse_bTKG)
    zeros = lambda a: full(a.shape, 0.0)
    init = (zeros(q_bTKGD), zeros(k_bSKD), zeros(v_bSKD))
    dq, dk, dv = _over_blocks(statics, qinfo, kinfo, step, init)
    cast = lambda d, a: d.astype(a.dtype)
    return cast(dq, q_bTKGD), cast(dk, k_bSKD), cast(dv, v_bSKD), None, None


attend.defvjp(_attend_fwd, _attend_bwd)
