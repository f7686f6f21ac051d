"""Grouped-query attention with RoPE/NoPE, QK-norm, chunked-local and sliding-window masks,
and attention sinks (gpt-oss: a learned logit per head that joins every row's softmax
denominator and takes no value, so a head can attend to nothing).

RoPE, chunks and NoPE temperature tuning use the tokens' positions. With a KV cache
(prefill, decoding) the causal mask and the sliding window come from positions too: the keys
are the whole cache, written at the queries' positions, and slots not yet written always sit
at positions after the query. Segments are not taken there (one document per row). A long
prompt attends `PREFILL_BLOCK` queries at a time, so its logits are never [B, H, T, S] at once.
A sliding-window layer's cache is a ring of the window's last keys (`init_cache`: "pos" holds
each slot's position, -1 when empty), not the whole context: the call's keys are attended
beside the ring, and the newest `window` of them written into it. A negative position marks
a padding token (the sampler's prompts are padded to a bucket): it is written to no ring.

Without a cache (training, full forwards) the keys are the queries' own tokens, and the
causal mask and the window come from their order in the row, not from their positions, so
positions may restart at every document of a packed row (within a document the two agree).
`segments_BT` (document ids, 0 for padding) keeps attention inside each document: query t
sees key s only if segments[t] == segments[s] (padding sees only padding, so no row of the
softmax is empty; nothing counted reads it). Positions restarted without segments let the
documents of a row see each other, as some recipes want.

The queries are also cut into blocks, and a block attends only to the keys up to its last
query (and, with a sliding window, from its first query's window start): that skips
about half of the logits, and each block's [T_blk, S_blk] logits stay in cache instead of one
[B, H, T, S] array going through memory several times. A block's backward
(`block_attention`, written by hand) recomputes its probabilities from q and k for the same
reason, keeping only the output and the rows' log-sum-exp. Softmax normalises after the value
product, dividing the [T, hd] output rather than the [T, S] weights.

That blocked path is the CPU's. `attention.impl` (`moe_jax.backends` picks for `auto`) puts
the fused kernels of `attention_kernels` in its place: cuDNN's on GPU, Pallas splash on TPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.model import attention_kernels, context_parallel, in_turn, lora, weight_gather
from moe_jax.model.attention_core import (
    ATTENTION_OUT,
    attention_mask,
    block_attention,
    block_attention_max,
)
from moe_jax.model.kv_cache import KVCache, check_cache_inputs, ring_keys, write_cache, write_ring
from moe_jax.model.norm import RMSNorm, rms_norm
from moe_jax.model.paged_kv import is_paged, paged_keys
from moe_jax.model.rope import apply_rope, rope_attention_factor, rope_inv_freq
from moe_jax.named_scopes import ATTENTION, scoped
from moe_jax.sharding import param

# Queries attended to the KV cache at a time in a prefill: [B, H, 512, S] float32 logits per
# block rather than [B, H, T, S] for the whole prompt.
PREFILL_BLOCK = 512


def temperature_scale(positions_BT: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """Llama 4 attention-temperature tuning for NoPE layers: sharper attention far out."""
    pos = positions_BT.astype(jnp.float32)
    return jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def attend(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale: float, sinks_KG=None) -> jax.Array:
    """Masked softmax attention, query heads grouped over the K key/value heads (GQA);
    `sinks_KG`: each query head's sink logit, in every row's denominator. The values' head
    dim may differ from the queries' and keys' (MLA's)."""
    B, T, H, hd = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_BTKGD = (q_BTHD * scale).reshape(B, T, K, H // K, hd)
    logits_BKGTS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32
    )
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
    # The max only keeps exp() in range; softmax does not depend on it, so no gradient flows.
    shift = jnp.max(logits_BKGTS, axis=-1, keepdims=True)
    if sinks_KG is not None:
        sink_1KG11 = sinks_KG.astype(jnp.float32)[None, :, :, None, None]
        shift = jnp.maximum(shift, sink_1KG11)
    shift = jax.lax.stop_gradient(shift)
    weights_BKGTS = jnp.exp(logits_BKGTS - shift)
    denom_BTKG = jnp.einsum("bkgts->btkg", weights_BKGTS)
    if sinks_KG is not None:
        denom_BTKG = denom_BTKG + jnp.exp(sink_1KG11 - shift)[..., 0].transpose(0, 3, 1, 2)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", weights_BKGTS.astype(v_BSKD.dtype), v_BSKD)
    out_BTKGD = out_BTKGD / denom_BTKG[..., None].astype(out_BTKGD.dtype)
    return out_BTKGD.reshape(B, T, H, v_BSKD.shape[-1])


def query_blocks(T: int, window: int = 0, max_blocks: int = 8, min_block: int = 64):
    """Static (q_lo, q_hi, k_lo, k_hi) per query block for increasing positions: the keys a
    block can see end at its last query and, with a window, start at its first query's window.
    At most `max_blocks` blocks, so the unrolled blocks keep compile time bounded."""
    n = max(1, min(max_blocks, T // min_block))
    size = math.ceil(T / n)
    blocks = []
    for q_lo in range(0, T, size):
        q_hi = min(T, q_lo + size)
        k_lo = max(0, q_lo - window + 1) if window > 0 else 0
        blocks.append((q_lo, q_hi, k_lo, q_hi))
    return blocks


def in_prefill_blocks(attend_block, q_BTHD, positions_BT, *rows_BT) -> jax.Array:
    """`attend_block(q, positions, *rows)` (queries against a whole cache) for the call's
    queries: at once when decoding or for a short prompt, else `PREFILL_BLOCK` queries at a
    time, one block after another, each with its [B, H, T_blk, S] logits, not the whole
    [B, H, T, S]. `rows_BT`: more arrays [B, T, ...] cut into the same blocks (DSA's
    selection). The last block is padded with copies of the last query (rows computed, then
    dropped)."""
    B, T = positions_BT.shape
    if T <= PREFILL_BLOCK:
        return attend_block(q_BTHD, positions_BT, *rows_BT)
    n = -(-T // PREFILL_BLOCK)
    pad = n * PREFILL_BLOCK - T
    edge = lambda a: jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2), mode="edge")
    blocks = lambda a: jnp.moveaxis(a.reshape(B, n, PREFILL_BLOCK, *a.shape[2:]), 1, 0)
    inputs = tuple(blocks(edge(a)) for a in (q_BTHD, positions_BT, *rows_BT))
    out_nBtHD = jax.lax.map(lambda qp: attend_block(*qp), inputs)
    out_BTHD = jnp.moveaxis(out_nBtHD, 0, 1).reshape(B, n * PREFILL_BLOCK, *out_nBtHD.shape[3:])
    return out_BTHD[:, :T]


class Attention(nnx.Module):
    def __init__(self, cfg: Config, layer: int, *, rngs: nnx.Rngs):
        a = cfg.attention
        D, H, K, hd = cfg.model.d_model, a.n_heads, a.n_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(cfg.model.init_std)
        zeros = nnx.initializers.zeros
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, hd
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        self.use_rope = cfg.uses_rope(layer)
        self.rope_style = a.rope_style
        self.inv_freq = tuple(rope_inv_freq(cfg.rotary_dim, a.rope_theta, a.rope_scaling).tolist())
        self.rope_scale = rope_attention_factor(a.rope_scaling)  # YaRN's, on q and k
        self.qk_norm = a.qk_norm
        self.norm_eps = cfg.model.norm_eps
        self.temperature_tuning = a.temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = a.floor_scale, a.attn_scale
        self.chunk_size = a.chunk_size if self.use_rope else 0  # NoPE layers attend globally
        self.window = a.sliding_window if cfg.uses_window(layer) else 0
        self.impl = a.impl  # resolved for the target backend when traced (`backends.choose`)
        self.context_strategy = cfg.mesh.context_strategy  # under a context axis
        self.max_logit = bool(cfg.train.qk_clip)  # QK-clip's statistic (`logit_stats`)

        self.wq = param(rngs, init, (D, H, hd), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, init, (D, K, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, init, (D, K, hd), ("embed", "kv_heads", "head_dim"))
        if a.o_groups:  # DeepSeek-V4's grouped low-rank output projection
            G, r = a.o_groups, a.o_lora_rank
            self.wo_a = param(rngs, init, (G, H // G, hd, r), (None, None, "head_dim", None))
            self.wo_b = param(rngs, init, (G, r, D), (None, None, "embed"))
        else:
            self.wo = param(rngs, init, (H, hd, D), ("heads", "head_dim", "embed"))
        if a.qkv_bias:
            self.q_bias = param(rngs, zeros, (H, hd), ("heads", "head_dim"))
            self.k_bias = param(rngs, zeros, (K, hd), ("kv_heads", "head_dim"))
            self.v_bias = param(rngs, zeros, (K, hd), ("kv_heads", "head_dim"))
        if a.o_bias:
            self.o_bias = param(rngs, zeros, (D,), ("embed",))
        if a.output_gate:  # Qwen3-Next: the doubled q projection's second half
            self.wg = param(rngs, init, (D, H, hd), ("embed", "heads", "head_dim"))
        if a.qk_norm == "rms":
            centred = cfg.model.zero_centered_norm
            self.q_norm = RMSNorm(hd, cfg.model.norm_eps, rngs=rngs, zero_centered=centred)
            self.k_norm = RMSNorm(hd, cfg.model.norm_eps, rngs=rngs, zero_centered=centred)
        if a.sinks:
            self.sinks = param(rngs, zeros, (H,), ("heads",))
        lora.attach(self, cfg, "attention", rngs)

    def _sinks_KG(self) -> jax.Array | None:
        """The sink logits [K, G] (query head h = k G + g), float32; None without sinks."""
        if not hasattr(self, "sinks"):
            return None
        K = self.n_kv_heads
        return self.sinks[...].astype(jnp.float32).reshape(K, self.n_heads // K)

    def _project(self, x_BTD: jax.Array, name: str) -> jax.Array:
        y = weight_gather.einsum("btd,dhk->bthk", x_BTD, getattr(self, f"w{name}"), self.dtype)
        y = y + lora.delta(self, f"w{name}", x_BTD, "btd,dhk->bthk", self.dtype)
        if hasattr(self, f"{name}_bias"):
            y = y + getattr(self, f"{name}_bias")[...].astype(self.dtype)
        return y

    @scoped(ATTENTION)
    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache | None = None,
        segments_BT: jax.Array | None = None,
        logit_stats: dict | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """`logit_stats`: with train.qk_clip, a training forward (no cache) puts each head's
        largest pre-softmax logit over the batch in it, "max_logit" [H] (float32)."""
        check_cache_inputs(cache, segments_BT)
        q_BTHD, k_BTKD, v_BTKD = checkpoint_name(
            (self._project(x_BTD, "q"), self._project(x_BTD, "k"), self._project(x_BTD, "v")),
            "qkv_proj",
        )

        if self.qk_norm == "rms":  # Qwen3: learned, before RoPE, every layer
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        if self.use_rope:
            rope = lambda x: apply_rope(
                x, positions_BT, self.inv_freq, self.rope_style, self.rope_scale
            )
            q_BTHD, k_BTKD = rope(q_BTHD), rope(k_BTKD)
            if self.qk_norm == "l2":  # Llama 4: weightless, after RoPE, RoPE layers only
                q_BTHD = rms_norm(q_BTHD, self.norm_eps)
                k_BTKD = rms_norm(k_BTKD, self.norm_eps)
        if self.temperature_tuning:
            scale_BT = temperature_scale(positions_BT, self.floor_scale, self.attn_scale)
            q_BTHD = (q_BTHD * scale_BT[:, :, None, None]).astype(q_BTHD.dtype)

        if cache is None and self.max_logit and logit_stats is not None:
            args = (q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT)
            out_BTHD, logit_stats["max_logit"] = self._blocked(*args, with_max=True)
        elif cache is None:
            out_BTHD = self._self_attention(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT)
        else:
            out_BTHD, cache = self._cached(q_BTHD, k_BTKD, v_BTKD, positions_BT, cache)
        if hasattr(self, "wg"):  # the output gate: each head's output dims scaled by their own
            out_BTHD = out_BTHD * jax.nn.sigmoid(self._project(x_BTD, "g"))
        if hasattr(self, "wo_a"):
            y_BTD = grouped_output(out_BTHD, self.wo_a, self.wo_b, self.dtype)
        else:
            y_BTD = weight_gather.einsum("bthk,hkd->btd", out_BTHD, self.wo, self.dtype)
            y_BTD = y_BTD + lora.delta(self, "wo", out_BTHD, "bthk,hkd->btd", self.dtype)
        if hasattr(self, "o_bias"):
            y_BTD = y_BTD + self.o_bias[...].astype(self.dtype)
        return checkpoint_name(y_BTD, "out_proj"), cache

    def _self_attention(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT) -> jax.Array:
        """Attention over the call's own tokens by the kernel chosen for the target backend,
        or across the shards of a context axis (`context_parallel`)."""
        if context_parallel.active(q_BTHD.shape[1]):
            masks = dict(window=self.window, chunk_size=self.chunk_size, sinks_KG=self._sinks_KG())
            args = (q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT)
            return context_parallel.self_attention(
                *args, scale=self.head_dim**-0.5, strategy=self.context_strategy, **masks
            )
        impl = backends.choose(
            "attention",
            self.impl,
            dtype=q_BTHD.dtype,
            length=q_BTHD.shape[1],
            sinks=hasattr(self, "sinks"),
        )
        if impl == "blocked":
            return self._blocked(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT)
        ids_BT = attention_kernels.mask_ids(positions_BT, segments_BT, self.chunk_size)
        if impl == "cudnn":
            return attention_kernels.cudnn(
                q_BTHD, k_BTKD, v_BTKD, ids_BT, window=self.window, checkpoint=ATTENTION_OUT
            )
        q_BTHD = q_BTHD * self.head_dim**-0.5  # as `_blocked` scales it: splash does not
        return attention_kernels.splash(
            q_BTHD,
            k_BTKD,
            v_BTKD,
            ids_BT,
            window=self.window,
            checkpoint=ATTENTION_OUT,
            sinks_KG=self._sinks_KG(),
        )

    def _cached(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, cache: KVCache):
        """Write k and v into the cache at the rows' positions, then attend to the whole cache
        (prefill or decoding), `PREFILL_BLOCK` queries at a time. A ring (sliding-window
        layers): attend to the ring's older keys and the call's own, then keep the newest.
        A paged cache (the engine's, `paged_kv`): written, then read through the page table."""
        if is_paged(cache):
            kv, k_pos_BS, cache = paged_keys(cache, {"k": k_BTKD, "v": v_BTKD}, positions_BT)
            k_BSKD, v_BSKD = kv["k"], kv["v"]
        elif "pos" in cache:
            k_BSKD, v_BSKD, k_pos_BS = ring_keys(cache, k_BTKD, v_BTKD, positions_BT)
            cache = write_ring(cache, k_BTKD, v_BTKD, positions_BT)
        else:
            start_B = positions_BT[:, 0]
            cache = {
                "k": write_cache(cache["k"], k_BTKD, start_B),
                "v": write_cache(cache["v"], v_BTKD, start_B),
            }
            B, S = cache["k"].shape[:2]
            k_pos_BS = jnp.broadcast_to(jnp.arange(S, dtype=positions_BT.dtype), (B, S))
            k_BSKD, v_BSKD = cache["k"], cache["v"]
        k_BSKD, v_BSKD = k_BSKD.astype(self.dtype), v_BSKD.astype(self.dtype)
        scale = self.head_dim**-0.5
        sinks_KG = self._sinks_KG()
        written_B1S = (k_pos_BS >= 0)[:, None, :]  # empty ring slots hold position -1
        attend_block = lambda q, pos: attend(
            q, k_BSKD, v_BSKD, self._mask(pos, k_pos_BS) & written_B1S, scale, sinks_KG
        )
        return in_prefill_blocks(attend_block, q_BTHD, positions_BT), cache

    def _mask(self, q_pos_BT, k_pos_BS, order=None, segments=None):
        return attention_mask(
            q_pos_BT,
            k_pos_BS,
            chunk_size=self.chunk_size,
            window=self.window,
            order=order,
            segments=segments,
        )

    def _blocked(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT=None, with_max=False):
        """`blocked_self_attention` with this layer's scale, masks and sinks. `with_max`: the
        path QK-clip takes whatever attention.impl resolves to (the fused kernels keep their
        logits to themselves), under no context axis (both refused with it by the config)."""
        masks = dict(window=self.window, chunk_size=self.chunk_size, sinks_KG=self._sinks_KG())
        args = (q_BTHD, k_BTKD, v_BTKD, positions_BT, segments_BT)
        return blocked_self_attention(*args, scale=self.head_dim**-0.5, with_max=with_max, **masks)


def blocked_self_attention(
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
    keep_BTS=None,
    with_max=False,
):
    """Self-attention over the call's own tokens, one query block at a time: q scaled by
    `scale`, masked as `attention_mask` masks with `window` and `chunk_size`, and by
    `keep_BTS` [B, T, T] where given (DSA's selection), `sinks_KG` as `block_attention`
    takes them. The values' head dim may differ from q's and k's (MLA's).
    `with_max`: -> (out, max_H), also each head's largest logit over the batch (float32,
    `block_attention_max`: QK-clip's statistic, from the logits computed anyway).

    q, k and v are cut into the query blocks' chunks with one `lax.split` each, and a block
    attends to the concatenation of the key chunks it can see (from the chunk holding its
    window's first key; the mask drops the rest). In the backward the chunks' gradients
    are then summed chunk by chunk and concatenated once, where per-block slices of the
    whole sequence each came back padded to full length and were added up (8 full-size
    arrays per tensor and layer). Heads are laid out [B, K, G * T, hd] (the G query heads
    sharing a key/value head stacked as rows) so every matmul of `block_attention` is a
    plain batched matmul. Causality comes from the tokens' indices (see the module doc)."""
    B, T, H, hd = q_BTHD.shape
    K, hv = k_BTKD.shape[2], v_BTKD.shape[-1]
    blocks = query_blocks(T, window)
    sizes = [q_hi - q_lo for q_lo, q_hi, _, _ in blocks]
    q_BTKGD = (q_BTHD * scale).reshape(B, T, K, H // K, hd)
    q_parts, k_parts, v_parts, pos_parts = (
        jax.lax.split(a, sizes, axis=1) for a in (q_BTKGD, k_BTKD, v_BTKD, pos_BT)
    )
    seg_parts = None if seg_BT is None else jax.lax.split(seg_BT, sizes, axis=1)
    seen = lambda parts, first, last: (
        parts[last] if first == last else jnp.concatenate(parts[first : last + 1], axis=1)
    )
    heads_first = lambda a: a.transpose(0, 2, 1, 3)  # [B, S, K, hd] -> [B, K, S, hd]
    outs, maxes_H = [], []
    for i, (q_lo, q_hi, k_lo, _) in enumerate(blocks):
        first = k_lo // sizes[0]  # every chunk but the last has sizes[0] positions
        Tq = sizes[i]
        q_BKMD = q_parts[i].transpose(0, 2, 3, 1, 4).reshape(B, K, -1, hd)
        mask_BTS = attention_mask(
            pos_parts[i],
            seen(pos_parts, first, i),
            chunk_size=chunk_size,
            window=window,
            order=(jnp.arange(q_lo, q_hi), jnp.arange(first * sizes[0], q_hi)),
            segments=None if seg_parts is None else (seg_parts[i], seen(seg_parts, first, i)),
        )
        if keep_BTS is not None:
            mask_BTS &= keep_BTS[:, q_lo:q_hi, first * sizes[0] : q_hi]
        args = (q_BKMD, heads_first(seen(k_parts, first, i)), heads_first(seen(v_parts, first, i)))
        if with_max:  # row m of M = G * T is head k G + m // T (see the reshape below)
            out_BKMD, row_max_BKM = block_attention_max(*args, mask_BTS, sinks_KG)
            maxes_H.append(jnp.max(row_max_BKM.reshape(B, H, Tq), axis=(0, 2)))
        else:
            out_BKMD = block_attention(*args, mask_BTS, sinks_KG)
        outs.append(out_BKMD.reshape(B, K, H // K, Tq, hv).transpose(0, 3, 1, 2, 4))
    out_BTKGD = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    out_BTHD = out_BTKGD.reshape(B, T, H, hv)
    return (out_BTHD, jnp.max(jnp.stack(maxes_H), axis=0)) if with_max else out_BTHD


def grouped_output(out_BTHD: jax.Array, wo_a, wo_b, dtype) -> jax.Array:
    """DeepSeek-V4's grouped low-rank output projection (transformers' o_a_proj, a
    DeepseekV4GroupedLinear, then o_b_proj): the heads in G consecutive groups, group g's
    outputs [H / G * hd] times its own wo_a[g] [H / G, hd, r], the G x r results times wo_b."""
    B, T, H, hd = out_BTHD.shape
    G = wo_a.shape[0]
    out_BTGMK = out_BTHD.reshape(B, T, G, H // G, hd)
    low_BTGR = jnp.einsum("btgmk,gmkr->btgr", out_BTGMK, in_turn.dense(wo_a[...], dtype, out_BTHD))
    return weight_gather.einsum("btgr,grd->btd", low_BTGR, wo_b, dtype)
