"""DeepSeek Sparse Attention (attention.index_topk: DeepSeek-V3.2 / GLM-5) in the
`Transformer`: the selection over packed rows, the decode cache (the model's and the jitted
sampler's), GLM's shared selections through the layer scan, the config's refusals and the
engine's. Parity with transformers is tests/test_interop_dsa.py's.

One tiny model compiled once per program for the module: 3 MLA layers, the first dense,
then a block of (own indexer, shared selection) (index_topk_freq 2, offset 2), so a
selection passes from layer to layer, from the dense prefix into the layer scan's carry and
inside the block; index_topk 4 under sequences of 24: most queries attend to 4 of their
keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.inference.engine import Engine, EngineError
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from tests.helpers import forward_cached, tiny_config

DSA = (
    "model.n_layers=3",
    "model.vocab_size=64",
    "attention.kind=mla",
    "attention.qk_norm=none",
    "attention.nope_interval=0",
    "attention.temperature_tuning=false",
    "attention.rope_style=interleaved",
    "attention.q_lora_rank=16",
    "attention.kv_lora_rank=12",
    "attention.qk_nope_head_dim=8",
    "attention.qk_rope_head_dim=4",
    "attention.v_head_dim=6",
    "attention.index_topk=4",
    "attention.index_n_heads=4",
    "attention.index_head_dim=8",
    "attention.index_topk_freq=2",
    "attention.index_skip_topk_offset=2",
    "moe.interleave_step=1",
    "moe.first_dense_layers=1",
    "moe.capacity_factor=0",  # dropless: packed and padded rows route alike
)
B, T = 2, 24
PROMPT, PAD = 16, 3  # prefilled, then decoded; the second row's prompt 3 shorter


def _randomized(model: Transformer, seed: int = 0) -> Transformer:
    """Every param N(0, 0.3^2) but norm scales 1 + that: the indexer's LayerNorm bias too."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = 0.3 * rng.standard_normal(var.shape)
        value = value + 1.0 if str(path[-1]).endswith("scale") else value
        flat.append((path, var.copy(jnp.asarray(value, var[...].dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(*DSA)
    return cfg, _randomized(Transformer(cfg, rngs=nnx.Rngs(0)))


@nnx.jit
def _forward(model, tokens_BT, positions_BT, segments_BT):
    return model(tokens_BT, positions=positions_BT, segments=segments_BT)[0]


def _full(m, tokens, positions, segments) -> np.ndarray:
    return np.asarray(_forward(m, *(jnp.asarray(x) for x in (tokens, positions, segments))))


def test_the_stack_alternates_indexer_and_shared_layers(model):
    cfg, m = model
    assert cfg.layer_period == 2 and m.n_blocks == 1 and len(m.tail) == 0
    assert [cfg.runs_indexer(i) for i in range(3)] == [True, True, False]
    own, shared = m.blocks.layers[0].attn, m.blocks.layers[1].attn
    assert own.indexer.wq_b.shape == (1, 16, 4, 8) and not hasattr(shared, "indexer")
    cache = m.init_cache(B, T)
    assert cache["blocks"][0]["index_k"].shape == (1, B, T, 1, 8)
    assert "index_k" not in cache["blocks"][1] and "index_k" in cache["prefix"][0]


def test_packed_documents_equal_each_document_alone(model):
    """A row packing a 10- and a 14-token document (positions restarting) against rows
    holding each alone, right-padded: the indexer picks within each document only."""
    cfg, m = model
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 64, 10), rng.integers(0, 64, 14)
    tokens, segments = np.zeros((3, T), np.int32), np.zeros((3, T), np.int32)
    tokens[0] = np.concatenate([a, b])
    tokens[1, :10], tokens[2, :14] = a, b
    segments[0, :10], segments[0, 10:] = 1, 2
    segments[1, :10] = segments[2, :14] = 1
    positions = np.tile(np.arange(T, dtype=np.int32), (3, 1))
    positions[0, 10:] = np.arange(14)
    logits = _full(m, tokens, positions, segments)
    assert np.std(logits[1, :10]) > 0.1
    np.testing.assert_allclose(logits[0, :10], logits[1, :10], rtol=0, atol=1e-5)
    np.testing.assert_allclose(logits[0, 10:], logits[2, :14], rtol=0, atol=1e-5)


def test_the_selection_is_sparse_and_matters(model):
    """The same params with index_topk at the sequence length (every key kept) give other
    logits: the selection of 4 masks keys (the decode tests below run it)."""
    cfg, m = model
    dense_cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, index_topk=T))
    dense = nnx.merge(nnx.graphdef(Transformer(dense_cfg, rngs=nnx.Rngs(0))), nnx.state(m))
    tokens = np.random.default_rng(2).integers(0, 64, (1, T)).astype(np.int32)
    positions, segments = np.arange(T, dtype=np.int32)[None], np.ones((1, T), np.int32)
    sparse = _full(m, tokens, positions, segments)
    run = jax.jit(lambda s, x: nnx.merge(nnx.graphdef(dense), s)(x)[0])
    full = np.asarray(run(nnx.state(dense), jnp.asarray(tokens)))
    assert np.abs(sparse[0, :4] - full[0, :4]).max() < 1e-5  # <= 4 keys: all kept anyway
    assert np.abs(sparse[0, 8:] - full[0, 8:]).max() > 1e-2


def test_prefill_then_decode_equals_the_full_forward(model):
    """A 16-token prompt batch prefilled into the cache (the second row's 13-token prompt
    right-padded, positions -1 there, as the sampler pads), then 8 tokens decoded one at a
    time: the indexer's cached keys, the selection passed to the shared layers. Every real
    position's logits equal the full forward's within 2e-5 (float32)."""
    cfg, m = model
    tokens = np.random.default_rng(3).integers(0, 64, (B, T)).astype(np.int32)
    lengths = [PROMPT, PROMPT - PAD]
    segments = np.ones((B, T), np.int32)
    segments[1, T - PAD :] = 0
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    full = _full(m, tokens, positions, segments)
    prompt, prompt_pos = tokens[:, :PROMPT].copy(), positions[:, :PROMPT].copy()
    prompt_pos[1, lengths[1] :] = -1
    cache = m.init_cache(B, T)
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
    """The jitted sampler (prefill of the padded prompt bucket, then its decode loop
    through the latent and indexer caches) against the full forward of each prompt and
    its continuation: every sampled token is the argmax of the full forward's logits."""
    cfg, m = model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, n).tolist() for n in (PROMPT, 11)]
    n_new = T - PROMPT
    out = Sampler(m).generate(prompts, n_new, temperature=0.0).sequences()
    tokens, segments = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b, (p, new) in enumerate(zip(prompts, out, strict=True)):
        assert len(new) == n_new
        tokens[b, : len(p) + n_new] = p + list(new)
        segments[b, : len(p) + n_new] = 1
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    full = _full(m, tokens, positions, segments)
    for b, p in enumerate(prompts):
        want = full[b, len(p) - 1 : len(p) - 1 + n_new].argmax(-1)
        np.testing.assert_array_equal(np.array(out[b]), want, err_msg=f"row {b}")


def test_the_engine_refuses_dsa_models_by_name(model):
    cfg, m = model
    with pytest.raises(EngineError, match="not DeepSeek sparse attention's indexer keys"):
        Engine(Sampler(m))


def test_scanned_blocks_equal_unrolled(model):
    """The same params run by `lax.scan` over the block (the selection in its carry)."""
    cfg, m = model
    scanned_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
    graphdef, _ = nnx.split(Transformer(scanned_cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (1, 20)), jnp.int32)
    run = jax.jit(lambda g, s, x: nnx.merge(g, s)(x)[0], static_argnums=0)
    want = np.asarray(run(nnx.graphdef(m), nnx.state(m), tokens))
    got = np.asarray(run(graphdef, nnx.state(m), tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("attention.index_n_heads=0",),
         "attention.index_topk needs attention.index_n_heads > 0 (DeepSeek-V3.2: 64), got 0"),
        (("attention.index_head_dim=2",),
         "attention.index_head_dim (2) must be at least attention.qk_rope_head_dim (4)"),
        (("attention.q_lora_rank=0",), "set attention.kind=mla and attention.q_lora_rank > 0"),
        (("attention.index_topk=-1",), "attention.index_topk must be >= 0 (0 = dense"),
        (("attention.index_topk=0",), "set attention.index_topk > 0 too, or index_n_heads=0"),
        (("attention.index_rope_style=yarn",), "attention.index_rope_style='yarn' is not"),
        (("attention.index_topk_freq=0",), "attention.index_topk_freq must be >= 1"),
        (("attention.index_skip_topk_offset=3",),
         "attention.index_skip_topk_offset (3) must be at most moe.first_dense_layers + 1 (2)"),
        (("model.mtp_depth=1",), "model.mtp_depth > 0 builds MTP layers of the last layer's"),
        (("mesh.context=2",), "mesh.context=2 does not support attention.index_topk > 0"),
    ],
)  # fmt: skip
def test_bad_dsa_configs_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match="^[^\n]*$") as err:
        tiny_config(*DSA, *overrides)
    assert message in str(err.value)


def test_sharded_equals_unsharded(model):
    """The same params laid out over fsdp 2 x expert 2 x tensor 2 (the indexer's weights by
    their logical axes: the query latent over fsdp, the model dim over fsdp x expert): the
    training forward's logits within 1e-5 of one device's."""
    from moe_jax.sharding import make_mesh, state_shardings

    cfg, m = model
    mesh_cfg = tiny_config(*DSA, "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    mesh = make_mesh(mesh_cfg)
    graphdef, state = nnx.split(m)
    sharded = jax.device_put(state, state_shardings(state, mesh))
    assert sharded["blocks"]["layers"][0]["attn"]["indexer"]["wq_b"][...].sharding.spec[1] == "fsdp"
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 64, (4, T)), jnp.int32)
    run = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
    want = np.asarray(run(state, tokens))
    with jax.set_mesh(mesh):
        got = np.asarray(run(sharded, tokens))
    # float32 sums split over shards: 1.3e-5 measured on logits of O(1)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-5)


def test_int8_weights_leave_the_indexer_in_float(model):
    """`quantize_model` (sample.weights=int8) quantises mla's matmul weights it knows and
    leaves the indexer's (small, and read with its own layouts) as they are; the quantised
    model's logits follow the float model's."""
    from moe_jax.model.int8 import Int8Param, quantize_model

    cfg, m = model
    q = quantize_model(m)
    own = q.blocks.layers[0].attn
    assert isinstance(own.wo, Int8Param) and type(own.indexer.w_key) is nnx.Param
    np.testing.assert_array_equal(
        own.indexer.w_key[...], m.blocks.layers[0].attn.indexer.w_key[...]
    )
    tokens = np.random.default_rng(8).integers(0, 64, (1, T)).astype(np.int32)
    positions, segments = np.arange(T, dtype=np.int32)[None], np.ones((1, T), np.int32)
    want, got = _full(m, tokens, positions, segments), _full(q, tokens, positions, segments)
    # int8 rounding moves logits (and a few top-k picks with them): 0.98 measured
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95
