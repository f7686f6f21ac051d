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

Attention, mesh.context_strategy=all_gather: inside `jax.shard_map`, each shard gathers the
keys, values, positions and segments of its row from the other shards (`all_gather` over
`context`, whose transpose sends the keys' gradients back as one reduce-scatter), puts them
back in row order, and attends its two query chunks (`online_softmax`: a loop over key
blocks of at most KEY_BLOCK keys with an online softmax, whose backward recomputes each
block's probabilities): chunk i over the key blocks up to its own, chunk 2N-1-i over all of
them (a window's fewer: the blocks before its first query's window are skipped too), each
masked by index, window, chunk of positions and document as attention.py's blocked path
masks. No [C, T] array of logits or probabilities exists, forward or backward: a step's
logits are [C, KEY_BLOCK], what a shard keeps is its row's keys and values (linear in T).
Not built yet: the fused kernels (splash, cuDNN) on the gathered keys, and the window's
shortcut (a window shorter than a shard needs only the neighbouring shard's keys, and all
of them are gathered).
GQA gathers its K/V heads (`self_attention`); MLA gathers its normed latent and the shared
rope key, [R + dr] a token, and expands every head's keys and values from them on each
shard (`latent_attention`: the expansion is repeated N times, the gathered bytes are H (dn +
dr + dv) / (R + dr) times fewer than the expanded keys and values: 71x for DeepSeek-V3).

Attention, mesh.context_strategy=ring (`ring`): no shard holds the whole row's keys; the
key blocks (GQA's K/V, MLA's latent) go round the axis by `ppermute`, N steps, each shard
attending the block it holds (the next one's transfer free to overlap it), merged by their
rows' log-sum-exps. A block the causal order hides from a query chunk is not computed, so
every step after the first costs each shard the same [2C x C] logits, attended by
`online_softmax` as above, so no step's probabilities are kept for the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moe_jax.model import online_softmax
from moe_jax.model.online_softmax import pick_block
from moe_jax.sharding import BATCH_AXES, CONTEXT_AXIS, context_size, split_batch_axes

# The most keys one step of a query chunk's loop attends (online_softmax.py): [C, 512]
# float32 logits a step; the block is the largest divisor of the chunk C = T / 2N up to it.
KEY_BLOCK = 512


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


def active(T: int) -> bool:
    """Whether self-attention over `T` tokens runs split over a context axis (a mesh with
    context > 1 whose layout cuts T)."""
    N = context_size()
    return N > 1 and T % (2 * N) == 0


def _split_axes(mesh, B: int, H: int, K: int):
    """-> (the spec entry of the batch axes that split B rows, of the head axis): heads over
    `tensor` where it divides the query and key/value heads (the config checks it does)."""
    axes, n = [], 1
    for ax in BATCH_AXES:
        if mesh.shape[ax] > 1 and B % (n * mesh.shape[ax]) == 0:
            axes.append(ax)
            n *= mesh.shape[ax]
    tp = mesh.shape.get("tensor", 1)
    heads = "tensor" if tp > 1 and K % tp == 0 and H % tp == 0 else None
    return tuple(axes) or None, heads


def _map(local, mesh, batch, heads, args: list[tuple]):
    """`local` over the mesh on `args`, (array or None, its PartitionSpec) pairs, those
    None left out; the output [B, T, H, hv] split like the queries."""
    present = [(a, spec) for a, spec in args if a is not None]
    out = P(batch, CONTEXT_AXIS, heads, None)
    return jax.shard_map(
        local, mesh=mesh, in_specs=tuple(spec for _, spec in present), out_specs=out
    )(*(a for a, _ in present))


def _varying(a, batch):
    """`a` (the same on every shard of the batch axes and `context`: the sinks, MLA's
    up-projections) cast varying over them, so that its gradient is summed over them by the
    cast's transpose."""
    axes = (*(batch or ()), CONTEXT_AXIS)
    return jax.lax.pcast(a, axes, to="varying")


def self_attention(
    q_BTHD,
    k_BTKD,
    v_BTKD,
    pos_BT,
    seg_BT=None,
    *,
    scale,
    window=0,
    chunk_size=0,
    sinks_KG=None,
    strategy="all_gather",
    key_block=KEY_BLOCK,
) -> jax.Array:
    """Causal self-attention of the layout's tokens split over the active mesh's `context`
    axis, as `attention.blocked_self_attention` computes it for the same tokens in row order
    (q scaled by `scale`; the masks and sinks as it takes them): K/V heads gathered, or
    passed round the ring (`strategy`, mesh.context_strategy); `key_block`: the most keys
    a step of attention's loops takes."""
    mesh = jax.sharding.get_abstract_mesh()
    N = context_size(mesh)
    batch, heads = _split_axes(mesh, q_BTHD.shape[0], q_BTHD.shape[2], k_BTKD.shape[2])
    x, ids = P(batch, CONTEXT_AXIS, heads, None), P(batch, CONTEXT_AXIS)

    def local(q_bTHD, k_bTKD, v_bTKD, pos_bT, *rest):
        seg_bT = rest[0] if seg_BT is not None else None
        sinks = None if sinks_KG is None else _varying(rest[-1], batch)
        masks = dict(window=window, chunk_size=chunk_size, sinks_KG=sinks, key_block=key_block)
        if strategy == "ring":
            same = lambda kv: kv
            return ring(N, q_bTHD * scale, pos_bT, seg_bT, (k_bTKD, v_bTKD), same, **masks)
        keys = gather_rows(N, k_bTKD, v_bTKD, pos_bT, seg_bT)
        return two_chunks(N, q_bTHD * scale, pos_bT, seg_bT, *keys, **masks)

    args = [(q_BTHD, x), (k_BTKD, x), (v_BTKD, x), (pos_BT, ids), (seg_BT, ids)]
    return _map(local, mesh, batch, heads, [*args, (sinks_KG, P(heads))])


def latent_attention(
    q_BTHQ, c_BTR, k_pe_BT1P, wk_RHN, wv_RHV, pos_BT, seg_BT=None, *, scale,
    strategy="all_gather", key_block=KEY_BLOCK,
) -> jax.Array:  # fmt: skip
    """MLA's expanded self-attention (mla.py) split over the active mesh's `context` axis:
    the normed latent `c_BTR` and the rotated shared key `k_pe_BT1P` gathered, each head's
    k = [c W_uk | k_pe] and v = c W_uv made from them on every shard. `q_BTHQ`: [q_nope |
    q_pe]; `wk_RHN`, `wv_RHV`: the up-projections in the compute dtype. With the ring
    (`strategy`) the latent travels instead, each block expanded where it arrives."""
    mesh = jax.sharding.get_abstract_mesh()
    N = context_size(mesh)
    H = q_BTHQ.shape[2]
    batch, heads = _split_axes(mesh, q_BTHQ.shape[0], H, H)

    def local(q_bTHQ, c_bTR, k_pe_bT1P, wk_RhN, wv_RhV, pos_bT, *rest):
        seg_bT = rest[0] if rest else None
        wk_RhN, wv_RhV = _varying(wk_RhN, batch), _varying(wv_RhV, batch)

        def expand(latent):  # ([b, S, R], [b, S, 1, P]) -> every head's k and v
            c_bSR, k_pe_bS1P = latent
            k_nope_bShN = jnp.einsum("bsr,rhn->bshn", c_bSR, wk_RhN)
            v_bShV = jnp.einsum("bsr,rhv->bshv", c_bSR, wv_RhV)
            k_pe_bShP = jnp.broadcast_to(k_pe_bS1P, (*k_nope_bShN.shape[:3], k_pe_bS1P.shape[-1]))
            return jnp.concatenate([k_nope_bShN, k_pe_bShP], axis=-1), v_bShV

        if strategy == "ring":
            latent = (c_bTR, k_pe_bT1P)
            return ring(N, q_bTHQ * scale, pos_bT, seg_bT, latent, expand, key_block=key_block)
        c_bSR, k_pe_bS1P, kpos_bS, kseg_bS = gather_rows(N, c_bTR, k_pe_bT1P, pos_bT, seg_bT)
        k_bShQ, v_bShV = expand((c_bSR, k_pe_bS1P))
        keys = (k_bShQ, v_bShV, kpos_bS, kseg_bS)
        return two_chunks(N, q_bTHQ * scale, pos_bT, seg_bT, *keys, key_block=key_block)

    w, ids = P(None, heads, None), P(batch, CONTEXT_AXIS)
    args = [(q_BTHQ, P(batch, CONTEXT_AXIS, heads, None)), (c_BTR, P(batch, CONTEXT_AXIS, None)),
            (k_pe_BT1P, P(batch, CONTEXT_AXIS, None, None)), (wk_RHN, w), (wv_RHV, w),
            (pos_BT, ids), (seg_BT, ids)]  # fmt: skip
    return _map(local, mesh, batch, heads, args)


def row_order(a_bS: jax.Array, N: int) -> jax.Array:
    """Gathered [b, S, ...] in shard order (shard i: chunks i, 2N-1-i) -> in row order: the
    first chunks of the shards in order, then their second chunks in reverse."""
    b, S = a_bS.shape[:2]
    C = S // (2 * N)
    a = a_bS.reshape(b, N, 2, C, *a_bS.shape[2:])
    first, second = a[:, :, 0], jnp.flip(a[:, :, 1], axis=1)
    return jnp.concatenate([first, second], axis=1).reshape(a_bS.shape)


def gather_rows(N: int, *a_bT):
    """Each [b, T/N, ...] shard of the rows (None passes) gathered over `context` into the
    whole rows [b, T, ...], in row order."""
    gather = lambda a: jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True)
    return tuple(None if a is None else row_order(gather(a), N) for a in a_bT)


def two_chunks(N, q_bTHD, pos_bT, seg_bT, k_bSKD, v_bSKD, kpos_bS, kseg_bS, *, window=0,
               chunk_size=0, sinks_KG=None, key_block=KEY_BLOCK):  # fmt: skip
    """One shard's 2C queries (scaled; chunks i and 2N-1-i of the row, i its index on
    `context`) against its whole row's keys in row order, each chunk by `online_softmax`
    over the key blocks it can see (chunk i: the first i + 1 chunks' keys, a window's fewer)."""
    b, T2, H, hd = q_bTHD.shape
    K, C, S = k_bSKD.shape[2], T2 // 2, k_bSKD.shape[1]
    block = pick_block(C, key_block)
    q_idx = _slots(jax.lax.axis_index(CONTEXT_AXIS), C, N)
    kinfo = (kpos_bS, jnp.arange(S), kseg_bS)
    outs = []
    for half in (0, 1):  # apart: the first chunk's loop stops at its own keys
        # the most key blocks the chunk may see: the first half of the row (chunk i < N), or
        # all of it; with a window, the blocks its C queries' windows span
        most = (S // 2 if half == 0 else S) // block
        if window > 0:
            most = min(most, -(-(C + window - 1) // block) + 1)
        statics = (block, window, chunk_size, most)
        qs = _rows(dict(q=q_bTHD, pos=pos_bT, seg=seg_bT, idx=q_idx), half * C, (half + 1) * C)
        q_bCKGD = qs["q"].reshape(b, C, K, H // K, hd)
        qinfo = (qs["pos"], qs["idx"], qs["seg"])
        out, lse = online_softmax.attend(statics, q_bCKGD, k_bSKD, v_bSKD, qinfo, kinfo)
        outs.append(_with_sinks(out, lse, sinks_KG))
    return jnp.concatenate(outs, axis=1).reshape(b, T2, H, -1).astype(q_bTHD.dtype)


def _with_sinks(out_bTKGV, lse_bTKG, sinks_KG):
    """Softmax outputs over the keys -> over the keys and the sinks (a logit per head in
    every row's denominator, no value)."""
    if sinks_KG is None:
        return out_bTKGV
    total = jnp.logaddexp(lse_bTKG, sinks_KG.astype(jnp.float32))
    return out_bTKGV * jnp.exp(lse_bTKG - total)[..., None]


def ring(N, q_bTHD, pos_bT, seg_bT, sources: tuple, expand, *, window=0, chunk_size=0,
         sinks_KG=None, key_block=KEY_BLOCK):  # fmt: skip
    """One shard's 2C queries (scaled) against its row's keys, mesh.context_strategy=ring:
    the key `sources` (with their positions and segments) of each shard in turn, passed one
    step round the axis by `ppermute`, one block attended per step; `expand(sources)
    -> (k_bSKD, v_bSKD)` makes a block's keys and values. The blocks' partial softmaxes are
    merged by their log-sum-exps. The causal blocks that see nothing are skipped: a block
    from an earlier shard j < i is seen by both query chunks in its first chunk only (its
    second, 2N-1-j, lies after both), one from a later shard only by the second query chunk."""
    i = jax.lax.axis_index(CONTEXT_AXIS)
    C = q_bTHD.shape[1] // 2
    masks = dict(statics=(pick_block(C, key_block), window, chunk_size, 0))
    q_idx = _slots(i, C, N)
    ring_perm = [(j, (j + 1) % N) for j in range(N)]
    block = (sources, pos_bT, seg_bT)
    parts = []
    for step in range(N):
        j = (i - step) % N  # the shard whose keys this one holds at this step
        srcs, kpos_bS, kseg_bS = block
        k_bSKD, v_bSKD = expand(srcs)
        keys = dict(k=k_bSKD, v=v_bSKD, pos=kpos_bS, seg=kseg_bS, idx=_slots(j, C, N))
        queries = dict(q=q_bTHD, pos=pos_bT, seg=seg_bT, idx=q_idx)
        if step == 0:  # its own keys, causal within
            parts.append(_partial(queries, keys, **masks))
        else:
            parts.append(
                jax.lax.cond(
                    j < i,
                    lambda qs, ks: _partial(qs, _rows(ks, 0, C), **masks),
                    lambda qs, ks: _second_chunk_only(qs, ks, C, masks),
                    queries,
                    keys,
                )
            )
        # The next block, sent with no dependence on this step's attention, so that XLA's
        # asynchronous collective-permute can run under it (not measured yet).
        if step < N - 1:
            block = jax.tree.map(lambda a: jax.lax.ppermute(a, CONTEXT_AXIS, ring_perm), block)
    return _merge(parts, sinks_KG).astype(q_bTHD.dtype)


def _slots(shard, C: int, N: int) -> jax.Array:
    """int32 [2C]: the row indices of `shard`'s slots (chunk shard, then 2N-1-shard)."""
    arange = jnp.arange(C)
    return jnp.concatenate([shard * C + arange, (2 * N - 1 - shard) * C + arange])


def _rows(d: dict, lo: int, hi: int) -> dict:
    """The [lo, hi) slots of every per-token array of a query or key dict."""
    return {k: None if a is None else a[:, lo:hi] if k != "idx" else a[lo:hi]
            for k, a in d.items()}  # fmt: skip


def _second_chunk_only(qs: dict, ks: dict, C: int, masks: dict):
    """A later shard's block: only the second query chunk sees it; the first chunk's rows
    get nothing (a log-sum-exp of float32's min, weighted 0 by the merge)."""
    out_bCHV, lse_bCH = _partial(_rows(qs, C, 2 * C), ks, **masks)
    none_out, none_lse = out_bCHV * 0, lse_bCH * 0 + jnp.finfo(jnp.float32).min
    return (jnp.concatenate([none_out, out_bCHV], 1), jnp.concatenate([none_lse, lse_bCH], 1))


def _partial(qs: dict, ks: dict, *, statics: tuple):
    """Softmax attention of the queries to one block's keys, by `online_softmax` (its
    backward recomputes the probabilities): (out float32 [b, T, H, hv] normalised over the
    block, the rows' log-sum-exp [b, T, H])."""
    q_bTHD = qs["q"]
    b, T, H, hd = q_bTHD.shape
    K = ks["k"].shape[2]
    q_bTKGD = q_bTHD.reshape(b, T, K, H // K, hd)
    info = lambda d: (d["pos"], d["idx"], d["seg"])
    out, lse = online_softmax.attend(statics, q_bTKGD, ks["k"], ks["v"], info(qs), info(ks))
    return out.reshape(b, T, H, -1), lse.reshape(b, T, H)


def _merge(parts: list, sinks_KG=None) -> jax.Array:
    """The blocks' (out, lse) merged into the softmax over all their keys (and the sinks,
    a logit per head in every row's denominator)."""
    lse_nbTH = jnp.stack([lse for _, lse in parts])
    total_bTH = jax.nn.logsumexp(lse_nbTH, axis=0)
    if sinks_KG is not None:
        total_bTH = jnp.logaddexp(total_bTH, sinks_KG.reshape(-1).astype(jnp.float32))
    weights = jnp.exp(lse_nbTH - total_bTH)
    return sum(w[..., None] * out for w, (out, _) in zip(weights, parts, strict=True))
