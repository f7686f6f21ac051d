"""MoE layer against a dense every-expert-on-every-token reference, and tiny exact routing cases.

Tolerances: float32 end to end; dispatch/combine only move values, so the capacity path and the
dense reference differ only by summation order: 1e-5 relative is ample and would catch any
misrouted token (errors of order of the activations themselves, ~1e-1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model.experts import MAP_MIN_CAPACITY
from moe_jax.model.moe import MoE
from moe_jax.model.routing import Routing, assign_slots, capacity, route
from tests.helpers import one_expert_at_a_time, tiny_config


def reference_weights(logits_BTE: jax.Array, m) -> jax.Array:
    """Every expert's routing weight, 0 where not picked, written without `route`'s helpers:
    rank the logits by a double argsort, score them (softmax over all experts, or sigmoid of
    the raw logit), zero the unpicked and renormalise over the picked if asked."""
    rank_BTE = jnp.argsort(jnp.argsort(-logits_BTE, axis=-1), axis=-1)  # 0 = largest logit
    if m.score == "softmax":
        e = jnp.exp(logits_BTE - jnp.max(logits_BTE, axis=-1, keepdims=True))
        score_BTE = e / jnp.sum(e, axis=-1, keepdims=True)
    else:
        score_BTE = 1 / (1 + jnp.exp(-logits_BTE))
    w_BTE = jnp.where(rank_BTE < m.top_k, score_BTE, 0.0)
    if m.renormalize:
        w_BTE = w_BTE / jnp.sum(w_BTE, axis=-1, keepdims=True)
    return w_BTE


@nnx.jit
def dense_reference(moe: MoE, x_BTD: jax.Array) -> jax.Array:
    """Every expert on every token, weighted by the router (zero weight for unpicked experts)."""
    m = moe.cfg
    logits = x_BTD @ moe.router[...]
    if m.router_bias:
        logits = logits + moe.router_bias[...]
    w_BTE = reference_weights(logits, m)
    ex = moe.experts
    out = jnp.zeros_like(x_BTD)
    for e in range(m.n_experts):
        xin = x_BTD * w_BTE[..., e : e + 1] if m.route_scale == "input" else x_BTD
        b = lambda name, e=e: getattr(ex, name)[...][e] if hasattr(ex, name) else 0.0
        gate, up = xin @ ex.w_gate[...][e] + b("gate_bias"), xin @ ex.w_up[...][e] + b("up_bias")
        if m.swiglu_limit > 0:  # transformers' GptOssExperts._apply_gate
            gate = jnp.clip(gate, None, m.swiglu_limit)
            up = jnp.clip(up, -m.swiglu_limit, m.swiglu_limit)
            h = gate * jax.nn.sigmoid(gate * m.swiglu_alpha) * (up + 1)
        else:
            h = jax.nn.silu(gate) * up
        y = h @ ex.w_down[...][e] + b("down_bias")
        if m.route_scale == "input":
            # Unpicked experts get no input at all (not a zero input: biases would leak).
            y = jnp.where(w_BTE[..., e : e + 1] != 0, y, 0.0)
        else:
            y = y * w_BTE[..., e : e + 1]
        out = out + y
    if hasattr(moe, "shared"):
        out = out + moe.shared(x_BTD)
    return out


@nnx.jit(static_argnums=2)
def apply(moe: MoE, x_BTD: jax.Array, n_groups: int = 1):
    return moe(x_BTD, n_groups=n_groups)


def randomize(module: nnx.Module, seed: int) -> None:
    """Give biases and norm scales non-trivial values so they are really tested."""
    key = jax.random.key(seed)
    for _, p in nnx.iter_graph(module):
        if isinstance(p, nnx.Param):
            key, sub = jax.random.split(key)
            p[...] = jax.random.normal(sub, p[...].shape) * 0.3


VARIANTS = {
    "softmax_top2_renorm": ["moe.score=softmax", "moe.top_k=2", "moe.renormalize=true"],
    "softmax_top2_raw": ["moe.score=softmax", "moe.top_k=2", "moe.renormalize=false"],
    "softmax_top1_router_bias": ["moe.top_k=1", "moe.router_bias=true"],
    "sigmoid_input_shared": [
        "moe.score=sigmoid",
        "moe.top_k=1",
        "moe.renormalize=false",
        "moe.route_scale=input",
        "moe.shared_expert_hidden=24",
    ],
    "sigmoid_top2_expert_bias": ["moe.score=sigmoid", "moe.top_k=2", "moe.expert_bias=true"],
    # gpt-oss's experts: biased, clamped SwiGLU (a limit low enough that the tiny model's
    # gate and up values cross it on both sides), top-k then softmax over the k
    "clamped_swiglu_top2": [
        "moe.top_k=2",
        "moe.router_bias=true",
        "moe.expert_bias=true",
        "moe.swiglu_limit=0.8",
    ],
    "softmax_top3_shared_bias": [
        "moe.top_k=3",
        "moe.n_experts=8",
        "moe.shared_expert_hidden=16",
        "moe.expert_bias=true",
    ],
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("n_groups", [1, 2])
def test_no_drop_equals_dense_reference(name, n_groups):
    cfg = tiny_config("moe.capacity_factor=0", *VARIANTS[name])
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    randomize(moe, 1)
    x = jax.random.normal(jax.random.key(2), (4, 8, cfg.model.d_model))
    y, stats = apply(moe, x, n_groups)
    ref = dense_reference(moe, x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert float(stats["dropped_frac"]) == 0.0


@pytest.mark.parametrize(
    "unrolled,name",
    [(True, "softmax_top3_shared_bias"), (False, "softmax_top3_shared_bias"),
     (True, "clamped_swiglu_top2")],
)  # fmt: skip
def test_big_buffers_run_one_expert_at_a_time_and_match(unrolled, name, monkeypatch):
    """Buffers of >= MAP_MIN_CAPACITY slots run one expert at a time (training sizes),
    unrolled up to UNROLL_MAX_EXPERTS experts, else in a `lax.map`: values and gradients
    (a backward written by hand, gpt-oss's clamped SwiGLU's too) equal the dense
    reference's."""
    cfg = tiny_config("moe.capacity_factor=0", *VARIANTS[name])
    E = cfg.moe.n_experts
    one_expert_at_a_time(monkeypatch, unrolled)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    randomize(moe, 1)
    x = jax.random.normal(jax.random.key(2), (2, MAP_MIN_CAPACITY // 2, cfg.model.d_model))
    assert capacity(x.shape[0] * x.shape[1], cfg.moe) >= MAP_MIN_CAPACITY
    jaxpr = str(jax.make_jaxpr(lambda x: moe(x)[0])(x))
    assert (f"length={E}" not in jaxpr) == unrolled  # lax.map is a scan over the experts
    np.testing.assert_allclose(apply(moe, x)[0], dense_reference(moe, x), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda m: jnp.sum(jnp.sin(f(m)))
    grads = nnx.jit(nnx.grad(loss(lambda m: m(x)[0])))(moe)
    ref_grads = nnx.jit(nnx.grad(loss(lambda m: dense_reference(m, x))))(moe)
    np.testing.assert_allclose(
        grads.experts.w_gate[...], ref_grads.experts.w_gate[...], rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        grads.experts.w_down[...], ref_grads.experts.w_down[...], rtol=1e-4, atol=1e-5
    )


def test_large_capacity_factor_drops_nothing_and_matches():
    # cf = E / k guarantees C >= tokens per group: same as no-drop.
    cfg = tiny_config("moe.capacity_factor=2.0", "moe.n_experts=4", "moe.top_k=2")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (2, 8, cfg.model.d_model))
    y, stats = apply(moe, x)
    np.testing.assert_allclose(y, dense_reference(moe, x), rtol=1e-5, atol=1e-5)
    assert float(stats["dropped_frac"]) == 0.0


def test_capacity_formula():
    m = tiny_config("moe.n_experts=8", "moe.top_k=2", "moe.capacity_factor=1.25").moe
    assert capacity(64, m) == 20  # ceil(1.25 * 64 * 2 / 8)
    assert capacity(1, m) == 1  # min 1
    assert capacity(37, tiny_config("moe.capacity_factor=0").moe) == 37  # no drop


def test_assign_slots_hand_case():
    # One group, 1 row, 4 positions, top-2, 3 experts, capacity 2.
    # choices (1st, 2nd):  t0: (0, 1)  t1: (0, 2)  t2: (0, 1)  t3: (1, 0)
    experts = jnp.array([[[0, 1], [0, 2], [0, 1], [1, 0]]])
    slot, keep = assign_slots(experts, n_experts=3, cap=2)
    # Expert 0 queue: 1st choices t0, t1, t2 (in position order), then t3's 2nd choice.
    #   -> t0 slot 0, t1 slot 1, t2 dropped (1st choice!), t3's 2nd dropped.
    # Expert 1 queue: 1st choice t3 first (1st choices before any 2nd), then 2nd choices t0, t2.
    #   -> t3 slot 0, t0's 2nd slot 1, t2's 2nd dropped.
    # Expert 2 queue: t1's 2nd choice -> slot 0.
    C = 2
    expected_slot = [[0 * C + 0, 1 * C + 1], [0 * C + 1, 2 * C + 0], [6, 6], [1 * C + 0, 6]]
    expected_keep = [[True, True], [True, True], [False, False], [True, False]]
    np.testing.assert_array_equal(slot[0], expected_slot)
    np.testing.assert_array_equal(keep[0], expected_keep)


def test_priority_is_time_major_across_rows():
    # 2 rows x 2 positions, all top-1 to expert 0, capacity 2: both rows' position 0 win over
    # row 0's position 1 (sequence order first, then row), so no token sees a later one.
    experts = jnp.zeros((2, 2, 1), jnp.int32)
    _, keep = assign_slots(experts, n_experts=2, cap=2)
    np.testing.assert_array_equal(keep[..., 0], [[True, False], [True, False]])


@pytest.mark.parametrize("factor", [0.0, 1.25])
def test_dropless_keep_is_the_slots_keep_without_their_sort(factor):
    """Dropless (capacity = the group's tokens), `route_group` says every routed assignment
    is kept without the slots' sort, so a program reading `keep` alone (decoding) has none;
    the values are assign_slots' own, padding unrouted. With a capacity the sort stays."""
    from moe_jax.model.routing import route_group

    cfg = tiny_config(f"moe.capacity_factor={factor}", "moe.n_experts=8", "moe.top_k=2").moe
    x = jax.random.normal(jax.random.key(0), (3, 5, 32))
    router = jax.random.normal(jax.random.key(1), (32, 8))
    valid = jnp.arange(5)[None, :] < jnp.array([[5], [2], [0]])
    routing = lambda x: route_group(x, router, jnp.zeros(8), cfg, jnp.float32, valid_bT=valid)
    r = routing(x)
    _, want = assign_slots(r.experts, 8, r.cap, valid)
    np.testing.assert_array_equal(r.keep, want)
    hlo = jax.jit(lambda x: routing(x).keep).lower(x).compile().as_text()
    assert (" sort(" in hlo) == (factor > 0)


def test_dropped_assignment_contributes_exactly_zero():
    cfg = tiny_config("moe.n_experts=2", "moe.top_k=1", "moe.capacity_factor=0.5")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    # Force every token to expert 0: router weight only favours expert 0.
    moe.router[...] = jnp.zeros_like(moe.router[...]).at[:, 0].set(1.0)
    x = jnp.abs(jax.random.normal(jax.random.key(0), (1, 8, cfg.model.d_model)))
    y, stats = apply(moe, x)
    C = capacity(8, cfg.moe)  # ceil(0.5 * 8 * 1 / 2) = 2
    assert C == 2
    ref = dense_reference(moe, x)
    np.testing.assert_allclose(y[0, :C], ref[0, :C], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[0, C:], 0.0)  # dropped: exactly zero, residual carries them
    assert float(stats["dropped_frac"]) == pytest.approx(6 / 8)


def test_top1_drops_are_causal():
    # With top-1 a token's drop depends only on earlier tokens: change the last token and
    # every earlier output is bit-identical, even under heavy dropping.
    cfg = tiny_config("moe.n_experts=4", "moe.top_k=1", "moe.capacity_factor=0.5")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 10, cfg.model.d_model))
    x2 = x.at[:, -1].set(jax.random.normal(jax.random.key(9), (2, cfg.model.d_model)))
    y1, s1 = apply(moe, x)
    y2, _ = apply(moe, x2)
    assert float(s1["dropped_frac"]) > 0
    np.testing.assert_array_equal(y1[:, :-1], y2[:, :-1])


def test_aux_losses_by_hand():
    cfg = tiny_config("moe.n_experts=2", "moe.top_k=1", "moe.score=softmax")
    m = cfg.moe
    logits = jnp.array([[[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]]])  # 3 tokens, 2 experts
    w, e, probs = route(logits, m)
    np.testing.assert_array_equal(e[0, :, 0], [0, 1, 0])
    np.testing.assert_allclose(w[0, :, 0], 1.0)  # renormalised top-1
    # f = (2/3, 1/3); P = mean softmax over tokens.
    p = np.exp(np.array([[2, 0], [0, 1], [3, 1]], np.float64))
    p /= p.sum(-1, keepdims=True)
    P = p.mean(0)
    lb_expected = 2 * (2 / 3 * P[0] + 1 / 3 * P[1])
    z_expected = np.mean(np.log(np.exp([[2, 0], [0, 1], [3, 1]]).sum(-1)) ** 2)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    # Feed logits through the layer: identity-like router on a 2-d subspace.
    D = cfg.model.d_model
    moe.router[...] = jnp.zeros((D, 2)).at[0, 0].set(1.0).at[1, 1].set(1.0)
    x = jnp.zeros((1, 3, D)).at[..., :2].set(logits)
    _, stats = apply(moe, x)
    np.testing.assert_allclose(stats["lb_loss"], lb_expected, rtol=1e-6)
    np.testing.assert_allclose(stats["z_loss"], z_expected, rtol=1e-6)
    np.testing.assert_allclose(stats["expert_load"], [2 / 3, 1 / 3], rtol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_top2_by_hand(score, renormalize):
    """Top-2 of one token's 4 logits, each score/renormalisation pair worked out in NumPy."""
    cfg = tiny_config(f"moe.score={score}", "moe.top_k=2", f"moe.renormalize={renormalize}")
    logits = np.array([1.0, 3.0, -0.5, 2.0])
    w, e, probs = route(jnp.asarray(logits)[None, None], cfg.moe)
    np.testing.assert_array_equal(e[0, 0], [1, 3])  # largest first
    if score == "softmax":
        p = np.exp(logits) / np.exp(logits).sum()
        expected, expected_probs = p[[1, 3]], p
    else:  # Llama 4: sigmoid of the raw logits; the lb loss sees them normalised per token
        s = 1 / (1 + np.exp(-logits))
        expected, expected_probs = s[[1, 3]], s / s.sum()
    if renormalize:
        expected = expected / expected.sum()
    np.testing.assert_allclose(w[0, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(probs[0, 0], expected_probs, rtol=1e-6)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_drop_gradients_equal_dense_reference(name):
    """Every parameter's gradient (router and its bias, all expert weights and biases, the
    shared expert) through the layer's output alone, without the aux losses, so the router
    must learn from the main loss through its routing weights. The reference sums the same
    per-token terms in another order: float32 reassociation over 32 tokens stays within 1e-5
    of a tensor's largest entry (entries that cancel to ~0 keep the error of their terms),
    while a lost or doubled path is off by a whole term."""
    cfg = tiny_config("moe.capacity_factor=0", *VARIANTS[name])
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    randomize(moe, 1)
    x = jax.random.normal(jax.random.key(2), (4, 8, cfg.model.d_model))
    loss = lambda f: lambda m: jnp.sum(jnp.sin(f(m)))
    grads = nnx.jit(nnx.grad(loss(lambda m: m(x)[0])))(moe)
    ref_grads = nnx.jit(nnx.grad(loss(lambda m: dense_reference(m, x))))(moe)
    flat, ref_flat = nnx.to_flat_state(grads), dict(nnx.to_flat_state(ref_grads))
    if not (cfg.moe.top_k == 1 and cfg.moe.renormalize):  # there the weight is always 1
        assert float(jnp.max(jnp.abs(grads.router[...]))) > 1e-3  # the router really learns
    for path, g in flat:
        ref = np.asarray(ref_flat[path][...])
        np.testing.assert_allclose(
            g[...], ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()), err_msg=str(path)
        )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_path_gathers_picked_experts_and_matches_reference(name):
    # B*T*k < E selects the gathered-weights path (used when decoding a few tokens).
    cfg = tiny_config("moe.capacity_factor=0", "moe.n_experts=8", *VARIANTS[name])
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    randomize(moe, 1)
    x = jax.random.normal(jax.random.key(2), (2, 1, cfg.model.d_model))
    assert 2 * cfg.moe.top_k < cfg.moe.n_experts
    # Only the picked experts' weights are read: the jaxpr gathers weight rows, no [E, C, D].
    jaxpr = str(jax.make_jaxpr(lambda x: moe(x)[0])(x))
    m, D = cfg.moe, cfg.model.d_model
    assert f"[8,{capacity(2, m)},{D}]" not in jaxpr  # no expert buffers
    assert f"[2,1,{m.top_k},{D},{m.expert_hidden}]" in jaxpr  # gathered picked-expert weights
    y, _ = apply(moe, x)
    np.testing.assert_allclose(y, dense_reference(moe, x), rtol=1e-5, atol=1e-5)


def test_decode_path_drops_exactly_like_the_buffers():
    # Capacity 1 per expert: two tokens picking the same expert drop the later one's choice in
    # both paths. The buffered path is called directly as the reference.
    cfg = tiny_config("moe.n_experts=8", "moe.top_k=1", "moe.capacity_factor=0.1")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router[...] = jnp.zeros_like(moe.router[...]).at[:, 3].set(1.0)  # everyone -> expert 3
    x = jnp.abs(jax.random.normal(jax.random.key(0), (3, 1, cfg.model.d_model)))
    y, stats = apply(moe, x)  # 3 * 1 * 1 < 8: gathered path
    w, e, _ = route(moe.router_logits(x), cfg.moe)
    cap = capacity(3, cfg.moe)
    slot, keep = assign_slots(e, 8, cap)
    group = Routing(w[None], e[None], slot[None], keep[None], cap, {})  # one routing group
    ref = moe._buffered(x[None], group)[0]
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert float(stats["dropped_frac"]) == pytest.approx(2 / 3)
    np.testing.assert_array_equal(y[1:], 0.0)
