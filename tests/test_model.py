"""Decoder-level reference tests: attention against a naive loop, KV cache against the full
forward, causality, chunk/window masks, GQA vs MHA, RoPE, scan vs unrolled.

Tolerances: float32 throughout. Paths that compute the same sums in a different order (cache
vs full forward, scan vs unrolled, einsum vs naive loop) agree to ~1e-6 on O(1) logits; 1e-5
absolute leaves margin while any masking or position error moves logits by >1e-2.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model import Transformer
from moe_jax.model.attention import (
    Attention,
    attend,
    attention_mask,
    block_attention,
    query_blocks,
)
from moe_jax.model.remat import remat
from moe_jax.model.rope import apply_rope, rope_inv_freq
from tests.helpers import forward, forward_cached, randomize_biases, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)

# Every attention flavour in one 4-layer stack: layer 4 is NoPE with temperature tuning,
# RoPE layers are chunked (chunk 5) and all layers have a sliding window of 7; MoE layers
# interleave with dense ones. No capacity drops, so positions can be computed one at a time.
ALL_FLAVOURS = [
    "attention.nope_interval=4",
    "attention.temperature_tuning=true",
    "attention.floor_scale=4",  # small, so the temperature actually varies over 16 positions
    "attention.chunk_size=5",
    "attention.sliding_window=7",
    "attention.qk_norm=rms",
    "attention.qkv_bias=true",
    "attention.o_bias=true",
    "moe.capacity_factor=0",
    "moe.shared_expert_hidden=16",
]


def make(*overrides, seed=0):
    """A tiny model with non-zero biases (where it has any)."""
    cfg = tiny_config(*overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    randomize_biases(model, seed)
    return cfg, model


def tokens(B, T, seed=0, V=256):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


def naive_attention(attn: Attention, x, positions):
    """Per-head loop with an explicit softmax: the definition, no shared helpers but RoPE."""
    H, K, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    bias = lambda name: getattr(attn, f"{name}_bias")[...] if hasattr(attn, f"{name}_bias") else 0
    q = jnp.einsum("btd,dhk->bthk", x, attn.wq[...]) + bias("q")
    k = jnp.einsum("btd,dhk->bthk", x, attn.wk[...]) + bias("k")
    v = jnp.einsum("btd,dhk->bthk", x, attn.wv[...]) + bias("v")
    rms = lambda a: a / jnp.sqrt(jnp.mean(a * a, -1, keepdims=True) + attn.norm_eps)
    if attn.qk_norm == "rms":
        q, k = rms(q) * attn.q_norm.scale[...], rms(k) * attn.k_norm.scale[...]
    if attn.use_rope:
        q = apply_rope(q, positions, attn.inv_freq, attn.rope_style)
        k = apply_rope(k, positions, attn.inv_freq, attn.rope_style)
        if attn.qk_norm == "l2":
            q, k = rms(q), rms(k)
    if attn.temperature_tuning:
        s = jnp.log1p(jnp.floor((positions + 1.0) / attn.floor_scale)) * attn.attn_scale + 1
        q = q * s[:, :, None, None]
    B, T = positions.shape
    out = jnp.zeros((B, T, H, hd))
    for h in range(H):
        g = h // (H // K)  # query head h reads kv head g
        logits = jnp.einsum("btk,bsk->bts", q[:, :, h], k[:, :, g]) / math.sqrt(hd)
        for t in range(T):
            for s_ in range(T):
                ok = s_ <= t
                if attn.window:
                    ok = ok and t - s_ < attn.window
                if attn.chunk_size:
                    ok = ok and t // attn.chunk_size == s_ // attn.chunk_size
                if not ok:
                    logits = logits.at[:, t, s_].set(-jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        out = out.at[:, :, h].set(jnp.einsum("bts,bsk->btk", p, v[:, :, g]))
    return jnp.einsum("bthk,hkd->btd", out, attn.wo[...]) + bias("o")


@pytest.mark.parametrize(
    "overrides,layer",
    [
        (["attention.chunk_size=4", "attention.sliding_window=6"], 0),  # RoPE, chunk, window
        (
            [
                "attention.nope_interval=1",
                "attention.temperature_tuning=true",
                "attention.floor_scale=3",
            ],
            0,
        ),  # NoPE + temperature
        (["attention.qk_norm=l2", "attention.rope_style=interleaved"], 0),  # Llama 4 style
        (["attention.n_kv_heads=1"], 0),  # MQA
        (["attention.qkv_bias=true", "attention.o_bias=true"], 0),  # Qwen2-style biases
    ],
)
def test_attention_matches_naive_reference(overrides, layer):
    cfg = tiny_config(*overrides)
    attn = Attention(cfg, layer, rngs=nnx.Rngs(0))
    randomize_biases(attn)
    if attn.qk_norm == "rms":  # non-trivial learned norm scales
        attn.q_norm.scale[...] = 1 + jax.random.normal(jax.random.key(7), (cfg.head_dim,)) * 0.3
    x = jax.random.normal(jax.random.key(1), (2, 11, cfg.model.d_model))
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    y, _ = attn(x, pos)
    np.testing.assert_allclose(y, naive_attention(attn, x, pos), **TOL)


def test_query_blocks_cover_every_visible_key():
    assert query_blocks(512) == [(i * 64, i * 64 + 64, 0, i * 64 + 64) for i in range(8)]
    assert query_blocks(11) == [(0, 11, 0, 11)]  # short: one block
    assert len(query_blocks(4096)) == 8  # bounded unrolling
    # With a window of 70, block [75, 150) sees keys from 75 - 69 = 6 on.
    assert query_blocks(150, window=70) == [(0, 75, 0, 75), (75, 150, 6, 150)]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["attention.sliding_window=70"],  # windows reach back across a block boundary
        ["attention.chunk_size=40", "attention.n_kv_heads=1"],  # chunks straddle blocks; MQA
    ],
)
def test_blocked_self_attention_equals_one_full_mask(overrides):
    """Output and gradients of the query-blocked path (T=150: 2 blocks) equal one softmax over
    the whole [T, T] mask, and jax.nn.dot_product_attention agrees on the forward."""
    cfg = tiny_config(*overrides)
    attn = Attention(cfg, 0, rngs=nnx.Rngs(0))
    B, T, H, hd = 2, 150, cfg.attention.n_heads, cfg.head_dim
    K = cfg.attention.n_kv_heads
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (B, T, H, hd))
    k = jax.random.normal(keys[1], (B, T, K, hd))
    v = jax.random.normal(keys[2], (B, T, K, hd))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    assert len(query_blocks(T, attn.window)) == 2
    mask = attn._mask(pos, pos)
    full = lambda q, k, v: attend(q, k, v, mask, hd**-0.5)
    blocked = lambda q, k, v: attn._blocked(q, k, v, pos)
    np.testing.assert_allclose(blocked(q, k, v), full(q, k, v), **TOL)
    reference = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=hd**-0.5)
    np.testing.assert_allclose(full(q, k, v), reference, **TOL)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    g_blocked = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
    g_full = jax.grad(loss(full), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_blocked, g_full, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_block_attention_in_bfloat16_keeps_dtypes_and_tracks_float32():
    """The hand-written backward casts back to each input's dtype; bf16 inputs give outputs
    and gradients within bf16 rounding of the float32 ones (8 mantissa bits: a few 1e-2 on
    values of magnitude ~1; the softmax itself runs in float32 either way)."""
    B, K, G, T, hd = 2, 2, 3, 16, 8
    keys = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(keys[0], (B, K, G * T, hd)) * hd**-0.5
    k = jax.random.normal(keys[1], (B, K, T, hd))
    v = jax.random.normal(keys[2], (B, K, T, hd))
    cot = jax.random.normal(keys[3], (B, K, G * T, hd))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = attention_mask(pos, pos)

    def value_and_grads(dtype):
        f = lambda q, k, v: jnp.sum(block_attention(q, k, v, mask).astype(jnp.float32) * cot)
        args = [a.astype(dtype) for a in (q, k, v)]
        return block_attention(*args, mask), jax.grad(f, argnums=(0, 1, 2))(*args)

    out32, grads32 = value_and_grads(jnp.float32)
    out16, grads16 = value_and_grads(jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, atol=3e-2)
    for g16, g32 in zip(grads16, grads32, strict=True):
        assert g16.dtype == jnp.bfloat16
        np.testing.assert_allclose(g16.astype(jnp.float32), g32, atol=6e-2, rtol=3e-2)


def _count_dots(jaxpr) -> int:
    """dot_general equations in a jaxpr and every jaxpr nested in its equations' params."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for p in jax.tree.leaves(list(eqn.params.values()), is_leaf=lambda x: hasattr(x, "eqns")):
            inner = getattr(p, "jaxpr", p)
            n += _count_dots(inner) if hasattr(inner, "eqns") else 0
    return n


def test_remat_dots_keeps_the_attention_output_instead_of_rerunning_the_forward():
    """Under `model.remat=dots` a query block's output and log-sum-exp are kept by name, so
    the backward runs the 5 matmuls of its own (logits, dP, dQ, dK, dV) and not the forward's
    2 again: 7 in all, against 9 when the block's forward is recomputed (as with `full`)."""
    B, K, G, T, hd = 1, 2, 2, 8, 4
    q, k, v = (
        jax.random.normal(jax.random.key(i), (B, K, n, hd)) for i, n in enumerate((G * T, T, T))
    )
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = attention_mask(pos, pos)
    f = lambda q, k, v: jnp.sum(jnp.sin(block_attention(q, k, v, mask)))
    dots = {
        p: _count_dots(jax.make_jaxpr(jax.grad(remat(f, p)))(q, k, v).jaxpr)
        for p in ("dots", "full")
    }
    assert dots == {"dots": 7, "full": 9}, dots
    # and the gradients are the ones without remat
    for p in ("dots", "full"):
        np.testing.assert_allclose(jax.grad(remat(f, p))(q, k, v), jax.grad(f)(q, k, v), rtol=1e-6)


def test_kv_cache_decode_equals_full_forward():
    cfg, model = make(*ALL_FLAVOURS)
    B, T, P = 2, 16, 6  # prefill 6 positions, then decode 10 one at a time
    toks = tokens(B, T)
    full, _ = forward(model, toks)
    cache = model.init_cache(B, T)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    out, _, cache = forward_cached(model, toks[:, :P], pos[:, :P], cache)
    step_logits = [out]
    for t in range(P, T):
        out, _, cache = forward_cached(model, toks[:, t : t + 1], pos[:, t : t + 1], cache)
        step_logits.append(out)
    np.testing.assert_allclose(jnp.concatenate(step_logits, axis=1), full, **TOL)


def test_kv_cache_with_scan_layers():
    cfg, model = make(*ALL_FLAVOURS, "model.scan_layers=true", "model.n_layers=8")
    toks = tokens(1, 9, seed=3)
    full, _ = forward(model, toks)
    cache = model.init_cache(1, 12)
    pos = jnp.arange(9)[None]
    out, _, cache = forward_cached(model, toks[:, :8], pos[:, :8], cache)
    out2, _, _ = forward_cached(model, toks[:, 8:], pos[:, 8:], cache)
    np.testing.assert_allclose(jnp.concatenate([out, out2], 1), full, **TOL)


def test_changing_a_future_token_never_changes_earlier_logits():
    cfg, model = make(*ALL_FLAVOURS)
    toks = tokens(2, 12)
    base, _ = forward(model, toks)
    for t in (3, 7, 11):
        changed = toks.at[:, t].set((toks[:, t] + 1) % 256)
        out, _ = forward(model, changed)
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert not np.allclose(out[:, t], base[:, t])


def test_chunked_attention_never_crosses_a_chunk_boundary():
    # One RoPE layer with chunk 4: a token's output depends only on tokens of its own chunk.
    cfg = tiny_config(
        "attention.chunk_size=4",
        "model.n_layers=1",
        "moe.interleave_step=1",
        "attention.nope_interval=0",
        "moe.capacity_factor=0",
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    toks = tokens(1, 12)
    base, _ = forward(model, toks)
    changed, _ = forward(model, toks.at[:, 3].set((toks[:, 3] + 5) % 256))  # last token of chunk 0
    np.testing.assert_array_equal(changed[:, 4:], base[:, 4:])  # chunks 1, 2 untouched
    mask = attention_mask(jnp.arange(12)[None], jnp.arange(12)[None], chunk_size=4)[0]
    assert not mask[4, 3] and mask[5, 4] and mask[7, 4] and not mask[8, 7]


def test_gqa_with_all_kv_heads_equals_mha_with_repeated_kv():
    # GQA with K kv heads == MHA whose k/v weights repeat each kv head H/K times.
    gqa_cfg = tiny_config("attention.n_heads=4", "attention.n_kv_heads=2")
    mha_cfg = tiny_config("attention.n_heads=4", "attention.n_kv_heads=4")
    gqa = Attention(gqa_cfg, 0, rngs=nnx.Rngs(0))
    mha = Attention(mha_cfg, 0, rngs=nnx.Rngs(1))
    mha.wq[...] = gqa.wq[...]
    mha.wo[...] = gqa.wo[...]
    mha.wk[...] = jnp.repeat(gqa.wk[...], 2, axis=1)
    mha.wv[...] = jnp.repeat(gqa.wv[...], 2, axis=1)
    x = jax.random.normal(jax.random.key(2), (2, 9, gqa_cfg.model.d_model))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    np.testing.assert_allclose(gqa(x, pos)[0], mha(x, pos)[0], **TOL)
    np.testing.assert_allclose(mha(x, pos)[0], naive_attention(mha, x, pos), **TOL)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_depends_only_on_relative_position(style):
    inv = rope_inv_freq(16, 10000.0, tiny_config().attention.rope_scaling)
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
    dot = lambda m, n: float(
        jnp.sum(
            apply_rope(q, jnp.array([[m]]), inv, style)
            * apply_rope(k, jnp.array([[n]]), inv, style)
        )
    )
    assert dot(5, 2) == pytest.approx(dot(103, 100), rel=1e-4, abs=1e-5)
    assert dot(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-5)
    assert dot(5, 2) != pytest.approx(dot(5, 4), rel=1e-3)
    # Rotation preserves norms.
    r = apply_rope(q, jnp.array([[77]]), inv, style)
    np.testing.assert_allclose(jnp.linalg.norm(r), jnp.linalg.norm(q), rtol=1e-6)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_rotates_each_pair_by_position_times_theta_power(theta):
    """The definition in float64 complex numbers: pair i of the interleaved layout, x[2i] +
    j x[2i+1], is multiplied by exp(j * pos * theta^(-2i/d)). apply_rope computes the angles
    in float32: at positions up to 40 (angles up to 40 rad) that is ~3e-6 of error."""
    d = 16
    inv = rope_inv_freq(d, theta, tiny_config().attention.rope_scaling)
    np.testing.assert_allclose(inv, theta ** (-np.arange(0, d, 2) / d), rtol=1e-12)
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, 4, 2, d)), np.float64)
    pos = np.array([[0, 1, 17, 40]])
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[..., None, None] * inv)
    expected = np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    got = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), inv, "interleaved")
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


def test_llama3_rope_scaling_values_by_hand():
    """Llama 3.1's rule for one frequency of each band, worked out by hand: old context 64,
    factor 8, low/high frequency factors 1/4 (wavelengths above 64 slowed 8x, below 16 kept,
    between smoothly mixed by s = (64 / wavelength - 1) / 3)."""
    sc = tiny_config(
        "attention.rope_scaling.type=llama3",
        "attention.rope_scaling.factor=8",
        "attention.rope_scaling.low_freq_factor=1",
        "attention.rope_scaling.high_freq_factor=4",
        "attention.rope_scaling.original_max_position=64",
    ).attention.rope_scaling
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    scaled = rope_inv_freq(64, 10000.0, sc)
    wavelength = 2 * np.pi / base
    short, mid, long = 3, 8, 12  # indices with wavelengths ~14, ~63 and ~282
    assert wavelength[short] < 16 and 16 <= wavelength[mid] <= 64 and wavelength[long] > 64
    assert scaled[short] == pytest.approx(base[short], rel=1e-12)
    assert scaled[long] == pytest.approx(base[long] / 8, rel=1e-12)
    s_ = (64 / wavelength[mid] - 1) / 3
    assert scaled[mid] == pytest.approx((1 - s_) * base[mid] / 8 + s_ * base[mid], rel=1e-12)


def test_rope_styles_are_permutations_of_each_other():
    # interleaved on x == half on x with pairs (2i, 2i+1) moved to (i, i + d/2).
    inv = rope_inv_freq(8, 500.0, tiny_config().attention.rope_scaling)
    x = jax.random.normal(jax.random.key(0), (1, 3, 2, 8))
    pos = jnp.array([[0, 4, 9]])
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    a = apply_rope(x, pos, inv, "interleaved")[..., perm]
    b = apply_rope(x[..., perm], pos, inv, "half")
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_llama3_rope_scaling_bands():
    cfg = tiny_config(
        "attention.rope_scaling.type=llama3",
        "attention.rope_scaling.factor=8",
        "attention.rope_scaling.low_freq_factor=1",
        "attention.rope_scaling.high_freq_factor=4",
        "attention.rope_scaling.original_max_position=64",
    )
    sc = cfg.attention.rope_scaling
    base = rope_inv_freq(64, 10000.0, tiny_config().attention.rope_scaling)
    scaled = rope_inv_freq(64, 10000.0, sc)
    wavelen = 2 * np.pi / base
    high = wavelen < 64 / 4  # short wavelengths: unchanged
    low = wavelen > 64 / 1  # long wavelengths: slowed by the factor
    np.testing.assert_allclose(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8)
    mid = ~high & ~low
    assert mid.any()
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)
    lin = rope_inv_freq(
        64,
        10000.0,
        tiny_config(
            "attention.rope_scaling.type=linear", "attention.rope_scaling.factor=2"
        ).attention.rope_scaling,
    )
    np.testing.assert_allclose(lin, base / 2)


@pytest.mark.parametrize("n_layers", [8, 6])  # 6: two full blocks of 4 + a 2-layer tail
def test_scan_equals_unrolled(n_layers):
    over = [*ALL_FLAVOURS, f"model.n_layers={n_layers}", "moe.capacity_factor=1.0"]
    cfg_u, unrolled = make(*over, "model.scan_layers=false")
    cfg_s, scanned = make(*over, "model.scan_layers=true")
    # Same seed, same layout: identical params.
    pu, ps = nnx.state(unrolled, nnx.Param), nnx.state(scanned, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, pu, ps)
    toks = tokens(2, 10)
    (lu, au), (ls, as_) = forward(unrolled, toks), forward(scanned, toks)
    np.testing.assert_allclose(ls, lu, **TOL)
    np.testing.assert_allclose(as_["expert_load"], au["expert_load"], **TOL)
    np.testing.assert_allclose(as_["aux_loss"], au["aux_loss"], **TOL)
    assert au["expert_load"].shape == (n_layers // 2, cfg_u.moe.n_experts)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_aux_stats_per_moe_layer_in_layer_order(scan):
    """Each MoE layer's router is zeroed and given its own bias, so every token's logits are
    that bias and the layer's load, lb and z losses follow in NumPy. Layers 1 and 3 (0-based)
    sit in the block of 4, layer 5 in the 2-layer tail: the stats must come back in layer
    order, the losses as their mean, and aux_loss weighted by the config."""
    cfg, model = make(
        "model.n_layers=6",
        "moe.interleave_step=2",
        "attention.nope_interval=4",
        "moe.router_bias=true",
        f"model.scan_layers={scan}",
    )
    E, K = cfg.moe.n_experts, cfg.moe.top_k
    biases = np.array([[3.0, 0.0, 1.0, 2.0], [0.0, 1.0, 2.5, 3.5], [1.0, 4.0, 0.5, 0.0]])
    ffns = [model.blocks.layers[1].ffn, model.blocks.layers[3].ffn, model.tail[1].ffn]
    for ffn, bias in zip(ffns, biases, strict=True):
        ffn.router[...] = jnp.zeros_like(ffn.router[...])
        ffn.router_bias[...] = jnp.broadcast_to(jnp.asarray(bias), ffn.router_bias[...].shape)
    _, aux = forward(model, tokens(2, 8))
    load = np.zeros((3, E))
    for i, bias in enumerate(biases):
        load[i, np.argsort(-bias)[:K]] = 1 / K  # every token picks the same top-k
    probs = np.exp(biases) / np.exp(biases).sum(-1, keepdims=True)
    lb = E * (load * probs).sum(-1)
    z = np.log(np.exp(biases).sum(-1)) ** 2
    np.testing.assert_allclose(aux["expert_load"], load, rtol=1e-6)
    np.testing.assert_allclose(aux["lb_loss"], lb.mean(), rtol=1e-6)
    np.testing.assert_allclose(aux["z_loss"], z.mean(), rtol=1e-6)
    assert (cfg.moe.lb_loss_weight, cfg.moe.z_loss_weight) == (0.01, 1e-3)  # DESIGN.md defaults
    np.testing.assert_allclose(aux["aux_loss"], 0.01 * lb.mean() + 1e-3 * z.mean(), rtol=1e-6)


def test_dense_model_has_empty_moe_stats():
    cfg, model = make("moe.n_experts=0", "model.n_layers=2", "attention.nope_interval=0")
    logits, aux = forward(model, tokens(1, 5))
    assert aux["expert_load"].shape == (0, 0) and float(aux["aux_loss"]) == 0.0


def test_tied_embeddings_share_the_table():
    """The output head is the embedding table: doubling the rows of tokens absent from the
    input doubles exactly those logit columns (a power of 2 scales float sums exactly) and
    leaves every other column bit-identical."""
    cfg, model = make("model.tie_embeddings=true")
    assert not hasattr(model, "head")
    x = tokens(1, 4, V=128)
    logits, _ = forward(model, x)
    model.embed.embedding[...] = model.embed.embedding[...].at[128:].multiply(2.0)
    logits2, _ = forward(model, x)
    np.testing.assert_array_equal(logits2[..., :128], logits[..., :128])
    np.testing.assert_allclose(logits2[..., 128:], 2 * logits[..., 128:], rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(logits[..., 128:]).max()) > 1e-2


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32():
    over = ["moe.capacity_factor=0", "attention.nope_interval=0"]
    _, m32 = make(*over)
    _, m16 = make(*over, "model.dtype=bfloat16")
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(m16, nnx.Param)))
    toks = tokens(2, 8)
    l32, _ = forward(m32, toks)
    l16, _ = forward(m16, toks)
    assert l16.dtype == jnp.float32
    # bf16 has 8 mantissa bits: logits of magnitude ~1 agree to a few 1e-2.
    np.testing.assert_allclose(l16, l32, atol=5e-2)


def test_remat_keeps_loss_and_gradients_and_cuts_the_backwards_memory():
    """model.remat recomputes each scanned block in the backward: the same loss and gradients
    as keeping the activations (the same float ops run again, so 1e-6 is only reassociation
    slack), and less XLA temporary memory for the train gradient. Eight one-layer blocks, whose
    activations dominate the temporaries: full remat keeps one block's and the eight inputs,
    so it must cut them well below none (measured 0.26x), and dots must sit in between (0.62x)."""
    from moe_jax.train.step import loss_fn

    period1 = ["attention.nope_interval=0", "moe.interleave_step=1", "model.n_layers=8"]
    over = [*ALL_FLAVOURS, *period1, "model.scan_layers=true", "moe.capacity_factor=1.0"]
    toks = tokens(4, 129)
    grads, temps = {}, {}
    for policy in ("none", "dots", "full"):
        cfg, model = make(*over, f"model.remat={policy}")
        graphdef, params = nnx.split(model)
        grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 3))
        compiled = grad_fn.lower(params, graphdef, toks, 1e-4).compile()  # one compile each
        (loss, _), g = compiled(params, toks)  # a Compiled takes the non-static arguments
        grads[policy] = (loss, g)
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
    for policy in ("dots", "full"):
        np.testing.assert_allclose(grads[policy][0], grads["none"][0], rtol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            grads[policy][1],
            grads["none"][1],
        )
    assert temps["full"] < 0.6 * temps["none"], temps
    assert temps["full"] <= temps["dots"] <= temps["none"], temps


def test_remat_needs_the_layer_scan():
    from moe_jax.config import ConfigError

    with pytest.raises(ConfigError, match="model.remat=full needs model.scan_layers=true"):
        tiny_config("model.remat=full", "model.scan_layers=false")
    with pytest.raises(ConfigError, match="model.remat='some' is not supported"):
        tiny_config("model.remat=some", "model.scan_layers=true")
