"""Multi-head latent attention (`attention.kind=mla`, moe_jax/model/mla.py): parity with
transformers' DeepseekV3Attention from the same weights, the absorbed latent-cache decode
against the expanded full forward (and a prefill in query blocks against one), packed
documents, gradients through the blocked kernel and a train step, 8 simulated devices against
one (forward and greedy decode), the fused-kernel path (splash, interpreted on CPU), the
cache's size and the parameter count, and the config's one-line errors.

Tolerances, float32 throughout (matmul precision "highest", conftest): the paths compared
compute the same sums in another order or form (torch vs XLA; the absorbed q (W_uk^T q_nope)
. c vs the expanded q_nope . (W_uk c); sharded partial sums), ~1e-6 apart on O(1) outputs,
so 1e-5 leaves margin, while a wrong scale, rotation, split or mask moves them by > 1e-2. The
weights are drawn larger than init (std ~ fan_in ** -0.5, norm scales 1 +- 0.3) so that
outputs are O(1) and every factor shows.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.model import Transformer, mla
from moe_jax.model.attention import attend, attention_mask
from moe_jax.model.mla import MLAttention
from moe_jax.summary.counts import kv_cache_bytes, param_counts
from tests.helpers import forward, forward_cached, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)
R, N, P, V, H, D = 16, 8, 8, 6, 4, 32  # kv_lora_rank, nope, rope, v dims, heads, d_model
MLA = [
    "attention.kind=mla",
    "attention.qk_norm=none",  # tiny.yaml has rms QK-norm and a NoPE layer: mla takes
    "attention.nope_interval=0",  # neither
    f"attention.kv_lora_rank={R}",
    f"attention.qk_nope_head_dim={N}",
    f"attention.qk_rope_head_dim={P}",
    f"attention.v_head_dim={V}",
    "moe.capacity_factor=0",  # no drops: positions may be computed one at a time
]
YARN = {"factor": 4.0, "original_max_position": 16, "mscale": 0.707, "mscale_all_dim": 1.0}


def mla_config(*overrides):
    return tiny_config(*MLA, *overrides)


# The dims each weight contracts over (its fan-in), counted from the end: a scanned layer's
# weights have a stack axis in front.
FAN_IN = {"wq": (-3,), "wq_a": (-2,), "wq_b": (-3,), "wkv_a": (-2,), "wk_b": (-3,),
          "wv_b": (-3,), "wo": (-3, -2)}  # fmt: skip


def scramble(module: nnx.Module, seed: int = 0) -> None:
    """Every MLA weight N(0, 1 / fan_in), every norm scale 1 + N(0, 0.3^2)."""
    for i, (path, p) in enumerate(nnx.iter_graph(module)):
        if not isinstance(p, nnx.Param):
            continue
        key = jax.random.fold_in(jax.random.key(seed), i)
        shape = p[...].shape
        if path[-1] == "scale":
            p[...] = 1 + 0.3 * jax.random.normal(key, shape)
        else:
            fan_in = np.prod([shape[d] for d in FAN_IN[path[-1]]])
            p[...] = jax.random.normal(key, shape) / np.sqrt(fan_in)


# ----------------------------------------------------------------------------- transformers


def hf_attention(layer: MLAttention, cfg, rope_style: str):
    """transformers' DeepseekV3Attention (eager, float32) holding `layer`'s weights."""
    torch = pytest.importorskip("torch", reason="HF parity needs torch (the `interop` extra)")
    tf = pytest.importorskip("transformers", reason="HF parity needs transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    a = cfg.attention
    s = a.rope_scaling
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if s.type == "yarn":
        rope = {**rope, "rope_type": "yarn", "factor": s.factor, "mscale": s.mscale,
                "mscale_all_dim": s.mscale_all_dim,
                "original_max_position_embeddings": s.original_max_position}  # fmt: skip
    hf_cfg = tf.DeepseekV3Config(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
        q_lora_rank=a.q_lora_rank or None, kv_lora_rank=R, qk_nope_head_dim=N,
        qk_rope_head_dim=P, v_head_dim=V, max_position_embeddings=256,
        rope_parameters=rope, rope_interleave=rope_style == "interleaved",
        attention_bias=False, attn_implementation="eager",
    )  # fmt: skip
    hf = ds.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    t = lambda w: torch.tensor(np.asarray(w[...]))
    linear = lambda w, fan_in: t(w).reshape(fan_in, -1).T  # ours [in, ...] -> torch [out, in]
    weights = {
        "kv_a_proj_with_mqa.weight": linear(layer.wkv_a, D),
        "kv_a_layernorm.weight": t(layer.kv_a_norm.scale),
        # kv_b_proj's rows are per head [k_nope | v]
        "kv_b_proj.weight": torch.cat([t(layer.wk_b), t(layer.wv_b)], -1).reshape(R, -1).T,
        "o_proj.weight": linear(layer.wo, H * V),
    }
    if a.q_lora_rank:
        weights |= {
            "q_a_proj.weight": linear(layer.wq_a, D),
            "q_a_layernorm.weight": t(layer.q_a_norm.scale),
            "q_b_proj.weight": linear(layer.wq_b, a.q_lora_rank),
        }
    else:
        weights["q_proj.weight"] = linear(layer.wq, D)
    hf.load_state_dict(weights, strict=True)
    return hf, ds.DeepseekV3RotaryEmbedding(hf_cfg), torch


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("rope_style", ["half", "interleaved"])
@pytest.mark.parametrize("yarn", [False, True])
def test_attention_equals_transformers_deepseek_v3(q_lora_rank, rope_style, yarn):
    """Same weights, same tokens at positions 3..18 (YaRN's interpolated band and its two
    mscales, on cos/sin and on the softmax scale, all in play): the layer's output equals
    DeepseekV3Attention's, with and without the query LoRA, in both RoPE layouts."""
    scaling = [f"attention.rope_scaling.{k}={v}" for k, v in YARN.items()] if yarn else []
    cfg = mla_config(
        f"attention.q_lora_rank={q_lora_rank}",
        f"attention.rope_style={rope_style}",
        *(["attention.rope_scaling.type=yarn", *scaling] if yarn else []),
    )
    layer = MLAttention(cfg, 0, rngs=nnx.Rngs(0))
    scramble(layer)
    hf, rotary, torch = hf_attention(layer, cfg, rope_style)
    B, T = 2, 16
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    positions = jnp.broadcast_to(jnp.arange(3, 3 + T), (B, T))
    ours, _ = jax.jit(lambda x, p: layer(x, p))(x, positions)

    x_t, pos_t = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(positions))
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = hf(x_t, rotary(x_t, pos_t), causal.expand(B, 1, T, T))
    assert float(jnp.abs(ours).mean()) > 0.1  # O(1) outputs, where 1e-5 means something
    np.testing.assert_allclose(ours, want.numpy(), **TOL)


def test_softmax_scale_takes_yarns_mscale_squared():
    """The numbers themselves: (dn + dr) ** -0.5 times (0.1 ln(4) + 1) ** 2 with mscale_all_dim
    1; YaRN's cos/sin factor the ratio of the two mscales."""
    scaling = [f"attention.rope_scaling.{k}={v}" for k, v in YARN.items()]
    layer = MLAttention(
        mla_config("attention.rope_scaling.type=yarn", *scaling), 0, rngs=nnx.Rngs(0)
    )
    m = lambda k: 0.1 * k * np.log(4.0) + 1
    assert layer.scale == pytest.approx((N + P) ** -0.5 * m(1.0) ** 2, rel=1e-12)
    assert layer.rope_scale == pytest.approx(m(0.707) / m(1.0), rel=1e-12)
    assert MLAttention(mla_config(), 0, rngs=nnx.Rngs(0)).scale == (N + P) ** -0.5


# ----------------------------------------------------------------------------- the cache


def mla_model(*overrides, seed=0):
    cfg = mla_config(*overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    for _, layer in nnx.iter_modules(model):
        if isinstance(layer, MLAttention):
            scramble(layer, seed)
    return cfg, model


def cached_logits(model, toks, prefill: int):
    """Logits of a prefill of `prefill` tokens then one token at a time, and the cache."""
    B, T = toks.shape
    cache = model.init_cache(B, T)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    out, _, cache = forward_cached(model, toks[:, :prefill], pos[:, :prefill], cache)
    outs = [out]
    for t in range(prefill, T):
        out, _, cache = forward_cached(model, toks[:, t : t + 1], pos[:, t : t + 1], cache)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("overrides", [[], ["attention.q_lora_rank=12", "model.scan_layers=true"]])
def test_absorbed_cached_decode_equals_the_expanded_full_forward(overrides):
    """Prefill 5 tokens, then 9 one at a time, through the latent cache and the absorbed form:
    the logits of the whole sequence's forward with every head's k and v expanded."""
    cfg, model = mla_model(*overrides)
    toks = jax.random.randint(jax.random.key(0), (2, 14), 0, cfg.model.vocab_size)
    full, _ = forward(model, toks)
    cached, cache = cached_logits(model, toks, prefill=5)
    assert float(jnp.std(full)) > 0.1
    np.testing.assert_allclose(cached, full, **TOL)
    # what the cache holds: [c | k_pe] per token, R + dr values, no per-head k or v
    shapes = {tuple(a.shape[-3:]) for a in jax.tree.leaves(cache)}
    assert shapes == {(14, 1, R + P)}, shapes
    assert all(set(c) == {"latent"} for c in cache["blocks"] + cache["tail"])


def test_long_prefill_in_query_blocks_equals_one_block(monkeypatch):
    """A 12-token prompt in query blocks of 5 (the last padded) gives the cache and logits of
    one block: the absorbed path goes through attention.py's prefill blocks."""
    from moe_jax.model import attention

    cfg, model = mla_model()
    toks = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.model.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))

    seen = []
    real_attend = mla.attend
    monkeypatch.setattr(mla, "attend", lambda q, *a: seen.append(q.shape[1]) or real_attend(q, *a))

    def prefill(block):
        monkeypatch.setattr(attention, "PREFILL_BLOCK", block)
        run = nnx.jit(lambda m, t, p, c: m(t, positions=p, cache=c))  # new: traced anew
        return run(model, toks, pos, model.init_cache(2, 16))

    whole, blocked = prefill(512), prefill(5)
    assert sorted(set(seen)) == [5, 12]  # the blocks did run
    np.testing.assert_allclose(blocked[0], whole[0], **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), blocked[2], whole[2])


def test_cache_bytes_per_token_deepseek_v3_sized_against_gqa():
    """summary.kv_cache_bytes counts what init_cache allocates: 576 values a token and layer
    for DeepSeek-V3's sizes, where GQA with the same 128 heads as kv heads of 128 caches
    2 * 128 * 128 = 32768 (57 times as many)."""
    v3 = ["model.d_model=7168", "attention.n_heads=128", "model.n_layers=1", "moe.n_experts=0"]
    sizes = ["attention.kv_lora_rank=512", "attention.qk_nope_head_dim=128",
             "attention.qk_rope_head_dim=64", "attention.v_head_dim=128",
             "attention.q_lora_rank=1536"]  # fmt: skip
    mla_cfg = mla_config(*v3, *sizes)
    gqa_cfg = tiny_config(*v3, "attention.n_kv_heads=128", "attention.head_dim=128")
    assert kv_cache_bytes(mla_cfg, 1, dtype_bytes=2) == (576 * 2, 576 * 2)
    assert kv_cache_bytes(gqa_cfg, 1, dtype_bytes=2) == (2 * 128 * 128 * 2,) * 2
    model = nnx.eval_shape(lambda: Transformer(mla_cfg, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: model.init_cache(1, 64, jnp.bfloat16))
    allocated = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert allocated == kv_cache_bytes(mla_cfg, 64)[0]
    # parameters as the model creates them: q LoRA, kv_a, the two norms, kv_b, o
    attn = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * (128 + 128) + 128 * 128 * 7168
    norms = 1536 + 512 + 3 * 7168  # the latents', the layer's two and the final norm
    dense = 3 * 7168 * mla_cfg.model.ffn_hidden
    embed = 2 * 7168 * mla_cfg.model.vocab_size
    assert param_counts(mla_cfg)[0] == attn + norms + dense + embed


def test_packed_documents_attend_only_within_themselves():
    """Two documents packed in one row (segments, positions restarting) give each document's
    logits alone: the expanded path takes attention.py's segment masks."""
    cfg, model = mla_model()
    toks = jax.random.randint(jax.random.key(4), (1, 12), 0, cfg.model.vocab_size)
    segments = jnp.array([[1] * 7 + [2] * 5])
    positions = jnp.array([list(range(7)) + list(range(5))])
    packed = nnx.jit(lambda m, t, p, s: m(t, positions=p, segments=s)[0])(
        model, toks, positions, segments
    )
    alone = [forward(model, toks[:, :7])[0], forward(model, toks[:, 7:])[0]]
    np.testing.assert_allclose(packed, jnp.concatenate(alone, axis=1), **TOL)


# ----------------------------------------------------------------------------- training


def naive_self_attention(q, k, v, positions, segments=None, *, scale):
    """Plain softmax attention over one [T, T] causal mask, autodiff's gradient."""
    T = q.shape[1]
    order = (jnp.arange(T), jnp.arange(T))
    seg = None if segments is None else (segments, segments)
    return attend(q, k, v, attention_mask(positions, positions, order=order, segments=seg), scale)


def test_gradients_equal_autodiffs_and_a_train_step_learns(monkeypatch):
    """The blocked kernel's hand-written backward with v's head dim (6) apart from q's and k's
    (16): the loss's gradients equal autodiff's through a plain softmax (to 1e-5 of each
    tensor's largest entry), every MLA weight gets one, and a few Adam steps on one batch
    lower the loss."""
    from moe_jax.train.step import compute_grads, init_state, make_optimizer, make_train_step

    cfg = mla_config(
        "attention.q_lora_rank=12", "model.n_layers=2", "train.lr=1e-2", "train.warmup_steps=0"
    )
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx)
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 256, jnp.int32)
    grads = lambda: jax.jit(lambda p: compute_grads(p, graphdef, tokens, cfg.train)[0])(
        state["params"]
    )
    got = jax.tree_util.tree_flatten_with_path(grads())[0]
    monkeypatch.setattr(mla, "blocked_self_attention", naive_self_attention)
    want = jax.tree.leaves(grads())
    monkeypatch.undo()
    reached = set()
    for (path, g), w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))
        name = jax.tree_util.keystr(path)
        if "attn" in name and float(jnp.abs(g).max()) > 0:
            reached |= {w for w in ("wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm") if w in name}
            reached |= {w for w in ("wk_b", "wv_b", "wo") if w in name}
    assert reached == {"wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wk_b", "wv_b", "wo"}

    step = make_train_step(cfg, graphdef, tx)
    losses = []
    for _ in range(4):
        state, metrics = step(state, tokens)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses


def test_splash_path_pads_v_and_equals_blocked():
    """The fused-kernel path (splash, interpreted on CPU; cuDNN's call is padded the same
    way): v padded to q's head dim, the padding's outputs dropped, equals the blocked path,
    values and gradients (the kernel's online softmax: 1e-5)."""
    cfg = mla_config("attention.q_lora_rank=12")
    T = 128  # splash tiles the sequence by 128
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.model.d_model))
    pos = jnp.arange(T)[None]

    def value_and_grads(impl):
        layer = MLAttention(
            mla_config("attention.q_lora_rank=12", f"attention.impl={impl}"), 0, rngs=nnx.Rngs(0)
        )
        scramble(layer)
        graphdef, params = nnx.split(layer)
        loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x, pos)[0]))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    outs = {impl: value_and_grads(impl) for impl in ("blocked", "splash")}
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    jax.tree.map(close, outs["splash"], outs["blocked"])


# ----------------------------------------------------------------------------- mesh


def test_sharded_forward_and_greedy_decode_equal_one_device():
    """8 simulated devices (data 2 x expert 2 x tensor 2: heads split over tensor, the
    latent cache over the batch axes only) give the single-device logits (1e-5) and greedy
    tokens (exact: top-2 margins here are far above float32 reassociation)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps

    from moe_jax.inference.decoding import shard_cache
    from moe_jax.inference.sampling import Sampler
    from moe_jax.sharding import make_mesh, state_shardings

    overrides = ["attention.q_lora_rank=12", "model.scan_layers=true"]
    cfg, alone = mla_model(*overrides)
    mesh = make_mesh(
        mla_config(*overrides, "mesh.data=2", "mesh.expert=2", "mesh.tensor=2"), inference=True
    )
    graphdef, params = nnx.split(alone)
    sharded = nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))
    assert "tensor" in str(sharded.blocks.layers[0].attn.wk_b[...].sharding.spec)
    toks = jax.random.randint(jax.random.key(5), (4, 16), 0, 256, jnp.int32)
    want = forward(alone, toks)[0]
    with jax.set_mesh(mesh):
        got = forward(sharded, toks)[0]
        cache = jax.jit(lambda: shard_cache(sharded.init_cache(4, 32)))()
    np.testing.assert_allclose(got, want, **TOL)
    latent = cache["blocks"][0]["latent"]  # [block, B, S, 1, R + dr]
    rows = NamedSharding(mesh, Ps(None, ("data", "expert"), None, None, None))
    assert latent.sharding.is_equivalent_to(rows, latent.ndim)

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    want_tokens = Sampler(alone).generate(prompts, 6, temperature=0).tokens
    got_tokens = Sampler(sharded, mesh=mesh).generate(prompts, 6, temperature=0).tokens
    np.testing.assert_array_equal(got_tokens, want_tokens)


# ----------------------------------------------------------------------------- config


CONFIG_ERRORS = {
    "kv_lora_rank": "attention.kind=mla needs attention.kv_lora_rank > 0 (DeepSeek-V3: 512)",
    "v_head_dim": "attention.kind=mla needs attention.v_head_dim > 0",
    "qk_rope_head_dim=5": "attention.qk_rope_head_dim (5) must be even for RoPE",
    "q_lora_rank=-1": "attention.q_lora_rank must be >= 0, got -1",
    "sliding_window=8": "mla does not support attention.sliding_window=8; set "
    "attention.sliding_window=0",
    "chunk_size=8": "does not support attention.chunk_size=8; set attention.chunk_size=0",
    "sinks=true": "does not support attention.sinks=true; set attention.sinks=false",
    "qk_norm=rms": "does not support attention.qk_norm=rms; set attention.qk_norm=none",
    "nope_interval=2": "does not support attention.nope_interval=2; set attention.nope_interval=0",
    "qkv_bias=true": "does not support attention.qkv_bias=true; set attention.qkv_bias=false",
    "o_bias=true": "does not support attention.o_bias=true; set attention.o_bias=false",
    "head_dim=16": "does not support attention.head_dim=16; set attention.head_dim=null",
    "kind=gqa": "attention.kv_lora_rank sizes multi-head latent attention; set "
    "attention.kind=mla too, or kv_lora_rank=0",
    "kind=mha": "attention.kind='mha' is not supported; use one of gqa, mla",
}


@pytest.mark.parametrize("override", CONFIG_ERRORS)
def test_config_errors_name_the_fix(override):
    value = override if "=" in override else f"{override}=0"
    with pytest.raises(ConfigError, match=re.escape(CONFIG_ERRORS[override])):
        mla_config(f"attention.{value}")


def test_mla_ignores_n_kv_heads_and_d_model_per_head():
    """n_kv_heads plays no part (the mesh does not ask tensor to divide it), nor does
    d_model's division by n_heads (a GQA head_dim): n_kv_heads 1 and 4 build one model."""
    from moe_jax.sharding import mesh_shape

    mesh = ["mesh.data=4", "mesh.tensor=2"]
    one = mla_config("attention.n_kv_heads=1", "model.d_model=30", *mesh)
    assert mesh_shape(one, 8)["tensor"] == 2
    with pytest.raises(ConfigError, match=re.escape("attention.n_kv_heads (1) must be divisible")):
        mesh_shape(tiny_config("attention.n_kv_heads=1", "attention.n_heads=2", *mesh), 8)
    four = mla_config("attention.n_kv_heads=4", "model.d_model=30")
    shapes = lambda c: jax.tree.map(
        lambda v: v.shape, nnx.state(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0))))
    )
    assert shapes(one) == shapes(four)
