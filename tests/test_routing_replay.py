"""Rollout routing replay (issue 53): the sampler records every token's experts, the training
forward reuses them.

- `route` with replayed experts: the router's own scores at those experts, renormalised as
  configured (numpy reference), gradient only into the chosen experts' logits.
- The model: replaying its own routes changes nothing; replaying others takes them, layer by
  layer in order (dense prefix, scanned or unrolled blocks, tail), -1 routes itself; the
  expert-parallel layer replays as the unsharded one does.
- The issue's test: the sampler's log-probs of its sampled tokens equal the trainer's (fp32,
  1e-5) with replay after the router was changed so that recomputed routing picks another
  expert for every token; without replay they differ.
Budget: ~25 s on 2 CPU cores.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.model.routing import route
from moe_jax.posttrain.rl.rollouts import expert_agreement, rollout_rows, token_logps
from moe_jax.sharding import BATCH_AXES, n_batch_shards
from tests.helpers import tiny_config
from tests.test_sharding import MESHES, moe_pair

# Dense prefix layer 0, two stacked blocks (layers 1-4, MoE at 1 and 3), an MoE tail (5).
LAYOUT = ["attention.nope_interval=0", "model.n_layers=6", "moe.first_dense_layers=1"]
BASE = [*LAYOUT, "moe.capacity_factor=0", "moe.router_bias=true", "model.init_std=0.05"]


def random_routes(key, shape_LBT, E, K) -> jax.Array:
    """K distinct experts per token, drawn at random."""
    return jnp.argsort(jax.random.uniform(key, (*shape_LBT, E)), axis=-1)[..., :K].astype(jnp.int32)


@pytest.mark.parametrize(
    "moe",
    [
        ["moe.score=softmax", "moe.renormalize=true"],
        ["moe.score=softmax", "moe.renormalize=false"],
        ["moe.score=sigmoid", "moe.renormalize=true", "moe.routed_scaling_factor=2.5"],
        ["moe.score=sigmoid", "moe.correction_bias=true", "moe.n_group=2", "moe.topk_group=1"],
    ],
    ids=["softmax_renorm", "softmax", "sigmoid_scaled", "deepseek_groups"],
)
def test_replayed_experts_take_the_routers_scores_at_them(moe):
    m = tiny_config(*moe).moe
    logits = np.random.default_rng(0).normal(size=(5, m.n_experts)).astype(np.float32)
    replay = np.array([[3, 0], [1, 2], [-1, -1], [0, 1], [2, 3]], np.int32)[:, : m.top_k]
    correction = jnp.zeros(m.n_experts).at[0].set(5.0) if m.correction_bias else None
    w, experts, _ = route(jnp.asarray(logits), m, correction, jnp.asarray(replay))
    own = route(jnp.asarray(logits), m, correction)[1]
    want_experts = np.where(replay[:, :1] >= 0, replay, own)
    np.testing.assert_array_equal(experts, want_experts)
    if m.score == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    want = np.take_along_axis(scores, want_experts, -1)
    if m.renormalize:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_allclose(w, want * m.routed_scaling_factor, rtol=1e-6)
    if m.score == "softmax" and m.renormalize:  # a softmax over the chosen logits alone
        c = jnp.arange(1.0, m.top_k + 1)
        g = jax.grad(lambda l: jnp.sum(route(l, m, None, jnp.asarray(replay))[0] * c))(logits)
        chosen = np.zeros_like(logits, bool)
        np.put_along_axis(chosen, want_experts, True, -1)
        # (zero up to rounding: softmax over all E, then divided by the chosen ones' sum)
        assert np.abs(g[~chosen]).max() < 1e-6 and np.abs(g[chosen]).min() > 1e-3


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_model_replays_routes_layer_by_layer(scan):
    cfg = tiny_config(*BASE, f"model.scan_layers={str(scan).lower()}")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert model.moe_layers() == [1, 3, 5] and model.n_blocks == 2 and len(model.tail) == 1
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.model.vocab_size)
    run = nnx.jit(lambda m, t, r: m(t, routes=r))
    logits, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert aux["routes"].shape == (3, 2, 8, cfg.moe.top_k)
    same, same_aux = run(model, tokens, aux["routes"])  # its own routes: nothing changes
    np.testing.assert_array_equal(same, logits)
    np.testing.assert_array_equal(same_aux["routes"], aux["routes"])

    others = random_routes(jax.random.key(2), (3, 2, 8), cfg.moe.n_experts, cfg.moe.top_k)
    others = others.at[:, 1, 5:].set(-1)  # not recorded: those tokens route themselves
    replayed, r_aux = run(model, tokens, others)
    taken = np.asarray(r_aux["routes"])
    np.testing.assert_array_equal(taken[:, :, :5], others[:, :, :5])
    np.testing.assert_array_equal(taken[:, 0], others[:, 0])
    assert np.abs(np.asarray(replayed) - np.asarray(logits)).max() > 1e-3
    # Only layer 5's routes changed: the logits move at every position, but layers 1 and 3
    # take their own routes (checked through the taken routes, which depend on the input).
    last = jnp.asarray(aux["routes"]).at[2].set(others[2])
    _, l_aux = run(model, tokens, last)
    np.testing.assert_array_equal(l_aux["routes"][:2], aux["routes"][:2])
    with pytest.raises(ValueError, match="2 MoE layers' experts, the model has 3"):
        model(tokens, routes=others[:2])


@pytest.mark.parametrize("mesh_name", ["data2_fsdp2_expert2", "data8"])
def test_expert_parallel_layer_replays_as_the_unsharded_one(mesh_name):
    """Replayed experts through the exchange equal the plain layer's, values and gradients
    (the router's included); a one-row batch takes the replicated path."""
    cfg, mesh, ref, sharded = moe_pair(MESHES[mesh_name], "moe.capacity_factor=0")
    m = cfg.moe
    x = jax.random.normal(jax.random.key(1), (8, 4, cfg.model.d_model))
    replay = random_routes(jax.random.key(3), (8, 4), m.n_experts, m.top_k)

    def loss(moe, x, replay, groups):
        y, stats = moe(x, groups, None, replay)
        return jnp.sum(jnp.sin(y)) + stats["lb_loss"], (y, stats["experts"])

    grad_fn = nnx.jit(nnx.value_and_grad(loss, has_aux=True), static_argnums=3)
    (_, (y_ref, e_ref)), g_ref = grad_fn(ref, x, replay, n_batch_shards(mesh))
    np.testing.assert_array_equal(e_ref, replay)
    with jax.set_mesh(mesh):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P(BATCH_AXES)))
        (_, (y_sh, e_sh)), g_sh = grad_fn(sharded, put(x), put(replay), 1)
        y_one, e_one = nnx.jit(lambda m, x, r: m(x, 1, None, r))(sharded, x[:1], replay[:1])
    np.testing.assert_allclose(y_sh, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(e_sh, replay)
    np.testing.assert_allclose(y_one, y_ref[:1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(e_one["experts"], replay[:1])
    assert np.abs(np.asarray(g_ref["router"][...])).max() > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_sh, g_ref)


def test_replay_gives_the_samplers_logprobs_where_recomputed_routing_differs():
    """The issue's test. Sampling with expert 0 out of reach (router bias -30) then training
    with it on top of every token's scores (+30): recomputed routing puts expert 0 in every
    top-k; replayed routing keeps the sampled experts, whose weights (a softmax over the k
    chosen logits) the change leaves alone, so the log-probs agree to float32 rounding."""
    cfg = tiny_config(*BASE, "moe.score=softmax", "moe.renormalize=true")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    moe_layers = [model.blocks.layers[0].ffn, model.tail[0].ffn]

    def set_bias(value):
        for ffn in moe_layers:
            ffn.router_bias[...] = jnp.zeros_like(ffn.router_bias[...]).at[..., 0].set(value)

    set_bias(-30.0)
    prompts = [[5, 9, 14, 3, 7], [11, 2]]
    gen = Sampler(model).generate(prompts, 10, temperature=1.0, seed=3, record=True)
    assert gen.routes.shape == (3, 2, 16 + 10, cfg.moe.top_k)
    assert gen.logprobs.shape == (2, 10)
    # Row 1: its prompt at 0-1, its fed tokens at 2-10; its last token (never fed) and the
    # prompt bucket's padding not recorded.
    assert np.all(gen.routes[:, 1, :11] >= 0) and np.all(gen.routes[:, 1, 11:] == -1)
    assert not np.any(gen.routes == 0)  # expert 0 never chosen while sampling
    rows = rollout_rows(prompts, gen)
    mask, old_logp = rows["mask"][:, 1:], rows["old_logp"][:, 1:]  # the targets'
    logp = nnx.jit(lambda m, t, r: token_logps(m, t, routes=r))
    same, _ = logp(model, rows["tokens"], None)  # same router: no replay needed
    np.testing.assert_allclose(same * mask, old_logp, atol=1e-5)

    set_bias(30.0)
    replayed, r_aux = logp(model, rows["tokens"], rows["routes"])
    recomputed, o_aux = logp(model, rows["tokens"], None)
    np.testing.assert_allclose(replayed * mask, old_logp, atol=1e-5)
    assert np.abs((recomputed - old_logp) * mask).max() > 1e-3
    recorded = jnp.asarray(rows["routes"])[:, :, :-1]
    assert float(expert_agreement(recorded, r_aux["routes"], mask)) == 1.0
    assert float(expert_agreement(recorded, o_aux["routes"], mask)) <= 0.5
    assert np.all(np.any(np.asarray(o_aux["routes"]) == 0, -1)[:, mask > 0])
