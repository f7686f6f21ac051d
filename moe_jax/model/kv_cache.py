"""The KV cache of a decoder layer: its layout, writing new keys and values at their
positions, and a sliding-window layer's ring of its last W positions (attention.py reads it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# {"k": [B, S, K, hd], "v": [B, S, K, hd]}; a sliding-window layer's ring also "pos": [B, S];
# an MLA layer's {"latent": [B, S, 1, kv_lora_rank + qk_rope_head_dim]} instead (mla.py)
KVCache = dict[str, jax.Array]


def ring_keys(cache: KVCache, k_BTKD, v_BTKD, positions_BT):
    """(k, v, positions) a call attends to with a ring cache: the ring's keys older than the
    call's first position (-1 for the rest), then the call's own (padding: -1)."""
    old_BW = cache["pos"] < positions_BT[:, :1]
    ring_pos_BW = jnp.where(old_BW, cache["pos"], -1)
    k_BSKD = jnp.concatenate([cache["k"], k_BTKD.astype(cache["k"].dtype)], axis=1)
    v_BSKD = jnp.concatenate([cache["v"], v_BTKD.astype(cache["v"].dtype)], axis=1)
    pos_BS = jnp.concatenate([ring_pos_BW, jnp.maximum(positions_BT, -1)], axis=1)
    return k_BSKD, v_BSKD, pos_BS.astype(positions_BT.dtype)


def write_ring(cache: KVCache, k_BTKD, v_BTKD, positions_BT) -> KVCache:
    """The ring with the call's newest W tokens (those not padding, a prefix of the row) in
    the slots of their positions mod W. W consecutive positions take W distinct slots."""
    W = cache["k"].shape[1]
    T = positions_BT.shape[1]
    m = min(T, W)

    def one_row(k_WKD, v_WKD, pos_W, k_TKD, v_TKD, pos_T):
        first = jnp.clip(jnp.sum(pos_T >= 0) - m, 0, T - m)  # the last m written tokens
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, first, m, axis=0)
        new_pos_m = take(pos_T)
        slot_m = jnp.where(new_pos_m >= 0, new_pos_m % W, W)  # W: out of range, dropped
        put = lambda ring, new: ring.at[slot_m].set(new.astype(ring.dtype), mode="drop")
        return put(k_WKD, take(k_TKD)), put(v_WKD, take(v_TKD)), put(pos_W, new_pos_m)

    k, v, pos = jax.vmap(one_row)(cache["k"], cache["v"], cache["pos"], k_BTKD, v_BTKD,
                                  positions_BT)  # fmt: skip
    return {"k": k, "v": v, "pos": pos}


def write_cache(cache_BSKH: jax.Array, new_BTKH: jax.Array, start_B: jax.Array) -> jax.Array:
    """Write each row's new keys/values at that row's start position."""
    update = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0)
    return jax.vmap(update)(cache_BSKH, new_BTKH, start_B)


def check_cache_inputs(cache, segments_BT) -> None:
    """Packed documents (segments) and a KV cache do not mix (ValueError)."""
    if cache is not None and segments_BT is not None:
        raise ValueError(
            "segments are for forwards without a KV cache (training, scoring); a cached "
            "prefill or decode takes one document per row: drop segments or the cache"
        )
