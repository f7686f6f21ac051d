"""Grouped-query attention with RoPE/NoPE, QK-norm, chunked-local and sliding-window masks.

Masks are built from absolute positions (query positions vs key positions), never from array
indices, so the same code serves training (keys = the queries' own tokens) and KV-cache
decoding (keys = the whole cache, written at the queries' positions): slots not yet written
always sit at positions after the query and are masked causally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import Config
from moe_jax.model.norm import RMSNorm, rms_norm
from moe_jax.model.rope import apply_rope, rope_inv_freq
from moe_jax.sharding import param

KVCache = dict[str, jax.Array]  # {"k": [B, S, K, hd], "v": [B, S, K, hd]}


def attention_mask(
    q_pos_BT: jax.Array, k_pos_BS: jax.Array, *, chunk_size: int = 0, window: int = 0
) -> jax.Array:
    """Boolean [B, T, S]: causal, optionally restricted to the query's chunk or a window."""
    q = q_pos_BT[:, :, None]
    k = k_pos_BS[:, None, :]
    mask = k <= q
    if window > 0:
        mask &= q - k < window
    if chunk_size > 0:
        mask &= (q // chunk_size) == (k // chunk_size)
    return mask


def temperature_scale(positions_BT: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """Llama 4 attention-temperature tuning for NoPE layers: sharper attention far out."""
    pos = positions_BT.astype(jnp.float32)
    return jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def write_cache(cache_BSKH: jax.Array, new_BTKH: jax.Array, start_B: jax.Array) -> jax.Array:
    """Write each row's new keys/values at that row's start position."""
    update = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0)
    return jax.vmap(update)(cache_BSKH, new_BTKH, start_B)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, layer: int, *, rngs: nnx.Rngs):
        a = cfg.attention
        D, H, K, hd = cfg.model.d_model, a.n_heads, a.n_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(cfg.model.init_std)
        zeros = nnx.initializers.zeros
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, hd
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.use_rope = cfg.uses_rope(layer)
        self.rope_style = a.rope_style
        self.inv_freq = tuple(rope_inv_freq(hd, a.rope_theta, a.rope_scaling).tolist())
        self.qk_norm = a.qk_norm
        self.norm_eps = cfg.model.norm_eps
        self.temperature_tuning = a.temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = a.floor_scale, a.attn_scale
        self.chunk_size = a.chunk_size if self.use_rope else 0  # NoPE layers attend globally
        self.window = a.sliding_window

        self.wq = param(rngs, init, (D, H, hd), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, init, (D, K, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, init, (D, K, hd), ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs, init, (H, hd, D), ("heads", "head_dim", "embed"))
        if a.qkv_bias:
            self.q_bias = param(rngs, zeros, (H, hd), ("heads", "head_dim"))
            self.k_bias = param(rngs, zeros, (K, hd), ("kv_heads", "head_dim"))
            self.v_bias = param(rngs, zeros, (K, hd), ("kv_heads", "head_dim"))
        if a.o_bias:
            self.o_bias = param(rngs, zeros, (D,), ("embed",))
        if a.qk_norm == "rms":
            self.q_norm = RMSNorm(hd, cfg.model.norm_eps, rngs=rngs)
            self.k_norm = RMSNorm(hd, cfg.model.norm_eps, rngs=rngs)

    def _project(self, x_BTD: jax.Array, name: str) -> jax.Array:
        w = getattr(self, f"w{name}")[...].astype(self.dtype)
        y = jnp.einsum("btd,dhk->bthk", x_BTD, w)
        if hasattr(self, f"{name}_bias"):
            y = y + getattr(self, f"{name}_bias")[...].astype(self.dtype)
        return y

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, cache: KVCache | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        q_BTHD = self._project(x_BTD, "q")
        k_BTKD = self._project(x_BTD, "k")
        v_BTKD = self._project(x_BTD, "v")

        if self.qk_norm == "rms":  # Qwen3: learned, before RoPE, every layer
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        if self.use_rope:
            q_BTHD = apply_rope(q_BTHD, positions_BT, self.inv_freq, self.rope_style)
            k_BTKD = apply_rope(k_BTKD, positions_BT, self.inv_freq, self.rope_style)
            if self.qk_norm == "l2":  # Llama 4: weightless, after RoPE, RoPE layers only
                q_BTHD = rms_norm(q_BTHD, self.norm_eps)
                k_BTKD = rms_norm(k_BTKD, self.norm_eps)
        if self.temperature_tuning:
            scale_BT = temperature_scale(positions_BT, self.floor_scale, self.attn_scale)
            q_BTHD = (q_BTHD * scale_BT[:, :, None, None]).astype(q_BTHD.dtype)

        if cache is None:
            keys, values, k_pos_BS = k_BTKD, v_BTKD, positions_BT
        else:
            start_B = positions_BT[:, 0]
            cache = {
                "k": write_cache(cache["k"], k_BTKD, start_B),
                "v": write_cache(cache["v"], v_BTKD, start_B),
            }
            keys, values = cache["k"], cache["v"]
            B, S = keys.shape[:2]
            k_pos_BS = jnp.broadcast_to(jnp.arange(S, dtype=positions_BT.dtype), (B, S))

        mask_BTS = attention_mask(
            positions_BT, k_pos_BS, chunk_size=self.chunk_size, window=self.window
        )
        out_BTHD = jax.nn.dot_product_attention(
            q_BTHD,
            keys.astype(self.dtype),
            values.astype(self.dtype),
            mask=mask_BTS[:, None, :, :],
            scale=self.head_dim**-0.5,
        )
        y_BTD = jnp.einsum("bthk,hkd->btd", out_BTHD, self.wo[...].astype(self.dtype))
        if hasattr(self, "o_bias"):
            y_BTD = y_BTD + self.o_bias[...].astype(self.dtype)
        return y_BTD, cache
