"""The expert-parallel ragged exchange (`exchange.ragged_exchange`: only the routed rows move,
by `ragged_all_to_all`) against the unsharded layer and the fixed-buffer `all_to_all` path,
values and gradients, on 8 simulated CPU devices; and compiled for a TPU slice and GPUs.

XLA:CPU has no ragged-all-to-all, so here the layer runs on `tests/ragged_stand_in.py`, the
collective's documented semantics (checked in test_ragged_stand_in.py); the real collective is
checked by the accelerator compiles.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.aot import command as aot
from moe_jax.model import weight_gather
from moe_jax.model.moe import MoE
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh, n_batch_shards
from tests.helpers import randomize_biases, tiny_config

# float32 throughout (the suite's matmul precision is "highest"): the paths move the same
# values and sum the same products, only in another order, so they agree to ~1e-6 relative on
# O(1) outputs; a row sent to the wrong expert or lost is off by a whole term (~1e-1).
TOL = dict(rtol=1e-5, atol=1e-5)


MOE_EP = [
    "moe.n_experts=8",
    "model.d_model=32",
    "moe.expert_hidden=16",
    "train.batch_size=8",
    "moe.impl=ragged",
    "moe.expert_bias=true",
]
MESHES = {
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    "expert4_data2": ["mesh.expert=4", "mesh.data=2"],
    "fsdp4_data2": ["mesh.fsdp=4", "mesh.data=2"],
}
CASES = [  # (mesh, capacity factor, route scale, top_k, moe.row_chunks, mesh.gather_group)
    ("fsdp2_expert2_tensor2", 0, "output", 2, 1, 0),
    ("fsdp2_expert2_tensor2", 0.75, "input", 2, 3, 0),  # the received rows in 3 row windows
    ("expert4_data2", 0.75, "output", 2, 2, 0),  # 2 windows of one local expert each
    ("expert4_data2", 0, "input", 3, 1, 0),  # top-3 over 2 local experts: min(k, E_loc) binds
    # windows of 2 experts each, gathering their own experts' weights: over fsdp 2 x expert
    # 2, and over fsdp 4 (every expert local) in two steps of 2
    ("fsdp2_expert2_tensor2", 0.75, "output", 2, 2, 0),
    ("fsdp4_data2", 1.0, "input", 2, 4, 2),
    # dropless: the tokens through the exchange in 2 checkpointed slices (chunked_exchange)
    ("fsdp2_expert2_tensor2", 0, "output", 2, 2, 0),
]


def _loss_fn(m, x, n_groups):
    y, stats = m(x, n_groups=n_groups)
    return jnp.sum(jnp.sin(y)) + stats["lb_loss"], (y, stats)


def _grads(m, x, n_groups=1):
    """((loss, (y, stats)), (parameter grads, input grad)), traced afresh: one jitted
    function for every path would take its cached trace for another path's module."""
    f = nnx.value_and_grad(_loss_fn, argnums=(0, 1), has_aux=True)
    return nnx.jit(f, static_argnums=2)(m, x, n_groups)


def _sharded(cfg, mesh, x):
    """The sharded layer's forward jaxpr, and its values and gradients."""
    moe = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), mesh)
    randomize_biases(moe)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        return str(jax.make_jaxpr(lambda x: moe(x)[0])(xs)), _grads(moe, xs)


def assert_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TOL), a, b)


@pytest.mark.parametrize("mesh_name, cf, scale, k, chunks, group", CASES)
def test_ragged_exchange_equals_unsharded_and_fixed_buffers(
    mesh_name, cf, scale, k, chunks, group, ragged_on_cpu, monkeypatch
):
    """Values, aux statistics and gradients (parameters and input) of the ragged exchange
    equal the unsharded layer routing the same groups and the fixed-buffer all_to_all (run
    as one grouped matmul too, its buffers forced to the training size). Windows cut by
    experts (E_loc divisible by their count) gather only their own experts' weights, so no
    gather makes all the local experts' weights whole."""
    over = [*MOE_EP, f"moe.capacity_factor={cf}", f"moe.route_scale={scale}", f"moe.top_k={k}"]
    cfg = tiny_config(*over, *MESHES[mesh_name], f"moe.row_chunks={chunks}")
    mesh = make_mesh(cfg)
    x = jax.random.normal(jax.random.key(1), (8, 4, 32))

    ref = MoE(tiny_config(*over), rngs=nnx.Rngs(0))
    randomize_biases(ref)
    (_, (y_ref, s_ref)), g_ref = _grads(ref, x, n_batch_shards(mesh))
    if cf > 0:
        assert float(s_ref["dropped_frac"]) > 0.1  # the case really drops

    with weight_gather.gathering("steps" if group else "partitioner", group):
        jaxpr, ((_, (y, s)), g) = _sharded(cfg, mesh, x)
    # The exchange's 2 small all_to_alls of offsets (none without an expert axis); the rows
    # went by the stand-in
    ep = mesh.shape["expert"]
    assert jaxpr.count("all_to_all[") == (2 if ep > 1 else 0)
    assert "ragged_dot" in jaxpr and "cond[" not in jaxpr
    assert ("scan[" in jaxpr) == (chunks > 1)
    # dropless, the exchange's slices are checkpointed (the backward runs each again)
    assert ("checkpoint[" in jaxpr or "remat" in jaxpr) == (chunks > 1 and cf == 0)
    # the expert weights, gathered whole: [E_loc, 32, 16 / tensor] / [E_loc, 16 / tensor, 32]
    E_loc, F = 8 // ep, 16 // mesh.shape["tensor"]
    whole = re.search(rf"\[{E_loc},(32,{F}|{F},32)\](\{{.*?\}})? = all_gather", jaxpr)
    if mesh.shape["fsdp"] > 1:  # (no fsdp: nothing to gather)
        assert (whole is None) == (chunks > 1 and E_loc % chunks == 0 and cf > 0)
    if group:  # two steps of `group` devices each
        assert "axis_index_groups=((0, 2), (1, 3))" in jaxpr.replace("[", "(").replace("]", ")")
    assert_close((y, s), (y_ref, s_ref))
    assert_close(g, g_ref)

    monkeypatch.setitem(backends.EXCHANGE, "cpu", "buffers")
    jaxpr, ((_, (y_buf, _)), g_buf) = _sharded(cfg, mesh, x)
    # tokens and filled counts there, results back
    assert jaxpr.count("all_to_all[") == (3 if ep > 1 else 0)
    assert_close(y, y_buf)
    assert_close(g, g_buf)


def test_exchange_choice_by_backend():
    assert backends.exchange("ragged") == "buffers"  # XLA:CPU: no ragged-all-to-all
    assert backends.exchange("buckets") == "buffers"
    for platform in ("tpu", "gpu"):
        with backends.targeting(platform):
            assert backends.exchange("ragged") == "ragged"
            assert backends.exchange("batched") == "buffers"  # its rows need the buffers
            assert backends.exchange("ragged", "buffers") == "buffers"
    with pytest.raises(
        ValueError, match="needs moe.impl=ragged .or mosaic. on gpu or tpu, not ragged on cpu"
    ):
        backends.exchange("ragged", "ragged")


@pytest.mark.parametrize("name", ["v5p-8", "h100:1x4"])
def test_expert_parallel_train_step_compiles_with_ragged_all_to_all(name):
    """The real collective, compiled for the accelerators: a tiny expert-parallel train step
    (one dropless MoE layer) sends its rows by ragged-all-to-all (forward: there
    and back; backward: the transposes), with no conditional anywhere, and its extra rounds
    in two loops that the report counts at none."""
    pytest.importorskip("libtpu", reason="the `aot` extra (libtpu) is not installed")
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the `aot` extra is not installed")
    from moe_jax.aot.topology import get_topology

    over = ["model.n_layers=1", "moe.interleave_step=1", "mesh.data=2", "mesh.expert=2"]
    cfg = tiny_config(*over, "moe.impl=ragged", "moe.capacity_factor=0")
    # the accelerators' kernels compile at the default precision (see tests/test_aot.py)
    with jax.default_matmul_precision("default"):
        r = aot.compile_step(cfg, get_topology(name), "train")
    assert r["collectives"]["ragged-all-to-all"]["count"] >= 4
    assert r["conditionals"] == 0
    # the extra rounds' loops (forward, backward), counted at none: the FLOPs are one round's
    assert r["exchange_round_loops"] == 2 and r["loops_of_unknown_trip_count"] == 0
