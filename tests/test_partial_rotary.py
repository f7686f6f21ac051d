"""Partial rotary embeddings (`attention.partial_rotary_factor`, GLM-4.5): RoPE on the first
int(head_dim x factor) dims of each head only.

The attention layer against transformers' Glm4MoeAttention from the same weights (GQA, QK-norm,
q/k/v biases, default and YaRN RoPE); the KV-cache decode, a sliding-window ring cache
included, against the full forward; the fused-kernel path (splash, interpreted on CPU)
against the blocked one; the unrotated dims carrying no position; the config's one-line
errors.

Tolerance 1e-5 (float32, matmuls at "highest", conftest): the compared paths compute the same
sums in another order (torch vs XLA, a cache vs the whole sequence), measured ~1e-6 apart on
O(1) outputs, while rotating the wrong dims or all of them moves outputs by > 1e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.model import Transformer
from moe_jax.model.attention import Attention
from moe_jax.model.rope import apply_rope, rope_inv_freq
from tests.helpers import forward, forward_cached, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)
D, H, K, HD = 32, 4, 2, 16
GLM = [  # tiny.yaml with GLM-4.5's attention: every layer RoPE, rms QK-norm, q/k/v biases
    "attention.nope_interval=0",
    "attention.temperature_tuning=false",
    f"attention.head_dim={HD}",
    "attention.qkv_bias=true",
    "moe.capacity_factor=0",  # no drops: positions may be computed one at a time
]


def glm_config(factor: float, *overrides: str):
    return tiny_config(*GLM, f"attention.partial_rotary_factor={factor}", *overrides)


def scramble(module: nnx.Module, seed: int = 0) -> None:
    """Every weight and bias N(0, 0.3^2), every norm scale 1 + N(0, 0.1^2): O(1) outputs
    where biases and norms all show."""
    for i, (path, p) in enumerate(nnx.iter_graph(module)):
        if isinstance(p, nnx.Param):
            noise = 0.3 * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), p.shape)
            p[...] = 1 + noise / 3 if path[-1] == "scale" else noise


def hf_glm_attention(layer: Attention, cfg, torch, tf):
    """transformers' Glm4MoeAttention (eager, float32) holding `layer`'s weights, and its
    rotary embedding."""
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    a = cfg.attention
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling.type == "yarn":
        s = a.rope_scaling
        rope |= {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
                 "beta_slow": s.beta_slow, "original_max_position_embeddings":
                 s.original_max_position}  # fmt: skip
    hf_cfg = tf.Glm4MoeConfig(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=K, head_dim=HD,
        attention_bias=True, use_qk_norm=True, rms_norm_eps=cfg.model.norm_eps,
        rope_parameters=rope | {"partial_rotary_factor": a.partial_rotary_factor},
        max_position_embeddings=256, attn_implementation="eager",
    )  # fmt: skip
    hf = glm.Glm4MoeAttention(hf_cfg, layer_idx=0).eval()
    t = lambda w: torch.tensor(np.asarray(w[...]))
    weights = {f"{p}_proj.weight": t(getattr(layer, f"w{p}")).reshape(D, -1).T for p in "qkv"} | {
        f"{p}_proj.bias": t(getattr(layer, f"{p}_bias")).reshape(-1) for p in "qkv"
    }
    weights |= {
        "o_proj.weight": t(layer.wo).reshape(H * HD, D).T,
        "q_norm.weight": t(layer.q_norm.scale),
        "k_norm.weight": t(layer.k_norm.scale),
    }
    hf.load_state_dict(weights, strict=True)
    return hf, glm.Glm4MoeRotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("factor", [0.5, 0.25])
@pytest.mark.parametrize("yarn", [False, True])
def test_attention_equals_transformers_glm4_moe(factor, yarn):
    """Same weights, tokens at positions 3..18: our layer's output equals Glm4MoeAttention's
    (half and a quarter of each head rotated, YaRN's band within the rotated dims)."""
    torch = pytest.importorskip("torch", reason="HF parity needs torch (the `interop` extra)")
    tf = pytest.importorskip("transformers", reason="HF parity needs transformers")
    yarn_keys = ["type=yarn", "factor=4.0", "original_max_position=16"] if yarn else []
    cfg = glm_config(factor, *[f"attention.rope_scaling.{k}" for k in yarn_keys])
    layer = Attention(cfg, 0, rngs=nnx.Rngs(0))
    scramble(layer)
    hf, rotary = hf_glm_attention(layer, cfg, torch, tf)
    B, T = 2, 16
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    positions = jnp.broadcast_to(jnp.arange(3, 3 + T), (B, T))
    ours, _ = jax.jit(lambda x, p: layer(x, p))(x, positions)

    x_t, pos_t = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(positions))
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = hf(x_t, rotary(x_t, pos_t), causal.expand(B, 1, T, T))
    assert float(jnp.abs(ours).mean()) > 0.1
    np.testing.assert_allclose(ours, want.numpy(), **TOL)


def test_only_the_first_dims_carry_the_position():
    """apply_rope with a quarter of the frequencies: the last 3/4 of each head are returned
    as they are; the first 1/4 are rotated exactly as a head of that width alone."""
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 16))
    pos = jnp.arange(7, 12)[None]
    inv_freq = rope_inv_freq(4, 10000.0, tiny_config().attention.rope_scaling)
    for style in ("half", "interleaved"):
        out = apply_rope(x, pos, inv_freq, style, scale=1.5)
        np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
        np.testing.assert_array_equal(
            out[..., :4], apply_rope(x[..., :4], pos, inv_freq, style, 1.5)
        )
        assert float(jnp.abs(out[..., :4] - x[..., :4]).max()) > 0.1


@pytest.mark.parametrize("window", [0, 5])
def test_cached_decode_equals_the_full_forward(window):
    """Prefill 4 tokens, then 10 one at a time (with a window of 5: through the ring caches):
    the logits of the whole sequence's forward."""
    cfg = glm_config(0.5, f"attention.sliding_window={window}", "model.n_layers=2")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    scramble(model)
    toks = jax.random.randint(jax.random.key(0), (2, 14), 0, cfg.model.vocab_size)
    full, _ = forward(model, toks)
    cache = model.init_cache(2, 14)
    pos = jnp.broadcast_to(jnp.arange(14), (2, 14))
    outs = []
    for lo, hi in [(0, 4), *((t, t + 1) for t in range(4, 14))]:
        logits, _, cache = forward_cached(model, toks[:, lo:hi], pos[:, lo:hi], cache)
        outs.append(logits)
    if window:
        assert cache["blocks"][0]["k"].shape[-3] == window  # rings, not the whole context
    assert float(jnp.std(full)) > 0.1
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, **TOL)


def test_splash_path_equals_blocked():
    """The fused kernels take q and k already rotated: the layer through splash (interpreted
    on CPU) equals it through the blocked path."""
    T = 128  # splash tiles the sequence by 128
    x = jax.random.normal(jax.random.key(1), (1, T, D))
    pos = jnp.arange(T)[None]
    outs = {}
    for impl in ("blocked", "splash"):
        layer = Attention(glm_config(0.5, f"attention.impl={impl}"), 0, rngs=nnx.Rngs(0))
        scramble(layer)
        outs[impl] = jax.jit(lambda x, layer=layer: layer(x, pos)[0])(x)
    np.testing.assert_allclose(outs["splash"], outs["blocked"], **TOL)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["attention.partial_rotary_factor=0"],
            "attention.partial_rotary_factor is the fraction of each head's dims RoPE rotates: "
            "it must be in (0, 1] (1 = all), got 0.0",
        ),
        (
            ["attention.partial_rotary_factor=1.5"],
            "it must be in (0, 1] (1 = all), got 1.5",
        ),
        (
            ["attention.head_dim=12", "attention.partial_rotary_factor=0.25"],
            "attention.partial_rotary_factor (0.25) rotates int(head_dim x factor) = 3 of the 12 "
            "dims of a head, which must be even and > 0; change attention.partial_rotary_factor",
        ),
        (
            ["attention.kind=mla", "attention.qk_norm=none", "attention.nope_interval=0",
             "attention.kv_lora_rank=8", "attention.qk_nope_head_dim=8",
             "attention.qk_rope_head_dim=4", "attention.v_head_dim=8",
             "attention.partial_rotary_factor=0.5"],
            "attention.kind=mla does not support attention.partial_rotary_factor=0.5; set "
            "attention.partial_rotary_factor=1 (mla rotates its qk_rope_head_dim dims)",
        ),
    ],
)  # fmt: skip
def test_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match="^[^\n]*$") as err:
        tiny_config(*overrides)
    assert message in str(err.value)
