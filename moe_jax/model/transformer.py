"""The decoder: embedding -> pre-norm blocks (attention + dense/MoE FFN) -> norm -> head.

Layers are stored as `n_layers // P` stacked copies of a *block* of P consecutive layers, where
P = cfg.layer_period is the period of the (RoPE/NoPE, MoE/dense) pattern, plus a tail of the
remaining `n_layers % P` layers. One parameter layout serves both execution modes:
`model.scan_layers=true` runs the stacked blocks with `lax.scan` (compile time independent of
depth), `false` unrolls them, and the two give the same numbers from the same checkpoint.
Under the scan, `model.remat` (dots | full) makes the backward recompute each block's
forward from the block's input instead of keeping its activations: medium benchmark training
keeps 2.5 GB of XLA temporaries with none, 2.1 GB with dots (~2% slower), 1.0 GB with full
(~14% slower). Unrolled, XLA:CPU schedules the recomputation back into the forward and saves
nothing, so the config accepts remat only with the scan. Named activations can be kept or
offloaded to host memory on top of dots or full (`remat.py`).

    logits_BTV, aux = model(tokens_BT)
    logits_BTV, aux, cache = model(tokens_BT, positions=positions_BT, cache=cache)
    logits_BTV, aux = model(tokens_BT, positions=positions_BT, segments=segments_BT)  # packed
    logits_B1V, aux = model(tokens_BT, logits_at=index_B)      # one position per row
    x_BTD, aux = model(tokens_BT, head=False); model.logits(x_BTD)   # the head applied later
    logits_BTV, aux = model(tokens_BT, images=images_BND, image_mask=mask_BT)   # model.vision > 0

With `model.hc_mult` = N > 0 (DeepSeek-V4's hyper-connections, `hyper_connections.py`) the
residual between the layers is N streams [B, T, N, D]: the embedding copied N times, each
block's input and residual made from them, and `hc_head` merging them after the last layer.

With `model.mtp_depth` > 0 the model also holds `mtp`, DeepSeek-V3's multi-token prediction
layers (`mtp.py`): the forward never runs them; the loss applies them to the `head=False`
output, and speculative sampling drafts with them (`moe_jax.inference.speculative`).

Image inputs (`model.vision` = d_vision > 0): precomputed image embeddings [B, N, d_vision] go
through a learned projection `vision_proj` [d_vision, d_model] and replace the token embeddings
at the positions the boolean `image_mask` [B, T] marks, in order (row b's n-th marked position
gets row b's n-th embedding); the tokens there are placeholders whose ids are never read. Every
row must mark exactly N positions. Shapes are checked at trace time and the counts too when the
mask is concrete; under jit a traced mask cannot be checked, and a row marking fewer positions
drops its last embeddings while one marking more repeats its last. The images enter before the
first layer, so they work with `cache=` (prefill) and the layer scan alike.

Packed rows (no cache): `segments` [B, T] int32 numbers the documents of each row (0 for
padding) and `positions` restart at 0 at each document; attention never crosses a document
(see `attention.py`), and padding tokens take no MoE expert capacity and count in no aux
statistic (see `moe.py`). `logits_at` [B] int32 computes the final norm and the head at one
position per row only (`logits`): the last prompt token of a prefill, without [B, T, V].

`aux`: "aux_loss" (the weighted losses, add it to the LM loss: `routing.aux_loss`), "lb_loss"
and "z_loss" (unweighted means over MoE layers), with moe.seq_aux_loss_weight "seq_lb_loss"
(DeepSeek-V3's sequence-wise loss, unweighted, summed over MoE layers), "expert_load"
[n_moe_layers, E] (fraction of top-k assignments per expert), "dropped_frac" [n_moe_layers]
(fraction dropped by capacity), "exchange_rounds" and "overflow_frac" [n_moe_layers] (the
ragged exchange's rounds and the fraction of rows past the first round; 1 and 0 on the other
paths).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moe_jax import backends
from moe_jax.config import Config, check_lora_targets
from moe_jax.model import (
    context_parallel,
    hyper_connections,
    in_turn,
    layer_stats,
    linear_attention,
    lora,
    weight_gather,
)
from moe_jax.model.attention import Attention
from moe_jax.model.image_inputs import check_image_inputs
from moe_jax.model.int8 import QuantizedParam, after
from moe_jax.model.kv_cache import KVCache
from moe_jax.model.layer_stats import LAYER_FRACTIONS
from moe_jax.model.mla import MLAttention, mla_cache
from moe_jax.model.moe import MoE, SwiGLU
from moe_jax.model.mtp import MTPLayer
from moe_jax.model.norm import RMSNorm
from moe_jax.model.remat import remat
from moe_jax.model.sparse_attention import first_carry
from moe_jax.named_scopes import MLP
from moe_jax.sharding import at_block_boundary, param

__all__ = ["LAYER_FRACTIONS", "DecoderLayer", "Transformer"]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Config, layer: int, *, rngs: nnx.Rngs, standalone: bool = False):
        """`standalone`: a layer outside the layer scan (the dense prefix, the tail, an MTP
        layer), which applies `model.remat` itself (the scan's body applies it to the rest)."""
        m = cfg.model
        D, eps = m.d_model, m.norm_eps
        # Its input is kept by the checkpoint itself: offloading its named copy would only
        # add a host copy of it.
        offload = tuple(n for n in m.remat_offloaded if n != "layer_input")
        # (Unrolled, model.scan_layers=false, no layer applies it, as the blocks do not.)
        on = standalone and m.scan_layers
        self.remat = (m.remat, m.remat_saved, offload) if on else ("none", (), ())
        centred = m.zero_centered_norm
        self.attn_norm = RMSNorm(D, eps, rngs=rngs, zero_centered=centred)
        # A hybrid stack's linear layers hold a Gated DeltaNet where the others hold attention
        self.is_linear = cfg.is_linear(layer)
        if self.is_linear:
            self.attn = linear_attention.linear_layer(cfg, rngs=rngs)
        else:
            kind = MLAttention if cfg.attention.kind == "mla" else Attention
            self.attn = kind(cfg, layer, rngs=rngs)
        self.sparse = cfg.attention.index_topk > 0  # DSA: its carry passes between layers
        self.ffn_norm = RMSNorm(D, eps, rngs=rngs, zero_centered=centred)
        self.is_moe = cfg.is_moe(layer)
        self.hashed = cfg.is_hashed(layer)  # moe.hash_layers: routed by token id
        if self.is_moe:
            self.ffn = MoE(cfg, rngs=rngs, hashed=self.hashed)
        else:
            self.ffn = SwiGLU(D, cfg.model.ffn_hidden, cfg, rngs=rngs)
            lora.attach(self.ffn, cfg, "mlp", rngs)
        if m.hc_mult:  # model.hc_mult: the residual is that many streams (hyper_connections)
            self.attn_hc = hyper_connections.HyperConnection(cfg, rngs=rngs)
            self.ffn_hc = hyper_connections.HyperConnection(cfg, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, cache: KVCache | None, n_groups: int, segments_BT,
                 replay=None, dsa=None):  # fmt: skip
        """-> (x_BTD, cache, stats: the MoE's, None for a dense FFN, with train.qk_clip also the
        attention's "max_logit" [H] in a training forward; the DSA carry for the next layers).
        With model.hc_mult the residual x is the streams x_BTND (`hyper_connections`).
        `replay` [B, T, K]: routing replay's experts for an MoE layer, a hash-routed layer's
        table rows (`MoE.__call__`); `dsa`:
        what DSA passes between layers (`sparse_attention.first_carry`: GLM's shared selection,
        the indexer losses' sum), or None."""
        args = (positions_BT, cache, n_groups, segments_BT, replay, dsa)
        if cache is not None or self.remat[0] == "none":
            return self._forward(x_BTD, *args)
        # Kept whole, the dense prefix's 3 layers and the MTP layer held DeepSeek-V3's
        # activations at 8192 tokens (attention's q, k, v, the FFN's hidden) beside the scan's.
        graphdef, state = nnx.split(self)

        def run(state, x_BTD, positions_BT, segments_BT, replay, dsa):
            layer = nnx.merge(graphdef, state)
            x_BTD, _, stats, dsa = layer._forward(
                x_BTD, positions_BT, None, n_groups, segments_BT, replay, dsa
            )
            return x_BTD, stats, dsa

        run = remat(run, *self.remat, scanned=False)
        x_BTD, stats, dsa = run(state, x_BTD, positions_BT, segments_BT, replay, dsa)
        return x_BTD, None, stats, dsa

    def _forward(
        self, x_BTD, positions_BT, cache, n_groups: int, segments_BT, replay=None, dsa=None
    ):
        # Every use of the input reads this named copy, so that a remat policy keeping it
        # (model.remat_offload=layer_input) replaces the input the layer scan would keep.
        # The activations are pinned to rows over the batch axes at every layer boundary
        # (sharding.at_block_boundary), rather than left to the partitioner's propagation.
        x_BTD = checkpoint_name(at_block_boundary(x_BTD), "layer_input")
        layer = after(x_BTD, self)  # int8 weights are dequantised in this layer's turn
        # The block's input and how its output joins the residual: x + h, or with
        # model.hc_mult the hyper-connections' mix of the streams
        x_in, residual = hyper_connections.enter(getattr(layer, "attn_hc", None), x_BTD)
        h_BTD = layer.attn_norm(x_in)
        logit_stats = {}  # QK-clip's per-head max logit, when the attention takes it
        if self.is_linear:
            h, cache = linear_attention.mix(layer.attn, h_BTD, positions_BT, cache, segments_BT)
        elif self.sparse:
            args = (h_BTD, positions_BT, cache, segments_BT, dsa)
            h, cache, dsa = layer.attn.with_selection(*args)
        else:
            h, cache = layer.attn(h_BTD, positions_BT, cache, segments_BT, logit_stats)
        x_in, residual = hyper_connections.enter(getattr(layer, "ffn_hc", None), residual(h))
        if self.is_moe:
            valid_BT = None if segments_BT is None else segments_BT != 0
            h, stats = layer.ffn(layer.ffn_norm(x_in), n_groups, valid_BT, replay)
        else:
            with jax.named_scope(MLP):
                h, stats = layer.ffn(layer.ffn_norm(x_in)), None
        if logit_stats:
            stats = (stats or {}) | logit_stats
        return at_block_boundary(residual(h)), cache, stats, dsa


class Block(nnx.Module):
    """P consecutive layers whose pattern repeats through the stack."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        k = cfg.prefix_layers  # the pattern's layers come after the prefix
        self.layers = nnx.List(
            [DecoderLayer(cfg, k + j, rngs=rngs) for j in range(cfg.layer_period)]
        )

    def __call__(
        self, x_BTD, positions_BT, caches, n_groups: int, segments_BT, replays=None, dsa=None
    ):
        """`replays`: per layer, its replayed experts (None: its own routing, or dense);
        `dsa`: the DSA carry passed between layers (`DecoderLayer`)."""
        new_caches, all_stats = [], []
        for j, layer in enumerate(self.layers):
            cache = caches[j] if caches else None
            replay = replays[j] if replays else None
            x_BTD, c, stats, dsa = layer(
                x_BTD, positions_BT, cache, n_groups, segments_BT, replay, dsa
            )
            new_caches.append(c)
            all_stats.append(stats)
        return x_BTD, new_caches, all_stats, dsa


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        check_lora_targets(cfg)  # an init_from HF architecture's first check
        m = cfg.model
        self.cfg = cfg
        self.dtype = jnp.dtype(backends.compute_dtype(m.dtype))
        init = nnx.initializers.normal(m.init_std)
        P, k = cfg.layer_period, cfg.prefix_layers
        self.n_blocks, n_tail = divmod(m.n_layers - k, P)
        self.embed = nnx.Module()
        self.embed.embedding = param(rngs, init, (m.vocab_size, m.d_model), ("vocab", "embed"))

        if self.n_blocks:

            @nnx.split_rngs(splits=self.n_blocks)
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs):
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        # Tail layers continue the pattern: layer k + n_blocks * P + j is like block layer j.
        alone = functools.partial(DecoderLayer, rngs=rngs, standalone=True)
        self.tail = nnx.List([alone(cfg, k + j) for j in range(n_tail)])
        if k:  # moe.first_dense_layers dense (DeepSeek-V3's 3), moe.hash_layers hash-routed
            self.prefix = nnx.List([alone(cfg, i) for i in range(k)])
        self.final_norm = RMSNorm(
            m.d_model, m.norm_eps, rngs=rngs, zero_centered=m.zero_centered_norm
        )
        if not m.tie_embeddings:
            self.head = param(rngs, init, (m.d_model, m.vocab_size), ("embed", "vocab"))
        if m.hc_mult:  # merges the residual streams before the final norm (hyper_connections)
            self.hc_head = hyper_connections.HyperHead(cfg, rngs=rngs)
        if m.vision:
            # Created last, so a text model and its vision variant draw identical other params.
            self.vision_proj = param(rngs, init, (m.vision, m.d_model), (None, "embed"))
        if m.mtp_depth:  # after the rest, which it leaves as a model without it draws it
            # one decoder layer per depth, of the last layer's kind (mtp.py)
            last = m.n_layers - 1
            self.mtp = nnx.List(
                [MTPLayer(cfg, alone(cfg, last), rngs=rngs)
                 for _ in range(m.mtp_depth)]
            )  # fmt: skip

    # ------------------------------------------------------------------ KV cache

    def init_cache(self, batch_size: int, max_len: int, dtype=None, *, mtp=False) -> dict:
        """Zeroed KV cache for `max_len` positions: {"blocks": [P x stacked], "tail": [...]},
        and "prefix" [...] for the prefix (moe.first_dense_layers, moe.hash_layers).
        A sliding-window layer whose window is shorter keeps a ring of the window only, with
        each slot's position ("pos", -1: empty; see `attention`). An MLA layer keeps its
        latent instead of k and v ({"latent"}, see `mla`), a linear-attention layer its
        convolution window and state ({"conv", "state"}, see `linear_attention`). With
        `mtp`, "mtp": one per MTP layer (model.mtp_depth), for `speculative` (the main
        forward passes it through)."""
        cfg = self.cfg
        dtype = dtype or self.dtype

        def zeros(j: int, lead=()) -> dict:  # layer j's (or any layer's of its pattern)
            if cfg.is_linear(j):  # a window and a state, whatever max_len
                return linear_attention.zeros_cache(cfg, (*lead, batch_size), dtype)
            if cfg.attention.kind == "mla":  # DSA's indexer keys too, where j runs one
                return mla_cache(cfg, j, (*lead, batch_size, max_len), dtype)
            window = cfg.attention.sliding_window if cfg.uses_window(j) else 0
            length = window if 0 < window < max_len else max_len
            shape = lead + (batch_size, length, cfg.attention.n_kv_heads, cfg.head_dim)
            cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            if length < max_len:
                cache["pos"] = jnp.full(shape[:-2], -1, jnp.int32)
            return cache

        P, k = cfg.layer_period, cfg.prefix_layers
        blocks = [zeros(k + j, (self.n_blocks,)) for j in range(P)] if self.n_blocks else []
        cache = {"blocks": blocks, "tail": [zeros(k + j) for j in range(len(self.tail))]}
        if k:
            cache["prefix"] = [zeros(i) for i in range(k)]
        if mtp:  # the MTP layers' (moe_jax/inference/speculative.py), of the last layer's kind
            cache["mtp"] = [zeros(cfg.model.n_layers - 1) for _ in range(cfg.model.mtp_depth)]
        return cache

    # ------------------------------------------------------------------ forward

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
        cache: dict | None = None,
        n_groups: int = 1,
        images: jax.Array | None = None,
        image_mask: jax.Array | None = None,
        logits_at: jax.Array | None = None,
        head: bool = True,
        routes: jax.Array | None = None,
    ):
        """See the module doc. `routes` [n_moe_layers, B, T, K] int: routing replay."""
        B, T = tokens_BT.shape
        replay = self._replays(routes)
        if positions is None:
            positions = context_parallel.default_positions(B, T)  # under a context axis: its layout
        x_BTD = weight_gather.lookup(tokens_BT, self.embed.embedding, self.dtype)
        if images is not None or image_mask is not None:
            x_BTD = self._insert_images(x_BTD, images, image_mask)
        x_BTD = hyper_connections.spread(x_BTD, self.cfg.model.hc_mult)  # [B, T, N, D] if N

        new_prefix_caches, prefix_stats = [], []
        dsa = first_carry(self.cfg, B, T, cache)
        for i, layer in enumerate(getattr(self, "prefix", [])):  # dense, then hash-routed
            c = cache["prefix"][i] if cache else None
            hashed = layer.ffn.hashed_experts(tokens_BT) if layer.hashed else None
            x_BTD, c, stats, dsa = layer(x_BTD, positions, c, n_groups, segments, hashed, dsa)
            new_prefix_caches.append(c)
            prefix_stats.append(stats)
        block_stats, new_block_caches = [], []
        if self.n_blocks:
            x_BTD, new_block_caches, block_stats, dsa = self._run_blocks(
                x_BTD, positions, cache["blocks"] if cache else None, n_groups, segments,
                replay["blocks"], dsa,
            )  # fmt: skip
        tail_stats, new_tail_caches = [], []
        for i, layer in enumerate(self.tail):
            c = cache["tail"][i] if cache else None
            x_BTD, c, stats, dsa = layer(
                x_BTD, positions, c, n_groups, segments, replay["tail"][i], dsa
            )
            new_tail_caches.append(c)
            tail_stats.append(stats)
        if self.cfg.model.hc_mult:
            x_BTD = self.hc_head(x_BTD)

        if logits_at is not None:  # [B, 1, D]: the one position per row asked for
            x_BTD = jnp.take_along_axis(x_BTD, logits_at[:, None, None], axis=1)
        # head=False: the last layer's output [B, T, D] instead, for `logits` in chunks
        logits_BTV = self.logits(x_BTD) if head else x_BTD
        stats = (prefix_stats, block_stats, tail_stats)
        *stats, max_logit_LH = layer_stats.max_logits(self.cfg, self.n_blocks, *stats)
        aux = layer_stats.moe_aux(self.cfg, self.n_blocks, *stats)
        if max_logit_LH is not None:  # train.qk_clip: [n_layers, H], in layer order
            aux["max_logit"] = max_logit_LH
        if "routes" not in aux:  # no MoE layer
            aux["routes"] = jnp.zeros((0, B, T, self.cfg.moe.top_k), jnp.int32)
        if dsa is not None and "kl" in dsa:  # train.indexer_stage: the indexer layers' mean
            n = sum(self.cfg.runs_indexer(i) for i in range(self.cfg.model.n_layers))
            aux["indexer_loss"] = dsa["kl"] / n
        if cache is None:
            return logits_BTV, aux
        new_cache = {"blocks": new_block_caches, "tail": new_tail_caches}
        if new_prefix_caches:
            new_cache["prefix"] = new_prefix_caches
        return logits_BTV, aux, new_cache | ({"mtp": cache["mtp"]} if "mtp" in cache else {})

    def logits(self, x_BTD: jax.Array, head_DV: jax.Array | None = None) -> jax.Array:
        """Final norm and head: the last layer's output [B, T, D] -> float32 logits [B, T, V].
        `head_DV`: the head weight as `head_weight` gave it (read once for many calls).
        A 16-bit head for a wider compute dtype (bf16 weights on CPU) is converted a chunk
        of the vocabulary at a time (`in_turn.vocab_logits`)."""
        x_BTD = self.final_norm(x_BTD)
        if head_DV is None:
            if self.cfg.model.tie_embeddings:
                return in_turn.vocab_logits(x_BTD, self.embed.embedding[...], 0, self.dtype)
            head = after(x_BTD, self.head)
            if not isinstance(head, QuantizedParam):
                return in_turn.vocab_logits(x_BTD, head[...], 1, self.dtype)
            head_DV = head[...].astype(self.dtype)
        return (x_BTD @ head_DV).astype(jnp.float32)

    def head_weight(self, x=None) -> jax.Array:
        """The output head [D, V] in the compute dtype (`x`: int8 weights wait for it, and
        16-bit ones are converted once it exists)."""
        if self.cfg.model.tie_embeddings:
            table = self.embed.embedding[...].T
            return table.astype(self.dtype) if x is None else in_turn.dense(table, self.dtype, x)
        head = self.head if x is None else after(x, self.head)
        if x is None or isinstance(head, QuantizedParam):
            return head[...].astype(self.dtype)
        return in_turn.dense(head[...], self.dtype, x)

    def _insert_images(self, x_BTD, images_BND, mask_BT) -> jax.Array:
        """The projected image embeddings in place of the token embeddings the mask marks."""
        check_image_inputs(self.cfg.model.vision, x_BTD.shape[:2], images_BND, mask_BT)
        N = images_BND.shape[1]
        if N == 0:  # nothing to place (and a checked mask marks nothing)
            return x_BTD
        proj = self.vision_proj[...].astype(self.dtype)
        img_BND = images_BND.astype(self.dtype) @ proj
        # Marked position t of row b takes embedding (number of marked positions <= t) - 1.
        slot_BT = jnp.clip(jnp.cumsum(mask_BT, axis=1, dtype=jnp.int32) - 1, 0, N - 1)
        img_BTD = jnp.take_along_axis(img_BND, slot_BT[..., None], axis=1)
        return jnp.where(mask_BT[..., None], img_BTD, x_BTD)

    def _run_blocks(self, x_BTD, positions_BT, caches, n_groups, segments_BT, replays, dsa):
        """Apply the stacked blocks; stats come back stacked [n_blocks, ...] per block layer.
        `replays`: per block layer, its replayed experts stacked [n_blocks, B, T, K], or None;
        `dsa`: the DSA carry passed from layer to layer (`DecoderLayer`)."""
        graphdef, state = nnx.split(self.blocks)

        def body(carry, xs):
            x, dsa = carry
            block_state, block_caches, replay = xs
            block = nnx.merge(graphdef, block_state)
            x, new_caches, stats, dsa = block(
                x, positions_BT, block_caches, n_groups, segments_BT, replay, dsa
            )
            return (x, dsa), (new_caches, stats)

        if self.cfg.model.scan_layers:
            if caches is None:  # a forward that may be differentiated: apply model.remat
                m = self.cfg.model
                body = remat(body, m.remat, m.remat_saved, m.remat_offloaded)
            carry, (new_caches, stats) = jax.lax.scan(body, (x_BTD, dsa), (state, caches, replays))
            return carry[0], new_caches, stats, carry[1]
        per_block, carry = [], (x_BTD, dsa)
        for b in range(self.n_blocks):
            xs = jax.tree.map(lambda a, b=b: a[b], (state, caches, replays))
            carry, ys = body(carry, xs)
            per_block.append(ys)
        new_caches, stats = jax.tree.map(lambda *a: jnp.stack(a), *per_block)
        return carry[0], new_caches, stats, carry[1]

    def moe_layers(self) -> list[int]:
        """The MoE layers' indices in layer order: the order of aux["routes"] and `routes`."""
        return [i for i in range(self.cfg.model.n_layers) if self.cfg.is_moe(i)]

    def _replays(self, routes_LBTK) -> dict:
        """`routes` [n_moe_layers, B, T, K] as the layers take it: "blocks", per block layer
        its layers' [n_blocks, B, T, K] (None if dense or not replayed); "tail", per layer."""
        P, k = self.cfg.layer_period, self.cfg.prefix_layers
        tail = range(k + self.n_blocks * P, self.cfg.model.n_layers)
        if routes_LBTK is None:
            return {"blocks": None, "tail": [None] * len(tail)}
        order = {layer: i for i, layer in enumerate(self.moe_layers())}
        if routes_LBTK.shape[0] != len(order):
            raise ValueError(
                f"routes holds {routes_LBTK.shape[0]} MoE layers' experts, the model has "
                f"{len(order)} MoE layers"
            )
        blocks = None
        if self.n_blocks:
            at = lambda j: np.array([order[k + b * P + j] for b in range(self.n_blocks)])
            blocks = [routes_LBTK[at(j)] if k + j in order else None for j in range(P)]
        return {
            "blocks": blocks,
            "tail": [routes_LBTK[order[i]] if i in order else None for i in tail],
        }
