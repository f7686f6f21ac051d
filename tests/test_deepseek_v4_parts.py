"""DeepSeek-V4's parts outside attention in our model, and its grouped output projection
(parity of each module with transformers is tests/test_deepseek_v4_reference.py's):

- one tiny model with all of them: a dense layer, a hash-routed layer (the prefix), then two
  scanned top-k layers with sqrtsoftplus scores and a correction bias, the residual 4
  hyper-connected streams, the output projection in 2 groups of rank 8. Scanned equals
  unrolled; decoding with the KV cache equals the full forward; the hash layer takes its
  table's experts; the summary counts mHC apart and the table as no weight; the table gets
  no weight decay; the correction bias moves in the top-k layers only;
- the hash-routed layer under expert parallelism equals the unsharded one (values, gradients;
  the table's gradient is zero);
- the refusals, by name, of what does not compose yet.
Float32, 1e-5: the same products summed in another order (scan, shards, cache).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import ConfigError
from moe_jax.interop.checks import Unsupported, check_no_hybrid_parts
from moe_jax.interop.safetensors_io import InteropError
from moe_jax.model import Transformer
from moe_jax.model.balancing import update_correction_bias
from moe_jax.model.moe import MoE
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh
from moe_jax.summary.counts import param_breakdown
from moe_jax.train.step import decay_mask
from tests.helpers import forward_cached, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)
V4 = (
    "model.n_layers=4",
    "model.vocab_size=64",
    "model.hc_mult=4",
    "attention.o_groups=2",
    "attention.o_lora_rank=8",
    "attention.nope_interval=0",
    "attention.temperature_tuning=false",
    "moe.interleave_step=1",
    "moe.first_dense_layers=1",
    "moe.hash_layers=1",
    "moe.n_experts=8",
    "moe.expert_hidden=16",
    "moe.score=sqrtsoftplus",
    "moe.routed_scaling_factor=1.5",
    "moe.correction_bias=true",
    "moe.capacity_factor=0",
)


@pytest.fixture(scope="module")
def run():
    """The model scanned and unrolled (same params), a batch and the scanned full forward."""
    cfg = tiny_config(*V4, "model.scan_layers=true")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    unrolled_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    unrolled = Transformer(unrolled_cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)), jnp.int32)
    logits, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
    return cfg, model, unrolled, tokens, logits, aux


def test_model_layout_scan_and_hash_routes(run):
    cfg, model, unrolled, tokens, logits, aux = run
    assert cfg.prefix_layers == 2 and model.n_blocks == 2 and model.moe_layers() == [1, 2, 3]
    hash_moe = model.prefix[1].ffn
    assert hasattr(hash_moe, "tid2eid") and not hasattr(hash_moe, "correction_bias")
    table = np.asarray(hash_moe.tid2eid[...]).astype(int)
    assert all(len(set(row)) == cfg.moe.top_k for row in table)  # distinct experts per token
    np.testing.assert_array_equal(aux["routes"][0], table[np.asarray(tokens)])
    # The summary counts mHC's params as a component of their own and the table as no weight
    # (transformers' buffer): 8 blocks' fn [N D, (2 + N) N], bias and 3 scales, the head's.
    b = param_breakdown(cfg)
    N, D = 4, 32
    assert b.total["mhc"] == 8 * (N * D * (2 + N) * N + (2 + N) * N + 3) + N * D * N + N + 1
    n_params = sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert sum(b.total.values()) == n_params - table.size
    got, got_aux = nnx.jit(lambda m, t: m(t))(unrolled, tokens)
    np.testing.assert_allclose(got, logits, **TOL)
    np.testing.assert_array_equal(got_aux["routes"], aux["routes"])


def test_decoding_with_the_cache_equals_the_full_forward(run):
    """A prefill of 11 tokens and one step: the streams live between the layers only, the
    cache holds what it holds without mHC."""
    cfg, model, _, tokens, logits, _ = run
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    cache = model.init_cache(B, T)
    first, _, cache = forward_cached(model, tokens[:, :-1], positions[:, :-1], cache)
    last, _, _ = forward_cached(model, tokens[:, -1:], positions[:, -1:], cache)
    np.testing.assert_allclose(first, logits[:, :-1], **TOL)
    np.testing.assert_allclose(last, logits[:, -1:], **TOL)


def test_no_decay_of_the_table_and_the_bias_update(run):
    """The hash table gets no weight decay (and a zero gradient: the expert-parallel test),
    so AdamW never moves it; the correction bias moves in the top-k layers only."""
    cfg, model, _, _, _, aux = run
    params = nnx.state(model, nnx.Param)
    decays = {
        "/".join(str(k.key) for k in path if hasattr(k, "key")): v
        for path, v in jax.tree_util.tree_flatten_with_path(decay_mask(params, False))[0]
    }
    assert not decays["prefix/1/ffn/tid2eid"] and decays["blocks/layers/0/ffn_hc/fn"]
    assert not decays["hc_head/bias"] and not decays["prefix/0/attn_hc/scale"]
    moved = update_correction_bias(params, {"expert_load": aux["expert_load"]}, cfg)
    step = moved["blocks"]["layers"][0]["ffn"]["correction_bias"][...]
    load = np.asarray(aux["expert_load"][1:])  # the top-k layers' rows, after the hash layer's
    want = cfg.moe.bias_update_rate * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(step, want, atol=1e-9)
    table = params["prefix"][1]["ffn"]["tid2eid"][...]
    np.testing.assert_array_equal(moved["prefix"][1]["ffn"]["tid2eid"][...], table)


def test_hash_layer_under_expert_parallelism_equals_the_unsharded_one():
    cfg = tiny_config(*V4, "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "train.batch_size=8")
    mesh = make_mesh(cfg)
    ref = MoE(cfg, rngs=nnx.Rngs(0), hashed=True)
    sharded = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0), hashed=True), mesh)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 4, 32)), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (8, 4)), jnp.int32)

    def loss(moe, x, tokens, groups):
        y, stats = moe(x, groups, None, moe.hashed_experts(tokens))
        return jnp.sum(jnp.sin(y)) + stats["lb_loss"], (y, stats["experts"])

    grad_fn = nnx.jit(nnx.value_and_grad(loss, has_aux=True), static_argnums=3)
    (_, (y_ref, e_ref)), g_ref = grad_fn(ref, x, tokens, 8)
    with jax.set_mesh(mesh):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P(BATCH_AXES)))
        (_, (y_sh, e_sh)), g_sh = grad_fn(sharded, put(x), put(tokens), 1)
    table = np.asarray(ref.tid2eid[...]).astype(int)
    np.testing.assert_array_equal(e_ref, table[np.asarray(tokens)])
    np.testing.assert_array_equal(e_sh, e_ref)
    np.testing.assert_allclose(y_sh, y_ref, **TOL)
    assert np.abs(np.asarray(g_ref["router"][...])).max() > 0
    assert not np.asarray(g_ref["tid2eid"][...]).any()  # read as ints: no gradient
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), g_sh, g_ref)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("moe.hash_layers=1", "moe.interleave_step=2"),
         "moe.hash_layers routes the first MoE layers by token id: it needs moe.n_experts > 0 "
         "and every layer after the dense prefix MoE (moe.interleave_step=1)"),
        (("moe.hash_layers=3", "moe.first_dense_layers=2", "moe.interleave_step=1"),
         "moe.first_dense_layers + moe.hash_layers (5) exceeds model.n_layers (4)"),
        (("moe.hash_layers=4", "moe.interleave_step=1", "model.mtp_depth=1"),
         "builds MTP layers of the last layer's kind, hash-routed here"),
        (("model.hc_mult=4", "model.mtp_depth=1"),
         "model.hc_mult > 0 (hyper-connections) does not compose with multi-token"),
        (("model.hc_mult=4", "model.hc_sinkhorn_iters=0"), "model.hc_sinkhorn_iters must be "),
        (("attention.o_groups=3", "attention.o_lora_rank=8"),
         "attention.o_groups (3) groups grouped-query attention's heads: it needs "
         "attention.kind=gqa and must divide attention.n_heads (4)"),
        (("moe.score=sqrt",), "moe.score='sqrt' is not supported; use one of softmax, sigmoid, "
         "sqrtsoftplus"),
    ],
    ids=["hash_interleaved", "hash_past_layers", "hash_mtp", "hc_mtp", "hc_iters", "o_groups",
         "score"],
)  # fmt: skip
def test_refusals(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config("model.n_layers=4", *overrides)


def test_export_refuses_v4_parts(run):
    u = Unsupported("Qwen3MoeForCausalLM")
    check_no_hybrid_parts(run[0], u)
    with pytest.raises(InteropError, match=r"hyper-connections \(model.hc_mult\) are not sup"):
        u.raise_if_any()
    assert "hash-routed layers (moe.hash_layers) are not supported" in u.reasons
    assert "a grouped output projection (attention.o_groups) is not supported" in u.reasons
