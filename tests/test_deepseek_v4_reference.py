"""DeepSeek-V4's parts outside attention against the transformers modules they mirror
(`models/deepseek_v4/modeling_deepseek_v4.py`), each built alone with tiny sizes and our
weights copied in:

- the MoE block (`DeepseekV4SparseMoeBlock`): a top-k layer with `sqrtsoftplus` scores, the
  correction bias choosing and routed_scaling_factor 1.5, and a hash-routed layer (`tid2eid`);
  the shared expert beside both;
- mHC (`DeepseekV4HyperConnection`): the pre / post / comb weights, the block's input, the new
  streams as the reference's decoder layer mixes them, and the head (`DeepseekV4HyperHead`);
- gradients through mHC (input streams, fn, bias, scale) against torch autograd in float64;
- the grouped low-rank output projection (`DeepseekV4GroupedLinear` o_a_proj, then o_b_proj).

Outputs agree within 1e-5 (float32 against float32): the same operations in another order,
values of order 1, so the differences are a few float32 ulps (measured ~1e-6).
V4's experts clamp their SwiGLU at `swiglu_limit` (silu, not gpt-oss's form); that clamp is
not built here, so the reference runs with a limit no value reaches (1e6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model.attention import grouped_output
from moe_jax.model.hyper_connections import HyperConnection, HyperHead
from moe_jax.model.moe import MoE
from tests.helpers import tiny_config

torch = pytest.importorskip("torch", reason="reference tests need torch (the `interop` extra)")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
V4Config = pytest.importorskip("transformers").DeepseekV4Config

D, E, K, F, N, V = 32, 8, 2, 16, 4, 64
OURS = (
    "model.d_model=32",
    f"model.vocab_size={V}",
    "model.norm_eps=1e-6",
    "model.hc_mult=4",
    "model.n_layers=2",
    "moe.interleave_step=1",
    "moe.hash_layers=1",
    "moe.n_experts=8",
    "moe.top_k=2",
    "moe.expert_hidden=16",
    "moe.shared_expert_hidden=16",
    "moe.score=sqrtsoftplus",
    "moe.renormalize=true",
    "moe.routed_scaling_factor=1.5",
    "moe.correction_bias=true",
    "moe.capacity_factor=0",
    "moe.impl=batched",  # the quickest to compile on CPU; every impl routes the same
)


@pytest.fixture(scope="module")
def cfg():
    return tiny_config(*OURS)


@pytest.fixture(scope="module")
def hf_config():
    return V4Config(
        vocab_size=V, hidden_size=D, moe_intermediate_size=F, num_hidden_layers=2,
        num_attention_heads=2, head_dim=16, q_lora_rank=16, n_routed_experts=E,
        num_experts_per_tok=K, n_shared_experts=1, routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus", hc_mult=N, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rms_norm_eps=1e-6, swiglu_limit=1e6, mlp_layer_types=["hash_moe", "moe"],
        o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, sliding_window=8,
    )  # fmt: skip


def t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a, np.float32))


def normal(seed: int, *shape, std: float = 1.0) -> jax.Array:
    """Random values from numpy (no program to compile for them)."""
    return jnp.asarray(np.random.default_rng(seed).normal(0, std, shape), jnp.float32)


def randomize(module: nnx.Module, seed: int, std: float = 0.3) -> None:
    """Every param N(0, std^2), a `scale` 1 + N(0, 0.3^2) (weights of order one, biases away
    from 0), bar the hash table."""
    for i, (path, p) in enumerate(nnx.iter_graph(module)):
        if isinstance(p, nnx.Param) and path[-1] != "tid2eid":
            one = path[-1] == "scale"
            p[...] = one + normal(seed * 1000 + i, *p[...].shape, std=0.3 if one else std)


def copy_moe(ours: MoE, block) -> None:
    """Our MoE layer's weights into transformers' block ([in, out] -> Linear's [out, in])."""
    ex, sh = ours.experts, ours.shared
    with torch.no_grad():
        block.gate.weight.copy_(t(ours.router[...].T))
        gate_up = np.concatenate([ex.w_gate[...], ex.w_up[...]], axis=-1)  # [E, D, 2F]
        block.experts.gate_up_proj.copy_(t(np.swapaxes(gate_up, 1, 2)))
        block.experts.down_proj.copy_(t(np.swapaxes(ex.w_down[...], 1, 2)))
        for name in ("gate", "up", "down"):
            getattr(block.shared_experts, f"{name}_proj").weight.copy_(
                t(getattr(sh, f"w_{name}")[...].T)
            )
        if hasattr(ours, "tid2eid"):
            block.gate.tid2eid.copy_(torch.tensor(np.asarray(ours.tid2eid[...], np.int64)))
        else:
            block.gate.e_score_correction_bias.copy_(t(ours.correction_bias[...]))


@pytest.mark.parametrize("hashed", [False, True], ids=["topk_sqrtsoftplus", "hash"])
def test_moe_block_equals_transformers(cfg, hf_config, hashed):
    ours = MoE(cfg, rngs=nnx.Rngs(1), hashed=hashed)
    randomize(ours, seed=2)
    assert hasattr(ours, "tid2eid") == hashed and hasattr(ours, "correction_bias") != hashed
    block = v4.DeepseekV4SparseMoeBlock(hf_config, layer_idx=0 if hashed else 1).eval()
    assert block.is_hash == hashed
    copy_moe(ours, block)
    x = normal(3, 2, 16, D)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, V, (2, 16)), jnp.int32)
    replay = ours.hashed_experts(tokens) if hashed else None
    y, stats = nnx.jit(lambda m, x, r: m(x, 1, None, r))(ours, x, replay)
    ids = torch.tensor(np.asarray(tokens, np.int64))
    with torch.no_grad():
        want = block(t(x), input_ids=ids)
        e_want = (block.gate(t(x), ids) if hashed else block.gate(t(x)))[2]
    # The same experts (as sets: the reference's top-k is unsorted), the same output.
    got_e = np.sort(np.asarray(stats["experts"]).reshape(-1, K), -1)
    np.testing.assert_array_equal(got_e, np.sort(e_want.numpy(), -1))
    if hashed:  # every token its table row
        np.testing.assert_array_equal(stats["experts"], np.asarray(ours.tid2eid[...])[tokens])
    else:  # the bias changed some choice: it really chooses (and never weighs)
        plain = np.argsort(-np.asarray(x.reshape(-1, D) @ ours.router[...]), -1)[:, :K]
        assert (np.sort(plain, -1) != got_e).any()
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)


def copy_hc(ours, module, head: bool = False) -> None:
    names = ("hc_fn", "hc_base", "hc_scale") if head else ("fn", "base", "scale")
    with torch.no_grad():
        for ours_name, theirs in zip(("fn", "bias", "scale"), names, strict=True):
            value = ours.fn[...].T if ours_name == "fn" else getattr(ours, ours_name)[...]
            getattr(module, theirs).copy_(t(value))


@pytest.fixture(scope="module")
def hc_pair(cfg, hf_config):
    """Our HyperConnection and HyperHead with random weights, the reference's with copies."""
    hc, head = HyperConnection(cfg, rngs=nnx.Rngs(5)), HyperHead(cfg, rngs=nnx.Rngs(6))
    randomize(hc, seed=7, std=0.1)  # fn's outputs ~N(0, 1.3): sigmoids and softmax not saturated
    randomize(head, seed=8, std=0.1)
    ref, ref_head = v4.DeepseekV4HyperConnection(hf_config), v4.DeepseekV4HyperHead(hf_config)
    copy_hc(hc, ref)
    copy_hc(head, ref_head, head=True)
    x, y = normal(9, 2, 8, N, D), normal(10, 2, 8, D)  # the streams, a block's output
    return hc, head, ref, ref_head, x, y


def reference_streams(ref, x, y_of):
    """The reference decoder layer's residual step: the streams after one block whose output
    is `y_of(its input)` (DeepseekV4DecoderLayer.forward's lines)."""
    post, comb, collapsed = ref(x)
    y = y_of(collapsed)
    return collapsed, post.to(x.dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb.to(x.dtype).transpose(-1, -2), x
    )


def test_hyper_connection_equals_transformers(hc_pair):
    hc, head, ref, ref_head, x, y = hc_pair

    @nnx.jit
    def run(hc, head, x, y):
        collapsed, add = hc.enter(x)
        return *hc.weights(x), collapsed, add(y), head(x)

    pre, post, comb, collapsed, streams, merged = run(hc, head, x, y)
    with torch.no_grad():
        post_want, comb_want, _ = ref(t(x))
        col_want, streams_want = reference_streams(ref, t(x), lambda _: t(y))
        head_want = ref_head(t(x))
    np.testing.assert_allclose(post, post_want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(comb, comb_want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(collapsed, col_want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(streams, streams_want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged, head_want.numpy(), rtol=1e-5, atol=1e-5)
    # Sinkhorn made comb doubly stochastic (to its 20 iterations' precision) and not symmetric,
    # so the transposed mixing matters; the weights are away from their saturation.
    np.testing.assert_allclose(jnp.sum(comb, -2), 1, atol=1e-5)
    np.testing.assert_allclose(jnp.sum(comb, -1), 1, atol=1e-2)  # rows: one iteration behind
    assert np.abs(comb - jnp.swapaxes(comb, -1, -2)).max() > 1e-2
    assert float(pre.min()) > 0.05 and float(pre.max()) < 0.95 and float(post.std()) > 0.1


def test_hyper_connection_gradients_equal_torch_float64(hc_pair):
    """d/d(streams, fn, bias, scale) of a loss through the block's input, a block (tanh of a
    fixed map) and the new streams, our float32 against torch autograd in float64: within
    float32 rounding of gradients of order 1 (2e-5)."""
    hc, _, ref, _, x, _ = hc_pair
    W, r1, r2 = normal(11, D, D, std=D**-0.5), normal(12, 2, 8, D), normal(13, 2, 8, N, D)
    graphdef, params = nnx.split(hc, nnx.Param)

    def loss(params, x):
        collapsed, add = nnx.merge(graphdef, params).enter(x)
        return jnp.sum(collapsed * r1) + jnp.sum(add(jnp.tanh(collapsed @ W)) * r2)

    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    ref64 = ref.double()
    x64 = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    W64, r1_64, r2_64 = (torch.tensor(np.asarray(a, np.float64)) for a in (W, r1, r2))
    col, streams = reference_streams(ref64, x64, lambda c: torch.tanh(c @ W64))
    (torch.sum(col * r1_64) + torch.sum(streams * r2_64)).backward()
    for got, want in [
        (g_x, x64.grad),
        (g_params["fn"][...], ref64.fn.grad.T),
        (g_params["bias"][...], ref64.base.grad),
        (g_params["scale"][...], ref64.scale.grad),
    ]:
        want = want.numpy()
        assert np.abs(want).max() > 1e-2  # a gradient that is there
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_grouped_output_projection_equals_transformers():
    """8 heads of 4 dims in 2 groups of rank 3: our wo_a [G, H / G, hd, r] and wo_b [G, r, D]
    copied into the reference's o_a_proj [G r, H hd / G] and o_b_proj [D, G r]."""
    H, hd, G, r = 8, 4, 2, 3
    out, wo_a, wo_b = normal(20, 2, 5, H, hd), normal(21, G, H // G, hd, r), normal(22, G, r, D)
    y = jax.jit(lambda o, a, b: grouped_output(o, nnx.Param(a), nnx.Param(b), jnp.float32))(
        out, wo_a, wo_b
    )
    o_a = v4.DeepseekV4GroupedLinear(H * hd // G, G * r, G)
    o_b = torch.nn.Linear(G * r, D, bias=False)
    with torch.no_grad():
        o_a.weight.copy_(
            t(np.swapaxes(np.asarray(wo_a).reshape(G, -1, r), 1, 2).reshape(G * r, -1))
        )
        o_b.weight.copy_(t(np.asarray(wo_b).reshape(G * r, D).T))
        want = o_b(o_a(t(out).reshape(2, 5, G, -1)).flatten(2))  # DeepseekV4Attention's lines
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5)
