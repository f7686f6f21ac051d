"""DeepSeek-V3's multi-token prediction (MTP, arXiv:2412.19437 sec. 2.2): `model.mtp_depth`
sequential modules, module k predicting the token k + 1 places ahead of each position.

For depth k = 1..D and position t (h_0 = the main model's last layer output, before its norm):

    h'_k(t) = eh_proj [RMSNorm_e(Emb(token t+k)) ; RMSNorm_h(h_{k-1}(t))]     # [2D] -> [D]
    h_k     = DecoderLayer(h'_k)            # attention (causal over t) + MoE or dense FFN
    P_k(t)  = softmax(RMSNorm_k(h_k(t)) @ head)   # predicts token t+k+1

The embedding and the output head are the main model's own parameters (one copy each: the MTP
loss trains them too); each depth has its own norms, projection, decoder layer (of the kind of
the main model's last layer: attention + MoE or dense) and output norm. The MTP loss is
`train.mtp_loss_weight / D * sum_k CE_k` (`moe_jax.train.step`), CE_k over the positions
whose target t+k+1 lies in the row, in the same document, and is counted by the loss mask.

The order of the concatenation is the released checkpoints': vLLM, SGLang, Megatron-LM and
MaxText all put the embedding half first, although the paper's eq. 21 writes
[RMSNorm(h); RMSNorm(Emb)]. The order only permutes eh_proj's input rows, so training from
scratch cannot tell, but an imported eh_proj is right only in the checkpoint's order.

Parameters of depth k (`Transformer.mtp[k-1]`) and where a Hugging Face DeepSeek-V3 or
GLM-4.5 checkpoint keeps them (layer L + k - 1, L = num_hidden_layers), which
`moe_jax.interop` imports and exports (`num_nextn_predict_layers` = model.mtp_depth):
    enorm.scale [D]            model.layers.{L+k-1}.enorm.weight
    hnorm.scale [D]            model.layers.{L+k-1}.hnorm.weight
    eh_proj [2D, D]            model.layers.{L+k-1}.eh_proj.weight ([D, 2D]: transposed)
    layer.*                    model.layers.{L+k-1}.{input_layernorm, self_attn,
                               post_attention_layernorm, mlp}.* (as the main layers map)
    head_norm.scale [D]        model.layers.{L+k-1}.shared_head.norm.weight
The checkpoint's embed_tokens and shared_head.head of that layer are copies of the main
model's embedding and head: here they are those parameters themselves (an import checks that
the copies are exact and skips them, an export writes them, as the released checkpoints and
the serving engines that read them from that layer have them).

At sampling, the depths draft a chain of next tokens for speculative decoding (depth k the
token k ahead, `inference.speculative`): each depth's decoder layer keeps a KV cache like the
main layers (`Transformer.init_cache(mtp=True)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import backends
from moe_jax.config import Config, MoEConfig
from moe_jax.model import weight_gather
from moe_jax.model.norm import RMSNorm
from moe_jax.model.routing import aux_loss
from moe_jax.sharding import param

# Per-MoE-layer statistics of the MTP layers, reported apart from the main model's (whose
# per-layer arrays other code indexes by main layer): [n_mtp_moe_layers, ...].
MTP_LAYER_STATS = {"expert_load": "mtp_expert_load", "dropped_frac": "mtp_dropped_frac"}


class MTPLayer(nnx.Module):
    """One prediction depth: (h_{k-1}, the embedding of token t+k) -> h_k, and h_k's logits."""

    def __init__(self, cfg: Config, layer: nnx.Module, *, rngs: nnx.Rngs):
        """`layer`: the decoder layer of this depth (`transformer.DecoderLayer`, built by the
        Transformer, which this module does not import)."""
        m = cfg.model
        D, eps = m.d_model, m.norm_eps
        self.dtype = jnp.dtype(backends.compute_dtype(m.dtype))
        self.enorm = RMSNorm(D, eps, rngs=rngs)
        self.hnorm = RMSNorm(D, eps, rngs=rngs)
        init = nnx.initializers.normal(m.init_std)
        self.eh_proj = param(rngs, init, (2 * D, D), (None, "embed"))
        self.layer = layer
        self.head_norm = RMSNorm(D, eps, rngs=rngs)

    def __call__(self, h_BTD, emb_BTD, positions_BT, cache, n_groups: int, segments_BT):
        """-> (h_k [B, T, D], the layer's new cache, its MoE stats or None); `emb_BTD`: the
        embeddings of the tokens k places ahead of each position."""
        x_BTC = jnp.concatenate([self.enorm(emb_BTD), self.hnorm(h_BTD)], axis=-1)
        x_BTD = weight_gather.einsum("btc,cd->btd", x_BTC, self.eh_proj, self.dtype)
        # (its own DSA selection, if any: the last layer of its kind runs an indexer)
        return self.layer(x_BTD, positions_BT, cache, n_groups, segments_BT)[:3]

    def logits(self, h_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
        """This depth's output norm, then the shared head [D, V] -> float32 logits [B, T, V]."""
        return (self.head_norm(h_BTD) @ head_DV).astype(jnp.float32)


def mtp_hidden(model, x_BTD, ahead_KBT: list, positions_BT=None, segments_BT=None) -> list:
    """The MTP depths over a batch: [(h_k [B, T, D], MoE stats or None) for k = 1..D].

    `model`: a Transformer with `mtp`; `x_BTD`: its last layer's output (`head=False`);
    `ahead_KBT[k-1]`: token t+k at each position t [B, T] (anything where t+k is past the
    row: those positions predict nothing counted). Positions and segments are the main
    forward's (a packed row's documents stay apart in the MTP layers' attention too)."""
    B, T = x_BTD.shape[:2]
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h_BTD, out = x_BTD, []
    for layer, ahead_BT in zip(model.mtp, ahead_KBT, strict=True):
        emb_BTD = weight_gather.lookup(ahead_BT, model.embed.embedding, model.dtype)
        h_BTD, _, stats = layer(h_BTD, emb_BTD, positions_BT, None, 1, segments_BT)
        out.append((h_BTD, stats))
    return out


def with_mtp_stats(aux: dict, mtp_aux: dict, cfg: MoEConfig) -> dict:
    """`aux` (the Transformer's) with the MTP layers' MoE counted among the MoE layers.
    `mtp_aux`: the same statistics of the MTP layers alone (`layer_stats.moe_aux` of their
    stats). The losses over layers take them in as every other layer: "lb_loss" and "z_loss"
    means over the main model's and the MTP's MoE layers, "seq_lb_loss" their sum, so that
    the MTP routers learn to balance as the others do; then "aux_loss" of those
    (`routing.aux_loss`). The MTP's expert load and dropped fraction come as
    MTP_LAYER_STATS, apart from the main layers'."""
    n_main, n_mtp = aux["expert_load"].shape[0], mtp_aux["expert_load"].shape[0]
    if not n_mtp:  # dense MTP layers
        return aux
    mean = lambda a, b: (a * n_main + b * n_mtp) / (n_main + n_mtp)
    out = aux | {k: mean(aux[k], mtp_aux[k]) for k in ("lb_loss", "z_loss")}
    if "seq_lb_loss" in mtp_aux:
        out["seq_lb_loss"] = aux.get("seq_lb_loss", 0.0) + mtp_aux["seq_lb_loss"]
    out["aux_loss"] = aux_loss(out, cfg)
    return out | {name: mtp_aux[key] for key, name in MTP_LAYER_STATS.items()}
