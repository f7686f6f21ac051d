"""Hybrid stacks (attention.linear=gated_deltanet: Qwen3-Next / Qwen3.5's layout) in the
`Transformer`: linear layers beside gated full attention in the layer scan's blocks, packed
rows, the decode cache (the model's, and the jitted sampler's), and the config's refusals.
Their parity with transformers is tests/test_interop_qwen3_next.py's; the layer's own is
tests/test_gated_deltanet.py's.

One tiny model (4 layers of period 2: linear, full; 2 stacked blocks) compiled once per
program for the module: the training forward, prefill, one decode step and the sampler.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from tests.helpers import forward_cached, tiny_config

HYBRID = (
    "model.n_layers=4",
    "model.vocab_size=64",
    "model.zero_centered_norm=true",
    "attention.nope_interval=0",
    "attention.temperature_tuning=false",
    "attention.head_dim=16",
    "attention.partial_rotary_factor=0.25",
    "attention.output_gate=true",
    "attention.linear=gated_deltanet",
    "attention.full_attention_interval=2",
    "attention.linear_key_heads=2",
    "attention.linear_value_heads=4",
    "attention.linear_key_dim=8",
    "attention.linear_value_dim=6",
    "moe.interleave_step=1",
    "moe.capacity_factor=0",  # dropless: packed and padded rows route alike
    "moe.shared_expert_hidden=24",
    "moe.shared_expert_gate=true",
)
B, T = 2, 75
PROMPT = 67  # prefilled before decoding: more than a chunk (64), not a multiple of it
PAD = 3  # the second row's prompt is right-padded by this many tokens


def _randomized(model: Transformer, seed: int = 0) -> Transformer:
    """Every param N(0, 0.3^2) (norm weights too: zeros would hide a norm applied as w
    rather than 1 + w), with A_log in the reference's range."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        if path[-1] == "A_log":
            value = np.log(rng.uniform(0.01, 16, var.shape))
        else:
            value = 0.3 * rng.standard_normal(var.shape)
        flat.append((path, var.copy(jnp.asarray(value, var[...].dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(*HYBRID)
    return cfg, _randomized(Transformer(cfg, rngs=nnx.Rngs(0)))


@nnx.jit
def _forward(model, tokens_BT, positions_BT, segments_BT):
    return model(tokens_BT, positions=positions_BT, segments=segments_BT)[0]


def test_the_stack_interleaves_linear_and_gated_full_layers(model):
    cfg, m = model
    assert cfg.layer_period == 2 and m.n_blocks == 2 and len(m.tail) == 0
    assert [cfg.is_linear(i) for i in range(4)] == [True, False, True, False]
    linear, full = m.blocks.layers[0], m.blocks.layers[1]
    assert linear.is_linear and hasattr(linear.attn, "A_log")
    assert not full.is_linear and full.attn.wg.shape == full.attn.wq.shape  # [n_blocks, D, H, hd]
    assert m.blocks.layers[1].ffn.shared_gate.shape == (2, cfg.model.d_model, 1)
    # zero-centred norms start at zeros (the identity, as 1 + w), the gated norm at ones
    fresh = Transformer(cfg, rngs=nnx.Rngs(0))
    assert np.all(np.asarray(fresh.final_norm.scale[...]) == 0)
    assert np.all(np.asarray(fresh.blocks.layers[1].attn.q_norm.scale[...]) == 0)
    assert np.all(np.asarray(fresh.blocks.layers[0].attn.norm_scale[...]) == 1)


def test_packed_documents_equal_each_document_alone(model):
    """One row packing a 30-token and a 40-token document (positions restarting) against
    rows holding each alone, right-padded: the linear layers' state and convolution window
    restart at the second document, as attention's mask does. Tolerance 1e-5: the same
    float32 sums, the padded rows' chunks split differently."""
    cfg, m = model
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 64, 30), rng.integers(0, 64, 40)
    tokens = np.zeros((3, 70), np.int32)
    tokens[0] = np.concatenate([a, b])
    tokens[1, :30], tokens[2, :40] = a, b
    segments = np.zeros((3, 70), np.int32)
    segments[0, :30], segments[0, 30:] = 1, 2
    segments[1, :30] = segments[2, :40] = 1
    positions = np.zeros((3, 70), np.int32)
    positions[0] = np.concatenate([np.arange(30), np.arange(40)])
    positions[1:] = np.arange(70)
    logits = np.asarray(_forward(m, *(jnp.asarray(x) for x in (tokens, positions, segments))))
    assert np.std(logits[1, :30]) > 0.1
    np.testing.assert_allclose(logits[0, :30], logits[1, :30], rtol=0, atol=1e-5)
    np.testing.assert_allclose(logits[0, 30:], logits[2, :40], rtol=0, atol=1e-5)


def test_prefill_then_decode_equals_the_full_forward(model):
    """A 67-token prompt batch prefilled into the cache (the second row's 64-token prompt
    right-padded by 3, positions -1 there, as the sampler pads), then 8 tokens decoded one at
    a time: the linear layers' windows and states beside the full layers' keys and values.
    Every real position's logits equal the full forward's within 2e-5 (float32; the chunked
    and the step-by-step rule differ by rounding only)."""
    cfg, m = model
    tokens = np.random.default_rng(2).integers(0, 64, (B, T)).astype(np.int32)
    lengths = [PROMPT, PROMPT - PAD]  # each row's prompt
    segments = np.ones((B, T), np.int32)
    segments[1, T - PAD :] = 0  # row 1's sequence is 3 shorter: padding after it
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    full = np.asarray(_forward(m, *(jnp.asarray(x) for x in (tokens, positions, segments))))
    prompt, prompt_pos = tokens[:, :PROMPT].copy(), positions[:, :PROMPT].copy()
    prompt_pos[1, lengths[1] :] = -1
    cache = m.init_cache(B, T)
    assert cache["blocks"][0]["state"].shape == (2, B, 4, 8, 6)  # [n_blocks, B, H, K, V]
    got, _, cache = forward_cached(m, jnp.asarray(prompt), jnp.asarray(prompt_pos), cache)
    got = np.asarray(got)
    assert np.std(full[0]) > 0.1
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(got[b, :n], full[b, :n], rtol=0, atol=2e-5)
    for step in range(T - PROMPT):
        at_B = np.array(lengths) + step
        tok = jnp.asarray(tokens[np.arange(B), at_B][:, None])
        got, _, cache = forward_cached(m, tok, jnp.asarray(at_B[:, None], jnp.int32), cache)
        want = full[np.arange(B), at_B]
        np.testing.assert_allclose(np.asarray(got)[:, 0], want, rtol=0, atol=2e-5)


def test_sampler_greedy_tokens_equal_a_full_recompute_at_every_step(model):
    """The jitted sampler (prefill of the right-padded prompt bucket in the chunked form,
    then its decode loop through the linear layers' states and the KV caches) against the
    full forward of each prompt and its continuation: every sampled token is the argmax of
    the full forward's logits at its step. Prompts of 67 (over a chunk) and 40 tokens."""
    cfg, m = model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, n).tolist() for n in (PROMPT, 40)]
    n_new = T - PROMPT
    out = Sampler(m).generate(prompts, n_new, temperature=0.0).sequences()
    tokens, segments = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b, (p, new) in enumerate(zip(prompts, out, strict=True)):
        assert len(new) == n_new
        tokens[b, : len(p) + n_new] = p + list(new)
        segments[b, : len(p) + n_new] = 1
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    full = np.asarray(_forward(m, *(jnp.asarray(x) for x in (tokens, positions, segments))))
    for b, p in enumerate(prompts):
        # the token sampled at step i is the argmax after position len(p) - 1 + i
        want = full[b, len(p) - 1 : len(p) - 1 + n_new].argmax(-1)
        np.testing.assert_array_equal(np.array(out[b]), want, err_msg=f"row {b}")


def test_scanned_blocks_equal_unrolled(model):
    """The same params run by `lax.scan` over the two blocks: equal logits."""
    cfg, m = model
    scanned_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
    graphdef, _ = nnx.split(Transformer(scanned_cfg, rngs=nnx.Rngs(0)))
    scanned = nnx.merge(graphdef, nnx.state(m))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (1, 20)), jnp.int32)
    run = jax.jit(lambda g, s, x: nnx.merge(g, s)(x)[0], static_argnums=0)
    want = np.asarray(run(nnx.graphdef(m), nnx.state(m), tokens))
    got = np.asarray(run(graphdef, nnx.state(scanned), tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("attention.linear_key_heads=0",),
            "attention.linear=gated_deltanet needs attention.linear_key_heads > 0",
        ),
        (("attention.linear_value_heads=3",), "must be a multiple of attention.linear_key_heads"),
        (("attention.sliding_window=8",), "set attention.kind=gqa and attention.sliding_window=0"),
        (("attention.linear=mamba",), "attention.linear='mamba' is not supported"),
        (("moe.shared_expert_hidden=0",), "moe.shared_expert_gate gates the shared expert"),
    ],
)
def test_bad_hybrid_configs_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*HYBRID, *overrides)
