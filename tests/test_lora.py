"""LoRA (moe_jax/posttrain/lora.py): adapters that start at the base, the routed experts' adapters
against a dense per-expert loop (values and gradients, on every expert path), merging, and
a train step that moves the adapters alone.

Tolerances: float32; the expert paths and the loop sum the same terms in other orders
(1e-5 of a tensor's largest entry, as tests/test_moe.py), while a lost or misplaced
adapter term is off by a whole term (B is drawn at 0.3, its terms ~1e-1).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model import Transformer
from moe_jax.model.lora import PREFIX
from moe_jax.model.moe import MoE
from moe_jax.posttrain import lora as lora_params
from moe_jax.train.step import init_state, make_optimizer, make_train_step
from tests.helpers import forward, one_expert_at_a_time, tiny_config
from tests.test_moe import reference_weights

ALL = "lora.targets=[attention,mlp,shared,experts]"
LORA = ("lora.rank=4", "lora.alpha=8", ALL, "lora.base_dtype=float32")


def draw_b(module: nnx.Module, seed: int = 1) -> None:
    """Every adapter's B drawn (they start at 0, where a lost term goes unseen)."""
    key = jax.random.key(seed)
    for path, p in nnx.iter_graph(module):
        if isinstance(p, nnx.Param) and path[-1] == "b" and str(path[-2]).startswith(PREFIX):
            key, sub = jax.random.split(key)
            p[...] = jax.random.normal(sub, p[...].shape) * 0.3


def base_config(cfg):
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0))


def base_of(model: Transformer, cfg) -> Transformer:
    """The base model (no adapters) holding `model`'s base params."""
    base_cfg = base_config(cfg)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(base_cfg, rngs=nnx.Rngs(0))))
    params = nnx.state(model, nnx.Param)
    kept = [(p, v.copy()) for p, v in nnx.to_flat_state(params) if not lora_params.is_adapter(p)]
    return nnx.merge(graphdef, nnx.from_flat_state(kept))


def tokens(B=2, T=16, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, 256)


MLA = ("attention.kind=mla", "attention.qk_norm=none", "attention.nope_interval=0",
       "attention.q_lora_rank=12", "attention.kv_lora_rank=16", "attention.qk_nope_head_dim=8",
       "attention.qk_rope_head_dim=8", "attention.v_head_dim=6")  # fmt: skip


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_zero_b_equals_base_and_merged_equals_adapted(attention):
    """Fresh adapters (B = 0) leave the model its base; with B drawn the adapted model
    equals its base with the adapters merged in (`merge_into_base`), and differs from the
    base by more than rounding. MLA: wq_a, wq_b, wkv_a and wo adapted."""
    extra = MLA if attention == "mla" else ()
    cfg = tiny_config(*LORA, "moe.shared_expert_hidden=16", "moe.capacity_factor=0", *extra)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    x = tokens()
    base = base_of(model, cfg)
    np.testing.assert_array_equal(forward(model, x)[0], forward(base, x)[0])

    draw_b(model)
    adapted = forward(model, x)[0]
    assert float(jnp.max(jnp.abs(adapted - forward(base, x)[0]))) > 1e-2
    scale = cfg.lora.alpha / cfg.lora.rank
    merged = lora_params.merge_into_base(nnx.state(model, nnx.Param), scale)
    nnx.update(base, merged)
    np.testing.assert_allclose(forward(base, x)[0], adapted, rtol=1e-5, atol=1e-5)


@nnx.jit
def per_expert_loop(moe: MoE, x_BTD: jax.Array) -> jax.Array:
    """Every expert on every token, weighted by the router, each projection x W_e plus its
    own adapter's (alpha / r) (x A_e) B_e, unmerged."""
    m, ex = moe.cfg, moe.experts
    w_BTE = reference_weights(x_BTD @ moe.router[...], m)

    def proj(name, x, e):
        ad = getattr(ex, PREFIX + name)
        w = getattr(ex, name)[...][e]
        return x @ w + ad.scale * ((x @ ad.a[...][e]) @ ad.b[...][e])

    out = jnp.zeros_like(x_BTD)
    for e in range(m.n_experts):
        h = jax.nn.silu(proj("w_gate", x_BTD, e)) * proj("w_up", x_BTD, e)
        out = out + proj("w_down", h, e) * w_BTE[..., e : e + 1]
    return out


@pytest.mark.parametrize(
    "path", ["buffers", "buckets", "ragged", "decode"]
)  # fmt: skip
def test_expert_adapters_equal_a_per_expert_loop(path, monkeypatch):
    """The routed experts' stacked adapters, merged into their weights, against each
    expert's own unmerged pair: values and the gradients of every parameter (A, B, the base
    weights, the router), on each expert path."""
    impl = "ragged" if path == "ragged" else "buckets"
    cfg = tiny_config(
        "lora.rank=3", "lora.targets=[experts]", "lora.base_dtype=float32",
        "moe.capacity_factor=0", "moe.n_experts=8" if path == "decode" else "moe.n_experts=4",
        f"moe.impl={impl}",
    )  # fmt: skip
    if path == "buckets":
        one_expert_at_a_time(monkeypatch, unrolled=False)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    draw_b(moe)
    shape = (2, 1, cfg.model.d_model) if path == "decode" else (4, 8, cfg.model.d_model)
    x = jax.random.normal(jax.random.key(2), shape)
    np.testing.assert_allclose(moe(x)[0], per_expert_loop(moe, x), rtol=1e-5, atol=1e-5)

    loss = lambda f: lambda m: jnp.sum(jnp.sin(f(m)))
    grads = nnx.jit(nnx.grad(loss(lambda m: m(x)[0])))(moe)
    ref = dict(nnx.to_flat_state(nnx.jit(nnx.grad(loss(lambda m: per_expert_loop(m, x))))(moe)))
    flat = nnx.to_flat_state(grads)
    assert any(p[-2] == PREFIX + "w_down" and p[-1] == "a" for p, _ in flat)
    for p, g in flat:
        if p[-1] == "seed":
            continue
        r = np.asarray(ref[p][...])
        np.testing.assert_allclose(
            g[...], r, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(r).max()), err_msg=str(p)
        )


def test_a_train_step_moves_the_adapters_alone():
    """Only the adapters' A and B change in a step (the frozen base, norms, router and the
    adapters' seeds are bit-identical), the optimizer holds state for A and B alone, and the
    base's matmul weights are stored in lora.base_dtype."""
    cfg = tiny_config(
        "lora.rank=4", ALL, "moe.shared_expert_hidden=16", "train.batch_size=2", "model.n_layers=2",
        "train.seq_len=16", "lora.dropout=0", "train.lr=1e-2",
    )  # fmt: skip
    from moe_jax.summary.counts import param_counts

    total = param_counts(cfg)[0]  # the summary counts A and B (not the seeds) in their layers
    n_pairs = sum(a.size for p, a in nnx.to_flat_state(nnx.state(
        nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param))
        if lora_params.is_trained(p))  # fmt: skip
    assert total == param_counts(base_config(cfg))[0] + n_pairs
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx)
    before = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state["params"])}
    for p, a in before.items():
        if not lora_params.is_adapter(p) and a.ndim >= 2:
            assert a.dtype == jnp.bfloat16, p
    n_trained = sum(lora_params.is_trained(p) for p in before)
    adam_mu = state["opt_state"][1][0].mu  # chain(clip, adamw(scale_by_adam, ...))
    assert len(jax.tree.leaves(adam_mu)) == n_trained
    # B = 0 at the start: a step must move B first (A's gradient is 0 until B moves)
    step = make_train_step(cfg, graphdef, tx)
    batch = tokens(2, 17, seed=3)
    for _ in range(2):
        state, metrics = step(state, batch)
    after = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state["params"])}
    for p in before:
        if lora_params.is_trained(p):
            assert not np.array_equal(before[p], after[p]), p
        else:
            np.testing.assert_array_equal(before[p], after[p], err_msg=str(p))


def test_dropout_masks_the_adapters_input_in_training_steps_only():
    """lora.dropout: inside `dropping` the adapter term changes with the key and is the same
    again for the same key; outside it (eval, sampling) there is none; the base term never
    changes."""
    from moe_jax.model import lora as adapters

    cfg = tiny_config("lora.rank=4", "lora.targets=[mlp]", "moe.n_experts=0")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    draw_b(model)
    x = tokens()

    @partial(jax.jit, static_argnums=1)
    def logits(key, rate):
        with adapters.dropping(key, rate):
            return model(x)[0]

    k1, k2 = jax.random.key(1), jax.random.key(2)
    plain = forward(model, x)[0]
    np.testing.assert_allclose(logits(k1, 0.0), plain, rtol=0, atol=1e-5)  # other programs
    a, b = logits(k1, 0.5), logits(k2, 0.5)
    assert float(jnp.max(jnp.abs(a - plain))) > 1e-3 and float(jnp.max(jnp.abs(a - b))) > 1e-3
    np.testing.assert_array_equal(logits(k1, 0.5), a)


def test_adapters_are_sharded_like_their_weights():
    """On a mesh (fsdp x expert x tensor), A's input dims are laid out as its weight's
    input dims and B's output dims as its weight's output dims; the rank dim is whole."""
    from moe_jax.sharding import make_mesh

    mesh_keys = ("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    cfg = tiny_config(*LORA, *mesh_keys, "moe.shared_expert_hidden=16")
    _, state = init_state(cfg, make_optimizer(cfg.train), abstract=True, mesh=make_mesh(cfg))
    flat = {p: v.get_raw_value().sharding.spec for p, v in nnx.to_flat_state(state["params"])}
    n_in = {"wo": 2}
    checked = 0
    for p, spec in flat.items():
        if p[-1] != "a":
            continue
        w = p[:-2] + (p[-2][len(PREFIX) :],)
        w_spec, b_spec = tuple(flat[w]), tuple(flat[p[:-1] + ("b",)])
        lead = 2 if "experts" in p else 1  # the layer stack, the experts
        k = lead + n_in.get(w[-1], 1)
        assert tuple(spec)[:k] == w_spec[:k] and tuple(spec)[k:] in ((), (None,)), (p, spec)
        assert b_spec[:lead] == w_spec[:lead] and b_spec[lead + 1 :] == w_spec[k:], (p, b_spec)
        checked += any(w_spec)  # a weight split over some mesh axis
    assert checked >= 10


# no capacity drops: a shard's routing group is not the whole batch's
SAME_ROUTING = ("moe.shared_expert_hidden=16", "moe.capacity_factor=0")


def test_sharded_lora_gradients_equal_the_unsharded_ones():
    """The adapters' gradients (every target, B drawn; the routed experts' merged weights
    inside the expert exchange) on an fsdp x expert x tensor mesh equal them on one device,
    and so does the loss: within float reassociation (1e-5 of a tensor's largest entry)."""
    from moe_jax.sharding import batch_sharding, make_mesh
    from moe_jax.train.step import compute_grads

    x = tokens(8, 17, seed=5)

    def grads(*mesh_keys):
        cfg = tiny_config(*LORA, *SAME_ROUTING, "model.n_layers=2", *mesh_keys)
        mesh = make_mesh(cfg)
        graphdef, state = init_state(cfg, make_optimizer(cfg.train), mesh=mesh)
        drawn = []
        for i, (p, v) in enumerate(nnx.to_flat_state(state["params"])):
            if p[-1] == "b":  # the same values on both sides, laid out as B is
                b = jax.random.normal(jax.random.key(i), v.shape) * 0.3
                v = v.replace(jax.device_put(b, v[...].sharding))
            drawn.append((p, v))
        with jax.set_mesh(mesh):
            g, m = jax.jit(compute_grads, static_argnums=(1, 3))(
                nnx.from_flat_state(drawn), graphdef, jax.device_put(x, batch_sharding(mesh)),
                cfg.train,
            )  # fmt: skip
        return float(m["loss"]), {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(g)}

    want_loss, want = grads()
    got_loss, got = grads("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert want.keys() == got.keys() and all(lora_params.is_trained(p) for p in want)
    for p, w in want.items():
        atol = 1e-5 * max(1e-3, float(np.abs(w).max()))
        np.testing.assert_allclose(got[p], w, rtol=1e-4, atol=atol, err_msg=str(p))
