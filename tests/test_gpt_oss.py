"""gpt-oss's model parts: attention sinks (a learned logit per query head that joins each
row's softmax and takes no value), layers alternating a sliding window and full attention, and
the whole gpt-oss-shaped model sharded, in int8 and decoding (its HF parity and the clamped
experts are tested in test_interop.py and test_moe.py).

Reference: the softmax over the masked logits with the sink as one more column, which is then
dropped (transformers' `eager_attention_forward` for gpt-oss), written with plain jnp ops and
differentiated by autodiff. float32 throughout (matmuls at full precision, conftest): the
blocked path sums the same terms in another order, ~1e-6 relative; 2e-5 is ample and a sink
left out or counted in the wrong row is off by its whole weight (~0.1-0.5 here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import backends
from moe_jax.model import Transformer
from moe_jax.model.attention import Attention, attention_mask
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh
from tests.helpers import (
    dequantised_copy,
    forward,
    forward_cached,
    randomize_biases,
    tiny_config,
)

TOL = dict(rtol=2e-5, atol=2e-5)
B, T = 2, 384  # several query blocks of the blocked path, three of splash's tiles


def naive(q_BTHD, k_BTKD, v_BTKD, mask_BTS, sinks_H, scale):
    H, K = q_BTHD.shape[2], k_BTKD.shape[2]
    k_BTHD, v_BTHD = (jnp.repeat(a, H // K, axis=2) for a in (k_BTKD, v_BTKD))
    logits_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD * scale, k_BTHD)
    logits_BHTS = jnp.where(mask_BTS[:, None], logits_BHTS, -jnp.inf)
    sink_BHT1 = jnp.broadcast_to(sinks_H[None, :, None, None], (*logits_BHTS.shape[:3], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits_BHTS, sink_BHT1], axis=-1), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs[..., :-1], v_BTHD)


def shift_sinks(model: nnx.Module, by: float) -> None:
    """Every sink logit moved by `by`, keeping its sharding."""
    for path, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and path[-1] == "sinks":
            p[...] = p[...] + by


def _setup(*overrides, seed=0):
    cfg = tiny_config("attention.sinks=true", *overrides)
    attn = Attention(cfg, 0, rngs=nnx.Rngs(0))
    H, K, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    ks = jax.random.split(jax.random.key(seed), 4)
    attn.sinks[...] = jax.random.normal(ks[3], (H,))
    qkv = (
        jax.random.normal(ks[0], (B, T, H, hd)),
        jax.random.normal(ks[1], (B, T, K, hd)),
        jax.random.normal(ks[2], (B, T, K, hd)),
    )
    return attn, qkv


def _value_and_grads(attn, impl, q, k, v, positions):
    """Output and the gradients of q, k, v and the sinks of a loss weighting every output
    element differently."""
    attn.impl = impl
    graph, params, rest = nnx.split(attn, nnx.Param, ...)

    def loss(params, q, k, v):
        out = nnx.merge(graph, params, rest)._self_attention(q, k, v, positions, None)
        weights = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
        return jnp.sum(out * weights), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, out), (d_params, dq, dk, dv) = jax.jit(grad)(params, q, k, v)
    return out, (dq, dk, dv, d_params["sinks"][...])


@pytest.mark.parametrize("window", [0, 100], ids=["causal", "window"])
def test_blocked_sinks_equal_the_extra_softmax_column(window):
    attn, (q, k, v) = _setup(f"attention.sliding_window={window}")
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    got = _value_and_grads(attn, "blocked", q, k, v, positions)

    idx = jnp.arange(T)
    mask = attention_mask(positions, positions, window=window, order=(idx, idx))

    def ref_loss(sinks, q, k, v):
        out = naive(q, k, v, mask, sinks, attn.head_dim**-0.5)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape))

    ref_grads = jax.grad(ref_loss, argnums=(1, 2, 3, 0))(attn.sinks[...], q, k, v)
    want = (naive(q, k, v, mask, attn.sinks[...], attn.head_dim**-0.5), ref_grads)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (got[0], *got[1]),
                          (want[0], *want[1]), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)
    assert float(jnp.max(jnp.abs(got[1][3]))) > 1e-2  # the sinks really learn


@pytest.mark.parametrize("window", [0, 100], ids=["causal", "window"])
def test_splash_takes_the_sinks_like_blocked(window):
    """The splash kernel's own `sinks` (interpreted here): values and every gradient."""
    attn, (q, k, v) = _setup(f"attention.sliding_window={window}", seed=1)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    want = _value_and_grads(attn, "blocked", q, k, v, positions)
    got = _value_and_grads(attn, "splash", q, k, v, positions)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (got[0], *got[1]),
                          (want[0], *want[1]), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)


def test_cudnn_takes_no_sinks_and_auto_falls_back_to_blocked():
    with backends.targeting("gpu"):
        assert backends.choose("attention", "auto", dtype=jnp.bfloat16, sinks=True) == "blocked"
        with pytest.raises(backends.KernelError, match="takes no attention sinks"):
            backends.choose("attention", "cudnn", dtype=jnp.bfloat16, sinks=True)


def test_full_attention_interval_alternates_window_and_full_layers():
    cfg = tiny_config(
        "model.n_layers=4", "attention.sliding_window=8", "attention.full_attention_interval=2",
        "attention.nope_interval=0", "moe.interleave_step=1",
    )  # fmt: skip
    assert [Attention(cfg, i, rngs=nnx.Rngs(0)).window for i in range(4)] == [8, 0, 8, 0]
    assert cfg.layer_period == 2


@pytest.mark.parametrize("scan", [False, True])
def test_decoding_with_sinks_and_alternating_windows_equals_the_full_forward(scan):
    """Prefill 20 tokens, then decode 20 one at a time, through the KV cache (`attend`, the
    masks by position): the logits of the full 40-token forward (the blocked path, masks by
    index), with a window of 8 on every other layer, so both masks and the sinks matter."""
    cfg = tiny_config(
        "model.n_layers=4", "attention.sinks=true", "attention.sliding_window=8",
        "attention.full_attention_interval=2", f"model.scan_layers={str(scan).lower()}",
        "moe.capacity_factor=0",  # the 40-token forward would drop what decoding keeps
    )  # fmt: skip
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    shift_sinks(model, 1.5)  # far from their init (0), so they count
    toks = jax.random.randint(jax.random.key(2), (2, 40), 0, cfg.model.vocab_size)
    full = forward(model, toks)[0]
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    logits, _, cache = forward_cached(model, toks[:, :20], pos[:, :20], model.init_cache(2, 40))
    steps = [logits]
    for t in range(20, 40):
        logits, _, cache = forward_cached(model, toks[:, t : t + 1], pos[:, t : t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    ring, full_layer = cache["blocks"][:2]  # layer 0 of the period: a window; 1: full
    assert ring["k"].shape[-3] == 8 and ring["pos"].shape[-1] == 8  # the window, not 40
    assert full_layer["k"].shape[-3] == 40 and "pos" not in full_layer


def test_sampler_with_ring_caches_equals_repeated_full_forwards():
    """The sampler pads prompts of 3 and 21 tokens to a 32-token bucket: the padding must
    reach no ring (a window of 8 would otherwise lose the short row's keys to it), and greedy
    tokens equal the argmax of repeated full forwards (`greedy_reference`)."""
    from moe_jax.inference.sampling import Sampler
    from tests.test_sampling import greedy_reference

    cfg = tiny_config(*GPT_OSS, "model.init_std=0.05", "model.max_seq_len=64", "train.seq_len=64")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    randomize_biases(model)
    shift_sinks(model, 1.0)
    prompts = [[5, 17, 99], list(range(30, 51))]
    got = Sampler(model).generate(prompts, 12, temperature=0).tokens
    np.testing.assert_array_equal(got, greedy_reference(model, prompts, 12))


# A tiny gpt-oss: sinks, window 8 on every other layer, YaRN, q/k/v/o biases, biased router
# and clamped experts (a limit the tiny model's values cross), every layer MoE.
GPT_OSS = [
    "model.n_layers=4", "attention.nope_interval=0", "attention.sinks=true",
    "attention.sliding_window=8", "attention.full_attention_interval=2",
    "attention.qkv_bias=true", "attention.o_bias=true", "attention.rope_scaling.type=yarn",
    "attention.rope_scaling.factor=4", "attention.rope_scaling.original_max_position=16",
    "moe.interleave_step=1", "moe.router_bias=true", "moe.expert_bias=true",
    "moe.swiglu_limit=0.3", "moe.n_experts=8", "moe.capacity_factor=0",
]  # fmt: skip


def test_sharded_gpt_oss_equals_one_device_values_and_gradients():
    """fsdp 2 x expert 2 x tensor 2 (the sinks split over tensor with their heads): the loss
    and every parameter's gradient of the unsharded model, to float32 summation order (1e-5
    of each tensor's largest entry)."""
    over = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "train.batch_size=8"]
    cfg = tiny_config(*GPT_OSS, *over)
    mesh = make_mesh(cfg)
    build = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    ref, sharded = build(), create_sharded(build, mesh)
    for m in (ref, sharded):
        randomize_biases(m)
        shift_sinks(m, 1.0)
    toks = jax.random.randint(jax.random.key(1), (8, 24), 0, cfg.model.vocab_size)

    def loss(model, toks):
        logits, stats = model(toks)[:2]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]) + stats["lb_loss"]

    grad = nnx.jit(nnx.value_and_grad(loss))
    l_ref, g_ref = grad(ref, toks)
    with jax.set_mesh(mesh):
        xs = jax.device_put(toks, jax.sharding.NamedSharding(mesh, jax.P(BATCH_AXES)))
        l_sh, g_sh = grad(sharded, xs)
    np.testing.assert_allclose(l_sh, l_ref, rtol=1e-5)
    ref_flat = dict(nnx.to_flat_state(g_ref))
    for path, g in nnx.to_flat_state(g_sh):
        want = np.asarray(ref_flat[path][...])
        np.testing.assert_allclose(
            g[...], want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=str(path)
        )
    assert float(jnp.max(jnp.abs(g_ref.blocks.layers[0].attn.sinks[...]))) > 1e-4


def test_int8_gpt_oss_computes_its_dequantised_weights():
    """int8 weights beside float sinks, biases and router: exactly what a float model holding
    the dequantised weights computes (float32 reassociation: 1e-5), on the expert buffers (a
    prompt) and the gathered picked experts (one token each, 2 x 2 < 8 experts)."""
    from moe_jax.model.int8 import quantize_model

    cfg = tiny_config(*GPT_OSS, "model.init_std=0.05")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    randomize_biases(model)
    shift_sinks(model, 1.0)
    qmodel = quantize_model(model)
    dequantised = dequantised_copy(model, qmodel)
    for tokens in (jnp.array([[5, 17, 99, 200, 3, 8] * 3] * 2), jnp.array([[5], [200]])):
        np.testing.assert_allclose(
            forward(qmodel, tokens)[0], forward(dequantised, tokens)[0], rtol=1e-5, atol=1e-5
        )


def test_mxfp4_experts_compute_their_dequantised_weights_and_sample():
    """quantize_model(model, "mxfp4"): the routed experts packed (4.25 bits a weight), every
    other weight as it was; the model computes what a float model holding the dequantised
    experts computes (1e-5), on the buffers and the gathered picked experts, and the sampler
    (its decode loop dequantising in each layer's turn) gives that model's greedy tokens."""
    from moe_jax.inference.sampling import Sampler
    from moe_jax.model.int8 import Mxfp4Param, QuantizedParam, QuantizeError, quantize_model
    from tests.test_sampling import greedy_reference

    cfg = tiny_config(*GPT_OSS, "model.init_std=0.05", "moe.expert_hidden=32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    randomize_biases(model)
    qmodel = quantize_model(model, "mxfp4")
    params = nnx.to_flat_state(nnx.state(qmodel, nnx.Param))
    packed = {p for p, v in params if isinstance(v, QuantizedParam)}
    assert all(isinstance(v, Mxfp4Param) for p, v in params if p in packed)
    experts = {"w_gate", "w_up", "w_down"}
    assert packed == {p for p, _ in params if "experts" in p and p[-1] in experts}
    dequantised = dequantised_copy(model, qmodel)
    for tokens in (jnp.array([[5, 17, 99, 200, 3, 8] * 3] * 2), jnp.array([[5], [200]])):
        np.testing.assert_allclose(
            forward(qmodel, tokens)[0], forward(dequantised, tokens)[0], rtol=1e-5, atol=1e-5
        )
    prompts = [[5, 17, 99], [7, 1, 2, 3, 4, 5, 6]]
    got = Sampler(qmodel).generate(prompts, 6, temperature=0).tokens
    np.testing.assert_array_equal(got, greedy_reference(dequantised, prompts, 6))
    with pytest.raises(QuantizeError, match="moe.expert_hidden \\(40\\) must be multiples"):
        quantize_model(Transformer(tiny_config(*GPT_OSS), rngs=nnx.Rngs(0)), "mxfp4")
