"""The grouped-matmul experts (`moe.impl` ragged | megablox, `moe_jax/model/grouped.py`) against
the dense reference and the CPU's capacity buffers (`moe.impl=buckets`), values and gradients,
alone and under expert, tensor and fsdp parallelism (8 simulated CPU devices).

megablox is the TPU Pallas kernel, run here in interpret mode. Tolerances as in test_moe.py:
the paths move the same values and sum the same products in another order (float32), so 1e-5
on O(1) outputs; a misrouted or lost row is off by a whole term (~1e-1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.model import experts, grouped
from moe_jax.model.experts import expert_swiglu
from moe_jax.model.grouped import (
    chunk_plan,
    grouped_buffers,
    grouped_swiglu,
    inverse,
    sort_rows,
)
from moe_jax.model.moe import MoE
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh, n_batch_shards
from tests.helpers import randomize_biases, tiny_config
from tests.test_moe import VARIANTS, apply, dense_reference, randomize

TOL = dict(rtol=1e-5, atol=1e-5)
loss = lambda f: lambda m: jnp.sum(jnp.sin(f(m)))


def assert_grads_equal(grads, ref_grads):
    flat, ref_flat = nnx.to_flat_state(grads), dict(nnx.to_flat_state(ref_grads))
    for path, g in flat:
        ref = np.asarray(ref_flat[path][...])
        np.testing.assert_allclose(
            g[...], ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()), err_msg=str(path)
        )


@pytest.mark.parametrize(
    "impl,name",
    # sigmoid input scaling, top-1 and a shared expert; softmax top-3 with a shared expert and
    # expert biases (softmax top-2 with expert biases is checked, dropping, in the next test,
    # megablox there too); gpt-oss's clamped SwiGLU through the hand-written backward
    [
        ("ragged", "sigmoid_input_shared"),
        ("ragged", "softmax_top3_shared_bias"),
        ("ragged", "clamped_swiglu_top2"),
    ],
)
def test_grouped_no_drop_equals_dense_reference_values_and_gradients(impl, name):
    cfg = tiny_config("moe.capacity_factor=0", f"moe.impl={impl}", *VARIANTS[name])
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    randomize(moe, 1)
    x = jax.random.normal(jax.random.key(2), (4, 8, cfg.model.d_model))
    y, stats = apply(moe, x, 2)
    np.testing.assert_allclose(y, dense_reference(moe, x), **TOL)
    assert float(stats["dropped_frac"]) == 0.0
    grads = nnx.jit(nnx.grad(loss(lambda m: m(x)[0])))(moe)
    assert_grads_equal(grads, nnx.jit(nnx.grad(loss(lambda m: dense_reference(m, x))))(moe))


@pytest.mark.parametrize("impl", ["ragged", "megablox", "batched"])
def test_grouped_drops_exactly_like_the_capacity_buffers(impl):
    """Capacity 0.75 drops assignments: the grouped paths keep the buffers' ranks (choice,
    then position, then row) per routing group, and `batched` runs the same buffers without
    the filled-row buckets, so outputs, aux statistics and gradients equal the buckets
    path's."""
    base = ["moe.capacity_factor=0.75", "moe.n_experts=8", "moe.expert_bias=true"]
    ref = MoE(tiny_config(*base, "moe.impl=buckets"), rngs=nnx.Rngs(0))
    grouped = MoE(tiny_config(*base, f"moe.impl={impl}"), rngs=nnx.Rngs(0))
    randomize(ref, 1)
    randomize(grouped, 1)
    x = jax.random.normal(jax.random.key(2), (4, 16, 32))
    (y, s), (y_ref, s_ref) = apply(grouped, x, 2), apply(ref, x, 2)
    assert float(s_ref["dropped_frac"]) > 0.1  # the case really drops
    np.testing.assert_allclose(y, y_ref, **TOL)
    for k in s_ref:
        np.testing.assert_allclose(s[k], s_ref[k], **TOL)
    grads = nnx.jit(nnx.grad(loss(lambda m: m(x, 2)[0])))
    assert_grads_equal(grads(grouped), grads(ref))


def test_grouped_path_has_no_conditionals_and_no_expert_buffers():
    cfg = tiny_config("moe.capacity_factor=0", "moe.impl=ragged", "moe.n_experts=8")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.zeros((4, 64, cfg.model.d_model))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(moe(x)[0])))(x))
    assert "ragged_dot" in jaxpr and "cond[" not in jaxpr
    assert f"[8,{4 * 64},{cfg.model.d_model}]" not in jaxpr  # no dropless [E, C, D] buffer


def test_sort_rows_and_grouped_buffers_by_hand():
    order, sizes = sort_rows(jnp.array([2, 0, 2, 1, 0]), jnp.array([1, 1, 1, 0, 1], bool), 3)
    np.testing.assert_array_equal(order, [1, 4, 0, 2, 3])  # stable; the dropped row last
    np.testing.assert_array_equal(sizes, [2, 0, 2])
    np.testing.assert_array_equal(inverse(order)[order], np.arange(5))
    # Filled rows of capacity buffers equal the per-expert SwiGLU; empty slots are zero.
    E, S, C, D, F = 3, 2, 4, 8, 16
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (E, S, C, D))
    w = {
        "w_gate": jax.random.normal(keys[1], (E, D, F)),
        "w_up": jax.random.normal(keys[2], (E, D, F)),
        "w_down": jax.random.normal(keys[3], (E, F, D)),
    }
    filled = jnp.array([[4, 0], [1, 3], [2, 2]])
    y = grouped_buffers(x, w, jnp.float32, filled, "ragged")
    ref = expert_swiglu(x, w, jnp.float32)  # every slot, batched
    mask = (jnp.arange(C)[None, None, :] < filled[:, :, None])[..., None]
    np.testing.assert_allclose(y, jnp.where(mask, ref, 0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tile", [4, 7, 64])  # many segments, windows clamped, n < tile
def test_hand_written_weight_gradients_equal_ragged_dots_autodiff(tile, monkeypatch):
    """Both weight gradients of `ragged_hand_grad`, the groups padded to max_group and the
    loop over segments, and the rows' gradient, equal jax's autodiff of ragged_dot: 37 rows
    in 5 groups (one empty, one spanning several tiles), 3 rows past the groups."""
    monkeypatch.setattr(grouped, "WGRAD_TILE", tile)
    keys = jax.random.split(jax.random.key(0), 3)
    n, K, N = 37, 6, 5
    sizes = jnp.array([3, 0, 17, 1, 13], jnp.int32)
    x = jax.random.normal(keys[0], (n, K))
    w = jax.random.normal(keys[1], (5, K, N))
    dy = jax.random.normal(keys[2], (n, N))
    ref_dx, ref_dw = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](dy)
    # padded: 5 x 17 rows; the segments' windows: (ceil(37 / tile) + 5 + 1) x min(tile, 37)
    plan = {4: "tiled", 7: "tiled", 64: "padded"}[tile]  # 64, 84 and 259 rows against 85
    assert grouped.weight_grad_plan(n, 5, 17) == plan
    assert grouped.weight_grad_plan(n, 5, None) == "tiled"
    for max_group in (17, None):
        f = lambda x, w, m=max_group: grouped.ragged_hand_grad(x, w, sizes, m)
        dx, dw = jax.vjp(f, x, w)[1](dy)
        np.testing.assert_allclose(dx, ref_dx, **TOL)
        np.testing.assert_allclose(dw, ref_dw, **TOL)
    np.testing.assert_allclose(grouped.padded_weight_grad(x, dy, sizes, 17), ref_dw, **TOL)
    np.testing.assert_allclose(grouped.tiled_weight_grad(x, dy, sizes), ref_dw, **TOL)


@pytest.mark.parametrize("bounded", [False, True])
def test_row_chunks_equal_one_grouped_matmul_values_and_gradients(bounded):
    """moe.row_chunks: the sorted rows run in 2 to 5 windows give the unchunked values and
    gradients (rows, weights, biases). 37 rows, some dropped (past the groups): cut by rows
    (3, 5 chunks, or no bound on the groups: the last window padded, groups cut at window
    boundaries) and, with each expert's rows bounded, by experts (2, 4 chunks of 4 experts,
    windows of e x max_group rows, which overlap the next expert's rows)."""
    keys = jax.random.split(jax.random.key(0), 6)
    n, D, F, E = 37, 16, 24, 4
    expert = jax.random.randint(keys[0], (n,), 0, E)
    order, sizes = sort_rows(expert, jax.random.uniform(keys[1], (n,)) > 0.2, E)
    max_group = int(sizes.max()) if bounded else None
    x = jax.random.normal(keys[2], (n, D))[order]
    w = {
        "w_gate": jax.random.normal(keys[3], (E, D, F)) * 0.2,
        "w_up": jax.random.normal(keys[4], (E, D, F)) * 0.2,
        "w_down": jax.random.normal(keys[5], (E, F, D)) * 0.2,
        "gate_bias": jnp.linspace(-0.2, 0.2, E * F).reshape(E, F),
        "up_bias": jnp.linspace(0.3, -0.1, E * F).reshape(E, F),
    }

    def run(chunks):
        f = lambda x, w: grouped_swiglu(
            x, w, sizes, expert[order], jnp.float32, "ragged", max_group, chunks
        )
        out = jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))
        return f(x, w), out(x, w)[1], str(jax.make_jaxpr(f)(x, w))

    y_ref, g_ref, jaxpr = run(1)
    assert "scan[" not in jaxpr
    for chunks in (2, 3, 4, 5):
        plan = chunk_plan(n, E, chunks, max_group)
        assert (plan.experts < E) == (bounded and chunks in (2, 4))
        assert plan.count * plan.rows >= n
        y, g, jaxpr = run(chunks)
        assert "scan[" in jaxpr  # chunked, not the one-matmul path
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), (y, g), (y_ref, g_ref))


MOE_EP = ["moe.n_experts=8", "model.d_model=32", "moe.expert_hidden=16", "train.batch_size=8"]
# fsdp, expert and tensor at once: the all_to_all, the gathered weights and the tensor
# shards' partial sums (whose cotangent typing the grouped backward must keep)
EP_MESHES = {"fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]}


@pytest.mark.parametrize("mesh_name", list(EP_MESHES))
def test_grouped_expert_parallel_equals_unsharded_buckets(mesh_name, monkeypatch):
    """Under the mesh, the expert-parallel path's received buffers run as one grouped matmul
    over their filled rows (training-size buffers forced on these small ones): values, aux
    statistics and gradients equal the unsharded capacity path routing the same groups."""
    monkeypatch.setattr(experts, "MAP_MIN_CAPACITY", 1)
    base = MOE_EP
    extra = ["moe.capacity_factor=0.75", "moe.expert_bias=true"]
    cfg = tiny_config(*base, *extra, *EP_MESHES[mesh_name], "moe.impl=ragged")
    mesh = make_mesh(cfg)
    ref = MoE(tiny_config(*base, *extra, "moe.impl=buckets"), rngs=nnx.Rngs(0))
    sharded = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), mesh)
    randomize_biases(ref)
    randomize_biases(sharded)
    x = jax.random.normal(jax.random.key(1), (8, 4, 32))

    def loss_fn(m, x, n_groups):
        y, stats = m(x, n_groups=n_groups)
        return jnp.sum(jnp.sin(y)) + stats["lb_loss"], (y, stats)

    grad_fn = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True), static_argnums=2)
    (_, (y_ref, s_ref)), g_ref = grad_fn(ref, x, n_batch_shards(mesh))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        jaxpr = str(jax.make_jaxpr(lambda x: sharded(x)[0])(xs))
        (_, (y, s)), g = grad_fn(sharded, xs, 1)
    assert "ragged_dot" in jaxpr and "cond[" not in jaxpr
    assert float(s_ref["dropped_frac"]) > 0
    np.testing.assert_allclose(y, y_ref, **TOL)
    for k in s_ref:
        np.testing.assert_allclose(s[k], s_ref[k], **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), g, g_ref)


def test_megablox_under_a_mesh_is_refused_in_one_line():
    cfg = tiny_config(*MOE_EP, "mesh.expert=8", "moe.impl=megablox")
    mesh = make_mesh(cfg)
    moe = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), mesh)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="moe.impl=megablox runs without"):
        jax.eval_shape(lambda x: moe(x)[0], jnp.zeros((8, 4, 32)))
