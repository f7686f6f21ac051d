"""A hybrid stack's linear-attention layers (attention.linear: Qwen3-Next's and Qwen3.5's
Gated DeltaNet, `gated_deltanet.py`) in a decoder layer's attention slot: built from the
config, called with attention's contract, and their decode cache beside the KV caches.

    layer = linear_layer(cfg, rngs=rngs)                      # a GatedDeltaNet
    y_BTD, cache = mix(layer, x_BTD, positions_BT, cache, segments_BT)

Without a cache (training, full forwards) the layer runs in chunks from an empty state,
packed rows' documents each on their own (`segments_BT`, 0: padding, which enters as zeros).
With one (the sampler's prefill and decoding) the cache holds the convolution's window and
the rule's state instead of keys and values, `{"conv": [B, C, W - 1], "state": [B, H, K,
V]}` (float32 state), constant in size whatever the context; a call of several tokens runs
the chunked form from the cached state, one token the recurrence. Positions say nothing to
the layer except that a negative one marks padding (the sampler's right-padded prompts),
which leaves the state and the window as they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.model.gated_deltanet import GatedDeltaNet, GDNSizes, GDNState


def gdn_sizes(cfg: Config) -> GDNSizes:
    """The linear layers' sizes from attention.linear_* (their gated norm takes model.norm_eps,
    as transformers' takes rms_norm_eps)."""
    a = cfg.attention
    return GDNSizes(
        d_model=cfg.model.d_model,
        n_key_heads=a.linear_key_heads,
        n_value_heads=a.linear_value_heads,
        key_dim=a.linear_key_dim,
        value_dim=a.linear_value_dim,
        conv_kernel=a.linear_conv_kernel,
        eps=cfg.model.norm_eps,
    )


def linear_layer(cfg: Config, *, rngs: nnx.Rngs) -> GatedDeltaNet:
    dtype = backends.compute_dtype(cfg.model.dtype)
    return GatedDeltaNet(gdn_sizes(cfg), rngs=rngs, init_std=cfg.model.init_std, dtype=dtype)


def zeros_cache(cfg: Config, shape: tuple[int, ...], dtype) -> dict:
    """An empty decode cache for `shape` = (*lead, batch) rows: a zero window (in `dtype`, the
    cache's) and a zero state (float32, the rule's)."""
    s = gdn_sizes(cfg)
    return {
        "conv": jnp.zeros((*shape, s.conv_channels, s.conv_kernel - 1), dtype),
        "state": jnp.zeros((*shape, s.n_value_heads, s.key_dim, s.value_dim), jnp.float32),
    }


def mix(layer: GatedDeltaNet, x_BTD, positions_BT, cache: dict | None, segments_BT=None):
    """The layer on x as `Attention.__call__` is called: -> (y_BTD, the new cache or None)."""
    if cache is None:
        return layer(x_BTD, None, segments_BT), None
    state = GDNState(cache["conv"], cache["state"])
    if x_BTD.shape[1] == 1:  # a decoded token (never padding): the recurrence
        y_BD, state = layer.step(x_BTD[:, 0], state)
        y_BTD = y_BD[:, None]
    else:
        y_BTD, state = layer.prefill(x_BTD, state, positions_BT >= 0)
    new = {"conv": state.conv_BCW.astype(cache["conv"].dtype), "state": state.rule_BHKV}
    return y_BTD, jax.tree.map(lambda a, b: a.astype(b.dtype), new, cache)
