"""YaRN RoPE scaling against transformers' own (`ROPE_INIT_FUNCTIONS["yarn"]`, the rotary
embedding and `apply_rotary_pos_emb`), and its config.json mapping both ways."""

import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import AttentionConfig, RopeScalingConfig
from moe_jax.model.rope import apply_rope, rope_attention_factor, rope_inv_freq

torch = pytest.importorskip("torch", reason="YaRN reference tests need torch (the `interop` extra)")
transformers = pytest.importorskip(
    "transformers", reason="YaRN reference tests need transformers (the `interop` extra)"
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# The interop package needs safetensors, also of the `interop` extra
from moe_jax.interop.common import HFConfig, rope_from_hf, rope_to_hf  # noqa: E402
from moe_jax.interop.safetensors_io import InteropError  # noqa: E402

# transformers computes inv_freq in float32 (theta ** (2i/d) with the exponent rounded to
# float32, then the ramp), ours in float64: a few float32 ulps apart, up to ~4e-7 relative
# where 2i/d is not a binary fraction (head_dim 96, 80), the rounding amplified by ln(theta).
# A wrong band or factor moves some frequency by far more (> 1e-3).
INV_FREQ_RTOL = 1e-6

# name -> (head_dim, max_position_embeddings, HF rope_parameters, ours built by hand)
CASES = {
    # gpt-oss (transformers.GptOssConfig's defaults): an unrounded band
    "gpt-oss": (
        64,
        131072,
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        RopeScalingConfig(type="yarn", factor=32.0, original_max_position=4096, truncate=False),
    ),
    # DeepSeek-V3: equal mscale and mscale_all_dim, so an attention factor of exactly 1
    "deepseek-v3": (
        64,
        163840,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        RopeScalingConfig(
            type="yarn", factor=40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0
        ),
    ),
    # Qwen long context: only factor and the original length, everything else defaulted
    "qwen": (
        128,
        131072,
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
        RopeScalingConfig(type="yarn", factor=4.0, original_max_position=32768),
    ),
    # Unequal mscale and mscale_all_dim: their ratio (DeepSeek-V2 style numbers)
    "mscale-ratio": (
        128,
        163840,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        RopeScalingConfig(
            type="yarn", factor=40.0, original_max_position=4096, mscale=0.707, mscale_all_dim=1.0
        ),
    ),
    # An mscale without mscale_all_dim, which transformers ignores (0.1 ln(factor) + 1)
    "mscale-alone": (
        64,
        32768,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "mscale": 0.707,
            "original_max_position_embeddings": 2048,
        },
        RopeScalingConfig(type="yarn", factor=16.0, original_max_position=2048, mscale=0.707),
    ),
    # An explicit attention factor (which wins over an mscale),
    # other betas and a head_dim whose 2i/d are not binary fractions
    "explicit": (
        96,
        65536,
        {
            "rope_type": "yarn",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.25,
            "mscale": 0.707,
            "original_max_position_embeddings": 8192,
        },
        RopeScalingConfig(
            type="yarn",
            factor=8.0,
            original_max_position=8192,
            beta_fast=16.0,
            beta_slow=2.0,
            attention_factor=1.25,
            mscale=0.707,
        ),
    ),
}


def hf_config(head_dim: int, max_pos: int, rope: dict):
    """A transformers config carrying `rope` (a copy: transformers fills it in place)."""
    return transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope),
    )


def reference(config) -> tuple[np.ndarray, float]:
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return inv_freq.double().numpy(), factor


@pytest.mark.parametrize("name", CASES)
def test_inv_freq_and_attention_factor_match_transformers(name):
    head_dim, max_pos, rope, ours = CASES[name]
    inv_freq, factor = reference(hf_config(head_dim, max_pos, rope))
    np.testing.assert_allclose(
        rope_inv_freq(head_dim, rope["rope_theta"], ours), inv_freq, rtol=INV_FREQ_RTOL, atol=0
    )
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12, abs=0)


def test_gpt_oss_config_class_defaults_match():
    """transformers' GptOssConfig itself (not our copy of its numbers above)."""
    config = transformers.GptOssConfig()
    inv_freq, factor = reference(config)
    hf = HFConfig({"rope_parameters": config.rope_parameters}, {}, "GptOssForCausalLM")
    theta, ours = rope_from_hf(hf, 10000.0)
    assert not ours.truncate
    np.testing.assert_allclose(
        rope_inv_freq(config.head_dim, theta, ours), inv_freq, rtol=INV_FREQ_RTOL, atol=0
    )
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12, abs=0)


def test_yarn_changes_what_truncate_and_mscale_change():
    """The cases above would not notice a dropped key if it changed nothing: it does."""
    _, _, rope, gpt_oss = CASES["gpt-oss"]
    rounded = RopeScalingConfig(**{**gpt_oss.__dict__, "truncate": True})
    a, b = (rope_inv_freq(64, rope["rope_theta"], s) for s in (gpt_oss, rounded))
    assert np.max(np.abs(a / b - 1)) > 1e-3
    deepseek = CASES["deepseek-v3"][3]
    assert rope_attention_factor(deepseek) == 1.0
    plain = RopeScalingConfig(type="yarn", factor=40.0, original_max_position=4096)
    assert rope_attention_factor(plain) == pytest.approx(0.1 * np.log(40.0) + 1)
    assert rope_attention_factor(RopeScalingConfig(type="llama3")) == 1.0


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_apply_rope_scale_scales_the_output(style):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 7, 3, 64)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 8192, (2, 7)), jnp.int32)
    scaling = CASES["gpt-oss"][3]
    inv_freq = rope_inv_freq(64, 150000.0, scaling)
    scale = rope_attention_factor(scaling)
    assert scale > 1.3
    scaled = apply_rope(x, positions, inv_freq, style, scale=scale)
    plain = apply_rope(x, positions, inv_freq, style)
    np.testing.assert_allclose(scaled, scale * np.asarray(plain), rtol=1e-6, atol=1e-6)


def test_apply_rope_matches_transformers_rotary_embedding():
    """End to end: transformers' Llama rotary embedding (cos, sin times attention_scaling)
    applied by its `apply_rotary_pos_emb` against ours on the same q and k."""
    from transformers.models.llama import modeling_llama

    head_dim, max_pos, rope, ours = CASES["qwen"]
    config = hf_config(head_dim, max_pos, rope)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 9, 4, head_dim)).astype(np.float32)  # [B, T, H, D]
    k = rng.standard_normal((2, 9, 2, head_dim)).astype(np.float32)
    positions = rng.integers(0, 256, (2, 9))
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions))
    q_ref, k_ref = modeling_llama.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2), cos, sin
    )
    inv_freq = rope_inv_freq(head_dim, rope["rope_theta"], ours)
    scale = rope_attention_factor(ours)
    # Their float32 inv_freq is ~1.3e-7 relative off ours (see INV_FREQ_RTOL): at positions
    # < 256 and inv_freq <= 1 the angles differ by up to ~3.4e-5 rad, times |x| <= ~5. A
    # missing (or squared) attention factor of 1.14 would be off by > 1e-2.
    assert scale > 1.1
    for x, ref in ((q, q_ref), (k, k_ref)):
        out = apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, "half", scale=scale)
        np.testing.assert_allclose(out, ref.transpose(1, 2).numpy(), rtol=0, atol=2e-4)


# ----------------------------------------------------------------------------- config.json


def from_hf(values: dict) -> tuple[float, RopeScalingConfig]:
    return rope_from_hf(HFConfig(values, {}, "LlamaForCausalLM"), 10000.0)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_from_hf_reads_yarn(name, key):
    head_dim, max_pos, rope, ours = CASES[name]
    if key == "rope_scaling":  # the legacy spelling: `type`, not `rope_type`
        rope = {"type": "yarn", **{k: v for k, v in rope.items() if k != "rope_type"}}
    theta, scaling = from_hf({key: rope, "max_position_embeddings": max_pos})
    assert (theta, scaling) == (rope["rope_theta"], ours)


@pytest.mark.parametrize("name", CASES)
def test_yarn_round_trip_through_config_json(name):
    head_dim, max_pos, rope, _ = CASES[name]
    theta, scaling = from_hf({"rope_parameters": rope, "max_position_embeddings": max_pos})
    back = rope_to_hf(AttentionConfig(rope_theta=theta, rope_scaling=scaling))
    assert back["rope_type"] == "yarn"
    for k, v in rope.items():  # every key given comes back, with its value
        assert back[k] == v, k
    assert from_hf({"rope_parameters": back, "max_position_embeddings": max_pos}) == (
        theta,
        scaling,
    )
    # and transformers reads the written dict as it read the original
    inv_a, factor_a = reference(hf_config(head_dim, max_pos, rope))
    inv_b, factor_b = reference(hf_config(head_dim, max_pos, back))
    np.testing.assert_array_equal(inv_a, inv_b)
    assert factor_a == factor_b


def test_null_factor_is_the_context_ratio():
    """DeepSeek-V3's convention: factor null -> max_position_embeddings / original."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": None,
        "original_max_position_embeddings": 4096,
    }
    theta, scaling = from_hf({"rope_parameters": rope, "max_position_embeddings": 131072})
    assert scaling.factor == 32.0
    inv_freq, factor = reference(hf_config(64, 131072, rope))
    np.testing.assert_allclose(
        rope_inv_freq(64, theta, scaling), inv_freq, rtol=INV_FREQ_RTOL, atol=0
    )
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12, abs=0)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "lack 'factor'"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, "attention_factor=0.0"),
    ],
)
def test_rope_from_hf_refuses_bad_yarn(rope, message):
    with pytest.raises(InteropError, match=message):
        from_hf({"rope_parameters": rope, "max_position_embeddings": 8192})
