"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 (`attention.kind=mla`): every head's
keys and values are expanded from one low-rank latent per token, so a KV cache holds that
latent instead of each head's k and v.

For a token x [D], as transformers' `DeepseekV3Attention` computes it (R = kv_lora_rank,
dn / dr = qk_nope_head_dim / qk_rope_head_dim, dv = v_head_dim, H heads):

    q = W_qb RMSNorm(W_qa x)  (q_lora_rank > 0)  or  W_q x     [H, dn + dr] = [q_nope | q_pe]
    [c | k_pe] = W_kva x  ([R | dr]),  c = RMSNorm(c)          the latent (kv_a_proj_with_mqa)
    k_nope_h = W_uk_h c  [dn],  v_h = W_uv_h c  [dv]           kv_b_proj, split in two
    q_pe (each head) and k_pe (ONE key, shared by all heads) rotated by RoPE
    score_h(t, s) = scale (q_nope_h(t) . k_nope_h(s) + q_pe_h(t) . k_pe(s)), causal
    y = W_o [sum_s softmax_s(score_h) v_h(s)]_h
    scale = (dn + dr) ** -0.5, times YaRN's mscale(mscale_all_dim) ** 2 (`rope_softmax_factor`)

RoPE: `half` is transformers' default; `interleaved` rotates the pairs (x[2i], x[2i+1]) by
frequency i, as its `rope_interleave=True` does, which then writes the rotated pairs
de-interleaved ([evens | odds]) where ours stay in place. That is one fixed permutation of
q_pe and k_pe alike, so every q_pe . k_pe, and so the attention, is the same.

Without a cache (training, scoring), the form above: k = [k_nope_h | k_pe] and v_h for every
head, then multi-head attention through attention.py's blocked path or the backend's fused
kernel (`_self_attention`). Per key and head that contracts dn + dr dims for the score and dv
for the output, where the absorbed form below contracts R + dr twice (576 against 192 and 128
in DeepSeek-V3): a forward over many queries is compute-bound, so it expands.

With a cache (prefill, decoding) each token writes only [c | k_pe] (`latent_cache`: R + dr
values, against 2 H dh for GQA with H kv heads), and attention runs the ABSORBED form: W_uk
folds into the query, q_nope_h . (W_uk_h c) = (W_uk_h^T q_nope_h) . c, so
q_h' = [W_uk_h^T q_nope_h | q_pe_h] attends the cache as multi-query attention, one key and
value "head" [c | k_pe] shared by all H queries. The output stays in latent space,
sum_s p_h(s) c(s), until W_uv_h takes it to v_h's (W_uv is linear: sum_s p_h(s) v_h(s)).
Decoding is bound by reading the cache, and this reads each cached value once per step. The
value is the whole cached row, its last dr outputs dropped: the matmul reads the cache as it
lies, where a value of c alone would slice a copy of it every step (dr / R more value FLOPs).

DeepSeek Sparse Attention (attention.index_topk > 0: DeepSeek-V3.2, GLM-5) restricts each
query to the keys a lightning indexer selects (`sparse_attention.py`): both forms above run
with their causal mask ANDed with that selection, and a cache also keeps each token's indexer
key ("index_k") beside its latent.

Shapes in names: N = dn, P = dr (the RoPE part), Q = dn + dr, V = dv, R the latent, L = R + dr.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.model import attention_kernels, context_parallel, in_turn, lora, weight_gather
from moe_jax.model import sparse_attention as sparse
from moe_jax.model.attention import (
    ATTENTION_OUT,
    attend,
    attention_mask,
    blocked_self_attention,
    in_prefill_blocks,
)
from moe_jax.model.kv_cache import KVCache, check_cache_inputs, write_cache
from moe_jax.model.norm import RMSNorm
from moe_jax.model.paged_kv import is_paged, paged_keys
from moe_jax.model.rope import apply_rope, rope_attention_factor, rope_inv_freq, rope_softmax_factor
from moe_jax.named_scopes import ATTENTION, scoped
from moe_jax.sharding import param

# DeepSeek's q_a_layernorm and kv_a_layernorm keep their class's default eps (transformers'
# too), not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def latent_cache(cfg: Config, lead: tuple[int, ...], dtype) -> KVCache:
    """A zeroed MLA cache for `lead` = (..., B, S): {"latent": [..., B, S, 1, R + dr]}, each
    token's normed latent c then its rotated k_pe, as one key/value head (the absorbed form's
    MQA): the same [B, S, K, hd] layout as attention.py's k and v, so writing it and splitting
    it over a mesh (`sampling.shard_cache`: one head, never over `tensor`) are theirs."""
    a = cfg.attention
    return {"latent": jnp.zeros((*lead, 1, a.kv_lora_rank + a.qk_rope_head_dim), dtype)}


def mla_cache(cfg: Config, layer: int, lead: tuple[int, ...], dtype) -> KVCache:
    """Layer `layer`'s cache: `latent_cache`, and the indexer's keys where it runs one."""
    cache = latent_cache(cfg, lead, dtype)
    return cache | (sparse.index_cache(cfg, lead, dtype) if cfg.runs_indexer(layer) else {})


class MLAttention(nnx.Module):
    def __init__(self, cfg: Config, layer: int, *, rngs: nnx.Rngs):
        a = cfg.attention
        D, H, rank_q = cfg.model.d_model, a.n_heads, a.q_lora_rank
        R, N, P, V = a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        init = nnx.initializers.normal(cfg.model.init_std)
        self.n_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim = H, R, N, P
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        self.rope_style = a.rope_style
        self.inv_freq = tuple(rope_inv_freq(P, a.rope_theta, a.rope_scaling).tolist())
        self.rope_scale = rope_attention_factor(a.rope_scaling)  # YaRN's, on q_pe and k_pe
        self.scale = (N + P) ** -0.5 * rope_softmax_factor(a.rope_scaling)
        self.impl = a.impl  # resolved for the target backend when traced (`backends.choose`)
        self.context_strategy = cfg.mesh.context_strategy  # under a context axis
        # DSA: a layer runs its indexer or reuses an earlier one's selection (GLM's sharing),
        # which it then passes on to the next layers
        self.index_topk, self.passes_selection = a.index_topk, a.index_topk_freq > 1
        # train.indexer_stage=warmup: the attention stays dense while the indexer learns it
        self.dense_warmup = cfg.train.indexer_stage == "warmup"
        self.max_logit = bool(cfg.train.qk_clip)  # QK-clip's statistic (`logit_stats`)

        heads = ("latent", "heads", "head_dim")  # the latent dim split over fsdp (ZeRO)
        if rank_q > 0:
            self.wq_a = param(rngs, init, (D, rank_q), ("embed", None))
            self.q_a_norm = RMSNorm(rank_q, LATENT_NORM_EPS, rngs=rngs)
            self.wq_b = param(rngs, init, (rank_q, H, N + P), heads)
        else:
            self.wq = param(rngs, init, (D, H, N + P), ("embed", "heads", "head_dim"))
        self.wkv_a = param(rngs, init, (D, R + P), ("embed", None))
        self.kv_a_norm = RMSNorm(R, LATENT_NORM_EPS, rngs=rngs)
        self.wk_b = param(rngs, init, (R, H, N), heads)  # W_uk
        self.wv_b = param(rngs, init, (R, H, V), heads)  # W_uv
        self.wo = param(rngs, init, (H, V, D), ("heads", "head_dim", "embed"))
        lora.attach(self, cfg, "attention", rngs)  # wk_b / wv_b (also absorbed) get none
        if cfg.runs_indexer(layer):
            self.indexer = sparse.Indexer(cfg, self.dtype, rngs=rngs)

    def _w(self, v: nnx.Param, x: jax.Array) -> jax.Array:
        """A weight without a model dim (nothing for `weight_gather.einsum` to gather), as computed
        on `x` (a 16-bit weight converted once x exists: `in_turn.dense`)."""
        return in_turn.dense(v[...], self.dtype, x)

    def _query(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(q [B, T, H, Q], the normed query latent [B, T, r] the indexer reads, or None)."""
        if hasattr(self, "wq"):
            q_BTHQ = weight_gather.einsum("btd,dhq->bthq", x_BTD, self.wq, self.dtype)
            return q_BTHQ + lora.delta(self, "wq", x_BTD, "btd,dhq->bthq", self.dtype), None
        q_BTr = weight_gather.einsum("btd,dr->btr", x_BTD, self.wq_a, self.dtype)
        q_BTr = self.q_a_norm(q_BTr + lora.delta(self, "wq_a", x_BTD, "btd,dr->btr", self.dtype))
        q_BTHQ = jnp.einsum("btr,rhq->bthq", q_BTr, self._w(self.wq_b, q_BTr))
        return q_BTHQ + lora.delta(self, "wq_b", q_BTr, "btr,rhq->bthq", self.dtype), q_BTr

    def _latent(self, x_BTD: jax.Array) -> jax.Array:
        kv_BTL = weight_gather.einsum("btd,dl->btl", x_BTD, self.wkv_a, self.dtype)
        return kv_BTL + lora.delta(self, "wkv_a", x_BTD, "btd,dl->btl", self.dtype)

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache | None = None,
        segments_BT: jax.Array | None = None,
        logit_stats: dict | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """`logit_stats`: as `Attention`'s (each head's logit q_nope . k_nope + q_pe . k_pe)."""
        y_BTD, cache, _ = self.with_selection(
            x_BTD, positions_BT, cache, segments_BT, logit_stats=logit_stats
        )
        return y_BTD, cache

    @scoped(ATTENTION)
    def with_selection(
        self, x_BTD, positions_BT, cache=None, segments_BT=None, dsa=None, logit_stats=None
    ):
        """`__call__` under DSA: -> (y, cache, the DSA carry for the next layers). `dsa`
        (`sparse_attention.first_carry`): "picked", an earlier layer's selection, which a
        layer without an indexer of its own attends with (GLM's sharing), and passed on;
        "kl", the indexer losses so far, to which this layer's indexer adds its own.
        `logit_stats`: QK-clip's statistic, as `Attention`'s."""
        check_cache_inputs(cache, segments_BT)
        dsa = dict(dsa or {})
        picked = dsa.get("picked")
        q_BTHQ, q_BTr = self._query(x_BTD)
        q_BTHQ, kv_BTL = checkpoint_name((q_BTHQ, self._latent(x_BTD)), "qkv_proj")
        N, R = self.nope_dim, self.kv_lora_rank
        rope = lambda a: apply_rope(
            a, positions_BT, self.inv_freq, self.rope_style, self.rope_scale
        )
        q_nope_BTHN, q_pe_BTHP = q_BTHQ[..., :N], rope(q_BTHQ[..., N:])
        c_BTR = self.kv_a_norm(kv_BTL[..., :R])
        k_pe_BT1P = rope(kv_BTL[:, :, None, R:])
        indexed = (x_BTD, q_BTr, picked)
        if cache is None:
            keep_BTS, teach = self._own_selection(indexed, positions_BT, segments_BT)
            teach = teach if "kl" in dsa else None
            out_BTHV, kl = self._expanded(
                q_nope_BTHN, q_pe_BTHP, c_BTR, k_pe_BT1P, positions_BT, segments_BT,
                None if self.dense_warmup else keep_BTS, teach, logit_stats,
            )  # fmt: skip
            if kl is not None:
                dsa["kl"] = dsa["kl"] + kl
        else:
            out_BTHV, cache, keep_BTS = self._absorbed(
                q_nope_BTHN, q_pe_BTHP, c_BTR, k_pe_BT1P, positions_BT, cache, indexed
            )
        y_BTD = weight_gather.einsum("bthv,hvd->btd", out_BTHV, self.wo, self.dtype)
        y_BTD = y_BTD + lora.delta(self, "wo", out_BTHV, "bthv,hvd->btd", self.dtype)
        if self.passes_selection:
            dsa["picked"] = keep_BTS
        return checkpoint_name(y_BTD, "out_proj"), cache, dsa or None

    def _selection(self, indexed, positions_BT, k_BSI, allowed_BTS):
        """(the keys each query attends [B, T, S] under DSA (None: dense mla), its indexer's
        scores [B, T, S] or None): the indexer's top-k of the `allowed_BTS` keys `k_BSI`, or
        the selection passed in `indexed` (a layer without an indexer)."""
        x_BTD, q_BTr, picked = indexed
        if self.index_topk == 0:
            return None, None
        if not hasattr(self, "indexer"):
            if picked is None:
                raise ValueError("a DSA layer sharing a selection needs an earlier layer's")
            return picked, None
        scores_BTS = self.indexer.scores(x_BTD, q_BTr, positions_BT, k_BSI)
        return sparse.select(scores_BTS, allowed_BTS, self.index_topk), scores_BTS

    def _own_selection(self, indexed, positions_BT, segments_BT):
        """`_selection` over the call's own tokens (causal by order, within documents) ->
        (selection, what the indexer's loss takes of it: (scores, the set the loss spans,
        the real queries), or None without an indexer)."""
        if not hasattr(self, "indexer"):
            return self._selection(indexed, positions_BT, None, None)[0], None
        T = positions_BT.shape[1]
        order = jnp.arange(T)
        segments = None if segments_BT is None else (segments_BT, segments_BT)
        allowed_BTS = attention_mask(
            positions_BT, positions_BT, order=(order, order), segments=segments
        )
        k_BTI = self.indexer.keys(indexed[0], positions_BT)
        keep_BTS, scores_BTS = self._selection(indexed, positions_BT, k_BTI, allowed_BTS)
        # the loss over all the allowed keys while the attention is dense, else the selection
        spans_BTS = allowed_BTS if self.dense_warmup else keep_BTS
        valid_BT = jnp.ones(positions_BT.shape, bool) if segments_BT is None else segments_BT != 0
        return keep_BTS, (scores_BTS, spans_BTS, valid_BT)

    def _expanded(
        self, q_nope_BTHN, q_pe_BTHP, c_BTR, k_pe_BT1P, positions_BT, segments_BT, keep_BTS,
        teach=None, stats=None,
    ):  # fmt: skip
        """Self-attention over the call's tokens with every head's keys and values expanded
        (under a context axis from the latent each shard gathers: `context_parallel`), each
        query to the keys `keep_BTS` selects (DSA; None: all) -> (out, the indexer's loss
        where `teach` = `indexer_kl`'s (scores, set, valid queries), else None). QK-clip's
        statistic into `stats` through the blocked path (as `Attention._blocked`)."""
        B, T, H, P = q_pe_BTHP.shape
        if context_parallel.active(T):
            q_BTHQ = jnp.concatenate([q_nope_BTHN, q_pe_BTHP], axis=-1)
            w_uk, w_uv = self._w(self.wk_b, c_BTR), self._w(self.wv_b, c_BTR)
            args = (q_BTHQ, c_BTR, k_pe_BT1P, w_uk, w_uv, positions_BT, segments_BT)
            out = context_parallel.latent_attention(
                *args, scale=self.scale, strategy=self.context_strategy
            )
            return out, None
        k_nope_BTHN = jnp.einsum("btr,rhn->bthn", c_BTR, self._w(self.wk_b, c_BTR))
        v_BTHV = jnp.einsum("btr,rhv->bthv", c_BTR, self._w(self.wv_b, c_BTR))
        k_pe_BTHP = jnp.broadcast_to(k_pe_BT1P, (B, T, H, P))
        q_BTHQ = jnp.concatenate([q_nope_BTHN, q_pe_BTHP], axis=-1)
        k_BTHQ = jnp.concatenate([k_nope_BTHN, k_pe_BTHP], axis=-1)
        if self.max_logit and stats is not None:  # QK-clip's statistic, by the blocked path
            keep = {} if keep_BTS is None else {"keep_BTS": keep_BTS}
            args = (q_BTHQ, k_BTHQ, v_BTHV, positions_BT, segments_BT)
            out, stats["max_logit"] = blocked_self_attention(
                *args, scale=self.scale, with_max=True, **keep
            )
        else:
            out = self._self_attention(q_BTHQ, k_BTHQ, v_BTHV, positions_BT, segments_BT, keep_BTS)
        if teach is None:
            return out, None
        return out, sparse.indexer_kl(q_BTHQ, k_BTHQ, self.scale, *teach)

    def _self_attention(
        self, q_BTHQ, k_BTHQ, v_BTHV, positions_BT, segments_BT, keep_BTS=None
    ) -> jax.Array:
        """Multi-head causal attention (K = H) by the kernel chosen for the target backend;
        under DSA (`keep_BTS`) the blocked XLA path on every backend, since the fused
        kernels take no mask of our own (the masked dense form: `sparse_attention.py`)."""
        impl = backends.choose("attention", self.impl, dtype=q_BTHQ.dtype, length=q_BTHQ.shape[1])
        if impl == "blocked" or keep_BTS is not None:  # takes a value head dim of its own
            keep = {} if keep_BTS is None else {"keep_BTS": keep_BTS}
            return blocked_self_attention(
                q_BTHQ, k_BTHQ, v_BTHV, positions_BT, segments_BT, scale=self.scale, **keep
            )
        # The fused kernels are called with one head dim for q, k and v: v (dv 128 under
        # dn + dr = 192 in DeepSeek-V3) is padded with zeros to it and those outputs dropped
        # (zeros padded to q and k would change no score). cuDNN >= 9.10 on Hopper takes
        # dv != dn + dr itself (jax's "mla" check), but that was not run here: the padded call
        # is the one the GQA layers run, on any GPU.
        width = max(q_BTHQ.shape[-1], v_BTHV.shape[-1])
        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, width - a.shape[-1])))
        ids_BT = attention_kernels.mask_ids(positions_BT, segments_BT, 0)
        if impl == "cudnn":  # which scales q by width ** -0.5 itself
            q_BTHQ = q_BTHQ * (self.scale * width**0.5)
            kernel = attention_kernels.cudnn
        else:  # splash takes q already scaled
            q_BTHQ = q_BTHQ * self.scale
            kernel = attention_kernels.splash
        out = kernel(pad(q_BTHQ), pad(k_BTHQ), pad(v_BTHV), ids_BT, checkpoint=ATTENTION_OUT)
        return out[..., : v_BTHV.shape[-1]]

    def _absorbed(self, q_nope_BTHN, q_pe_BTHP, c_BTR, k_pe_BT1P, positions_BT, cache, indexed):
        """Write [c | k_pe] into the latent cache at the rows' positions, then attend the
        whole cache in the absorbed form (the module doc), `PREFILL_BLOCK` queries at a time.
        Causal by position: slots not yet written sit at positions after every query. Under
        DSA the indexer's keys are written and read likewise ("index_k"), and each query
        attends the cached keys its selection keeps. -> (out, cache, selection or None)."""
        R = self.kv_lora_rank
        q_lat_BTHR = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, self._w(self.wk_b, q_nope_BTHN))
        q_BTHL = jnp.concatenate([q_lat_BTHR, q_pe_BTHP], axis=-1)
        new_BT1L = jnp.concatenate([c_BTR[:, :, None], k_pe_BT1P], axis=-1)
        cache_in = cache
        if is_paged(cache):  # the engine's pages (`paged_kv`), read through the page table
            if self.index_topk:  # refused before (`engine.sizes.model_problem`)
                raise ValueError("the engine's paged cache has no place for DSA's indexer keys")
            kv, k_pos_BS, cache = paged_keys(cache, {"latent": new_BT1L}, positions_BT)
            latent_BS1L = kv["latent"]
        else:
            start_B = positions_BT[:, 0]
            latent_BS1L = write_cache(cache["latent"], new_BT1L, start_B)
            B, S = latent_BS1L.shape[:2]
            k_pos_BS = jnp.broadcast_to(jnp.arange(S, dtype=positions_BT.dtype), (B, S))
            cache = {"latent": latent_BS1L}
        k_BSI = None
        if hasattr(self, "indexer"):
            new_BT1I = self.indexer.keys(indexed[0], positions_BT)[:, :, None]
            cache["index_k"] = write_cache(cache_in["index_k"], new_BT1I, start_B)
            k_BSI = cache["index_k"][:, :, 0]
        allowed_BTS = attention_mask(positions_BT, k_pos_BS)
        keep_BTS = self._selection(indexed, positions_BT, k_BSI, allowed_BTS)[0]
        attended_BTS = None if self.dense_warmup else keep_BTS
        kv_BS1L = latent_BS1L.astype(self.dtype)

        def attend_block(q, pos, *keep):  # keep: the block's rows of the selection (DSA)
            mask_BTS = attention_mask(pos, k_pos_BS)
            mask_BTS = mask_BTS & keep[0] if keep else mask_BTS
            return attend(q, kv_BS1L, kv_BS1L, mask_BTS, self.scale)

        selection = () if attended_BTS is None else (attended_BTS,)
        out_BTHL = in_prefill_blocks(attend_block, q_BTHL, positions_BT, *selection)
        out_BTHV = jnp.einsum("bthr,rhv->bthv", out_BTHL[..., :R], self._w(self.wv_b, out_BTHL))
        return out_BTHV, cache, keep_BTS
