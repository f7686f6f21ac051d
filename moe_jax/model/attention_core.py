"""What every self-attention path shares: the boolean masks (causal, window, chunk, document;
the context-parallel path's online_softmax.py takes them too) and `block_attention`, the
masked softmax of a block of queries against its keys with a hand-written backward
(attention.py's blocked path runs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Checkpoint name of a query block's output and log-sum-exp, all its backward keeps besides
# q, k, v. `model.remat=dots` saves them (see `remat.py`): otherwise the backward
# reruns the block's forward to recover them, and XLA merges only the logits with the
# backward's own, not the softmax and the value product (~5% of the medium step).
ATTENTION_OUT = "attention_out"


def attention_mask(
    q_pos_BT: jax.Array,
    k_pos_BS: jax.Array,
    *,
    chunk_size: int = 0,
    window: int = 0,
    order: tuple[jax.Array, jax.Array] | None = None,
    segments: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Boolean [B, T, S]: causal, optionally restricted to the query's chunk or a window.

    Causal and windowed by position, or with `order` = (q_idx_T, k_idx_S), the tokens'
    indices in the row, by index (self-attention, where positions may restart per document);
    chunks always by position. `segments` = (q_seg_BT, k_seg_BS) further keeps each query to
    keys of its own segment."""
    q = q_pos_BT[:, :, None]
    k = k_pos_BS[:, None, :]
    # Causality and the window by position, or by index in the row ([1, T, S]).
    q_ord, k_ord = (q, k) if order is None else (order[0][None, :, None], order[1][None, None, :])
    mask = k_ord <= q_ord
    if window > 0:
        mask &= q_ord - k_ord < window
    mask = jnp.broadcast_to(mask, (q.shape[0], q.shape[1], k.shape[2]))
    if chunk_size > 0:
        mask &= (q // chunk_size) == (k // chunk_size)
    if segments is not None:
        q_seg_BT, k_seg_BS = segments
        mask &= q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    return mask


def _masked_logits(q_BKMD, k_BKSD, mask_BTS) -> jax.Array:
    """float32 [B, K, M, S] logits, masked; row m of M = G * T is query head m // T at m % T."""
    logits_BKMS = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD, preferred_element_type=jnp.float32)
    B, K, M, S = logits_BKMS.shape
    T = mask_BTS.shape[1]
    logits_BKGTS = logits_BKMS.reshape(B, K, M // T, T, S)
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
    return logits_BKGTS.reshape(B, K, M, S)


def _row_sinks(sinks_KG, T: int) -> jax.Array:
    """[K, M] sink logits of the M = G * T rows (row m is head m // T), float32."""
    return jnp.repeat(sinks_KG.astype(jnp.float32), T, axis=1)


@jax.custom_vjp
def block_attention(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG=None) -> jax.Array:
    """Masked softmax attention of M = G * T query rows (already scaled) to S keys, grouped by
    key/value head: out [B, K, M, hd]. `sinks_KG`: a sink logit per query head, added to its
    rows' denominators (None: none).

    A hand-written backward, flash-attention style: only the output and the rows' log-sum-exp
    are kept, the probabilities are recomputed from q and k, and the two matmuls that contract
    over the query rows (dK = dS^T q, dV = P^T dO) take explicitly transposed [S, M] operands.
    Left to autodiff, XLA:CPU turned those into transposes of both orientations of the logits
    and slow matmul forms: this is ~25% faster for the medium benchmark's attention."""
    return _block_attention_fwd(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG)[0]


def _block_attention_fwd(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG=None):
    out_BKMD, _, residuals = _forward(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG)
    return out_BKMD, residuals


def _forward(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG=None):
    """-> (out, each row's largest logit [B, K, M] (sinks aside), the backward's residuals)."""
    logits_BKMS = _masked_logits(q_BKMD, k_BKSD, mask_BTS)
    # The max only keeps exp() in range; the softmax does not depend on it.
    row_max_BKM = max_BKM = jnp.max(logits_BKMS, axis=-1)
    if sinks_KG is not None:
        sink_KM = _row_sinks(sinks_KG, mask_BTS.shape[1])
        max_BKM = jnp.maximum(max_BKM, sink_KM)
    weights_BKMS = jnp.exp(logits_BKMS - max_BKM[..., None])
    denom_BKM = jnp.sum(weights_BKMS, axis=-1)
    if sinks_KG is not None:
        denom_BKM = denom_BKM + jnp.exp(sink_KM - max_BKM)
    # Normalised after the value product: divides the [M, hd] output, not the [M, S] weights.
    out_BKMD = jnp.einsum(
        "bkms,bksd->bkmd",
        weights_BKMS.astype(v_BKSD.dtype),
        v_BKSD,
        preferred_element_type=jnp.float32,
    )
    out_BKMD = (out_BKMD / denom_BKM[..., None]).astype(q_BKMD.dtype)
    lse_BKM = max_BKM + jnp.log(denom_BKM)
    out_BKMD, lse_BKM = checkpoint_name((out_BKMD, lse_BKM), ATTENTION_OUT)
    residuals = (q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG, out_BKMD, lse_BKM)
    return out_BKMD, row_max_BKM, residuals


def _block_attention_bwd(residuals, dout_BKMD):
    q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG, out_BKMD, lse_BKM = residuals
    f32 = jnp.float32
    probs_BKMS = jnp.exp(_masked_logits(q_BKMD, k_BKSD, mask_BTS) - lse_BKM[..., None])
    dprobs_BKMS = jnp.einsum("bkmd,bksd->bkms", dout_BKMD, v_BKSD, preferred_element_type=f32)
    # Softmax backward: dlogits = P * (dP - rowsum(dO * O)).
    rowdot_BKM = jnp.sum(dout_BKMD.astype(f32) * out_BKMD.astype(f32), axis=-1)
    dlogits_BKMS = probs_BKMS * (dprobs_BKMS - rowdot_BKM[..., None])
    dq_BKMD = jnp.einsum(
        "bkms,bksd->bkmd", dlogits_BKMS.astype(k_BKSD.dtype), k_BKSD, preferred_element_type=f32
    )
    # The barrier keeps the transposes as copies: folded into the matmuls, they became
    # contractions over the operands' major axis, which XLA:CPU runs several times slower.
    probs_BKSM, dlogits_BKSM = jax.lax.optimization_barrier(
        (jnp.swapaxes(probs_BKMS, 2, 3), jnp.swapaxes(dlogits_BKMS, 2, 3))
    )
    dv_BKSD = jnp.einsum(
        "bksm,bkmd->bksd", probs_BKSM.astype(v_BKSD.dtype), dout_BKMD, preferred_element_type=f32
    )
    dk_BKSD = jnp.einsum(
        "bksm,bkmd->bksd", dlogits_BKSM.astype(q_BKMD.dtype), q_BKMD, preferred_element_type=f32
    )
    dsinks_KG = None
    if sinks_KG is not None:
        # The sink is a column of logits with no value: its gradient is P_sink (0 - rowdot).
        T = mask_BTS.shape[1]
        dsink_BKM = -jnp.exp(_row_sinks(sinks_KG, T) - lse_BKM) * rowdot_BKM
        B, K, M = dsink_BKM.shape
        dsinks_KG = jnp.sum(dsink_BKM.reshape(B, K, M // T, T), axis=(0, 3))
        dsinks_KG = dsinks_KG.astype(sinks_KG.dtype)
    return (
        dq_BKMD.astype(q_BKMD.dtype),
        dk_BKSD.astype(k_BKSD.dtype),
        dv_BKSD.astype(v_BKSD.dtype),
        None,
        dsinks_KG,
    )


block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


@jax.custom_vjp
def block_attention_max(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG=None):
    """`block_attention` and each query row's largest pre-softmax logit [B, K, M] (float32,
    the sinks aside): the statistic QK-clip reads (moe_jax/train/qk_clip.py), taken from the
    logits the forward computes anyway. It is a statistic: no gradient flows through it."""
    out_BKMD, row_max_BKM, _ = _forward(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG)
    return out_BKMD, row_max_BKM


def _block_attention_max_fwd(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG=None):
    out_BKMD, row_max_BKM, residuals = _forward(q_BKMD, k_BKSD, v_BKSD, mask_BTS, sinks_KG)
    return (out_BKMD, row_max_BKM), residuals


def _block_attention_max_bwd(residuals, cotangents):
    return _block_attention_bwd(residuals, cotangents[0])


block_attention_max.defvjp(_block_attention_max_fwd, _block_attention_max_bwd)
