"""Fused self-attention kernels of the accelerators: cuDNN's flash attention on GPU, the Pallas
splash-attention kernel on TPU (`backends.choose` picks; the CPU runs `Attention._blocked`).

    out_BTHD = splash(q_BTHD, k_BTKD, v_BTKD, ids_BT, window=W, checkpoint=NAME)
    out_BTHD = cudnn(q_BTHD, k_BTKD, v_BTKD, ids_BT, window=W)

Both take the masks of `attention_mask` for self-attention: causal and windowed by index in
the row, then restricted to the query's chunk (by position) and document (segment). The last
two are one equality of per-token ids (`mask_ids`): query t sees key s only if
ids[t] == ids[s]. The diagonal always passes it, so no row of a softmax is empty.

Neither kernel builds [T, S] logits in memory: they stream key blocks through the query
blocks' accumulators, so activation memory grows linearly with the sequence. Splash also skips
the blocks its static mask (causal, window) leaves empty; cuDNN skips the causal and window
ones. cuDNN has no per-token ids: chunks and documents reach it as a boolean [B, 1, T, S]
mask, which its API turns into a dense bias (memory quadratic in T again; see `cudnn`).

Under a mesh the kernels run per device inside `jax.shard_map`, rows over the batch axes
that divide the batch and heads over `tensor` (a Pallas kernel has no partitioning rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.sharding import BATCH_AXES

# Splash's tiles (query and key blocks, forward and backward): the largest of these that
# divides the sequence; 512 is MaxText's default.
SPLASH_BLOCKS = (512, 256, 128)


def mask_ids(
    positions_BT: jax.Array, segments_BT: jax.Array | None, chunk_size: int
) -> jax.Array | None:
    """int32 [B, T] ids with ids[t] == ids[s] iff t and s share the document and the chunk of
    positions (None when neither restricts). Chunk c of document d is d * n + c, n one more
    than the row's last chunk, so distinct pairs get distinct ids."""
    chunk_BT = None if chunk_size <= 0 else (positions_BT // chunk_size).astype(jnp.int32)
    if segments_BT is None:
        return chunk_BT
    seg_BT = segments_BT.astype(jnp.int32)
    if chunk_BT is None:
        return seg_BT
    n = jnp.max(chunk_BT, axis=1, keepdims=True) + 1
    return seg_BT * n + chunk_BT


def per_device(fn, B: int, K: int, n_ids: int, n_per_head: int = 0):
    """`fn(q_BTHD, k_BTKD, v_BTKD, *ids_BT, *per_head_K...)` run on each device's rows and
    heads under the active mesh (as is without one). Rows split over the batch axes whose
    sizes divide B (the rest replicate, as `moe` does for a batch they do not divide); heads
    over `tensor` when it divides the key/value heads (the config checks that it does), the
    `n_per_head` last arguments' leading [K, ...] axis with them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn
    batch, n = [], 1
    for ax in BATCH_AXES:
        if ax in mesh.shape and B % (n * mesh.shape[ax]) == 0:
            batch.append(ax)
            n *= mesh.shape[ax]
    heads = "tensor" if "tensor" in mesh.shape and K % mesh.shape["tensor"] == 0 else None
    x = P(tuple(batch) or None, None, heads, None)
    ids = P(tuple(batch) or None, None)
    in_specs = (x, x, x) + (ids,) * n_ids + (P(heads),) * n_per_head
    # Pallas and cuDNN calls carry no varying-axes types, so shard_map cannot check them.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=x, check_vma=False)


# ----------------------------------------------------------------------------- splash (TPU)


def _splash_kernel(T: int, G: int, window: int, checkpoint: str | None):
    """Splash over one key/value head's G query heads (its MQA form: no key repeated)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b = T if min(SPLASH_BLOCKS) > T else next((b for b in SPLASH_BLOCKS if T % b == 0), 0)
    if not b:
        raise backends.KernelError(
            f"splash attention tiles the sequence by {SPLASH_BLOCKS[-1]}, which does not "
            f"divide {T}; make the sequence length a multiple or set attention.impl=blocked"
        )
    if window > 0:  # keys from q - (window - 1) to q: the causal mask and the window in one
        mask = sa.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
    else:
        mask = sa.CausalMask((T, T))
    blocks = sa.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    return sa.make_splash_mqa_single_device(
        sa.MultiHeadMask([mask] * G),
        block_sizes=blocks,
        residual_checkpoint_name=checkpoint,
        interpret=backends.interpret(),
    )


def splash(
    q_BTHD: jax.Array,
    k_BTKD: jax.Array,
    v_BTKD: jax.Array,
    ids_BT: jax.Array | None,
    *,
    window: int = 0,
    checkpoint: str | None = None,
    sinks_KG: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention by the splash kernel; q already scaled. `checkpoint` names the
    output and log-sum-exp the backward keeps (as `block_attention`'s), for remat policies;
    `sinks_KG`: each query head's sink logit (the kernel's own `sinks`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    B, T, H, hd = q_BTHD.shape
    K = k_BTKD.shape[2]

    ids = () if ids_BT is None else (ids_BT,)
    sinks = () if sinks_KG is None else (sinks_KG,)

    def local(q_bTHD, k_bTKD, v_bTKD, *rest):
        b, _, h, _ = q_bTHD.shape
        k_heads = k_bTKD.shape[2]
        kernel = _splash_kernel(T, h // k_heads, window, checkpoint)
        q_bKGTD = q_bTHD.reshape(b, T, k_heads, h // k_heads, hd).transpose(0, 2, 3, 1, 4)
        k_bKTD, v_bKTD = (a.transpose(0, 2, 1, 3) for a in (k_bTKD, v_bTKD))
        ids_bT, sinks_kG = rest[: len(ids)], rest[len(ids) :]

        def row(q_KGTD, k_KTD, v_KTD, *ids_T):
            seg = SegmentIds(ids_T[0], ids_T[0]) if ids_T else None
            head = lambda q, k, v, *s: kernel(q, k, v, segment_ids=seg, sinks=s[0] if s else None)
            return jax.vmap(head)(q_KGTD, k_KTD, v_KTD, *sinks_kG)

        out_bKGTD = jax.vmap(row)(q_bKGTD, k_bKTD, v_bKTD, *ids_bT)
        return out_bKGTD.transpose(0, 3, 1, 2, 4).reshape(b, T, h, hd)

    run = per_device(local, B, K, len(ids), len(sinks))
    return run(q_BTHD, k_BTKD, v_BTKD, *ids, *sinks)


# ----------------------------------------------------------------------------- cuDNN (GPU)


def cudnn(
    q_BTHD: jax.Array,
    k_BTKD: jax.Array,
    v_BTKD: jax.Array,
    ids_BT: jax.Array | None,
    *,
    window: int = 0,
    checkpoint: str = "attention_out",
) -> jax.Array:
    """Causal self-attention by cuDNN's flash attention (scale head_dim**-0.5 applied here),
    GQA and the sliding window native; the output and softmax statistics named `checkpoint`
    for the remat policies, and no gradient computed for the mask (`cudnn_attention`).
    Chunks and documents go in as a [B, 1, T, S] bias: quadratic memory, and no blocks
    skipped beyond the causal ones. cuDNN's packed layout (`q_offsets`) would express
    documents exactly, but JAX refuses it unless the host's own GPU is a Hopper, so it cannot
    be compiled ahead of time here."""
    from moe_jax.kernels import cudnn_attention

    if q_BTHD.dtype not in (jnp.bfloat16, jnp.float16):
        raise backends.KernelError(
            f"attention.impl=cudnn computes in bfloat16/float16, not {q_BTHD.dtype}; "
            "set model.dtype=bfloat16 or attention.impl=blocked"
        )
    B, T, H, hd = q_BTHD.shape
    K = k_BTKD.shape[2]

    def local(q_bTHD, k_bTKD, v_bTKD, *ids):
        return cudnn_attention.attention(
            q_bTHD, k_bTKD, v_bTKD, ids[0] if ids else None,
            scale=hd**-0.5, window=window, name=checkpoint,
        )  # fmt: skip

    ids = () if ids_BT is None else (ids_BT,)
    return per_device(local, B, K, len(ids))(q_BTHD, k_BTKD, v_BTKD, *ids)
