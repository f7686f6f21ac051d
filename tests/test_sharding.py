"""Expert parallelism and logical sharding on 8 simulated CPU devices.

The sharded MoE layer must equal the unsharded layer that routes the same groups (one group
per batch shard). Float32; the sharded run sums the same products in a different order (psum
over tensor shards, per-shard buffers), so 1e-5 absolute on O(1) values.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import ConfigError
from moe_jax.model.moe import MoE
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh, n_batch_shards
from tests.helpers import one_expert_at_a_time, randomize_biases, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)

MESHES = {
    "one_device": [],  # all axes 1: the expert-parallel path on one device
    "data8": ["mesh.data=8"],  # replicated experts, no all_to_all
    "expert8": ["mesh.expert=8"],
    "data2_expert4": ["mesh.data=2", "mesh.expert=4"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    "data2_fsdp2_expert2": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
}
MOE = ["moe.n_experts=8", "model.d_model=32", "moe.expert_hidden=16", "train.batch_size=8"]
# Every variant on every mesh but data2_expert4, whose data x expert split data2_fsdp2_expert2
# has too (tests/test_sharded_sampling.py runs the whole model on data 2 x expert 4).
EQUALITY_MESHES = [m for m in MESHES if m != "data2_expert4"]


def moe_pair(mesh_overrides, *extra):
    """The same MoE layer (same seed) unsharded and created sharded under the mesh."""
    cfg = tiny_config(*MOE, *mesh_overrides, *extra)
    mesh = make_mesh(cfg)
    ref = MoE(cfg, rngs=nnx.Rngs(0))
    sharded = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), mesh)
    randomize_biases(ref)
    randomize_biases(sharded)
    return cfg, mesh, ref, sharded


def loss_fn(moe, x, n_groups=1):
    y, stats = moe(x, n_groups=n_groups)
    extra = stats.get("seq_lb_loss", 0.0)  # DeepSeek's sequence-wise loss, where it is on
    return jnp.sum(jnp.sin(y)) + stats["lb_loss"] + stats["z_loss"] + extra, (y, stats)


@pytest.mark.parametrize("mesh_name", EQUALITY_MESHES)
@pytest.mark.parametrize(
    "variant",
    [
        ["moe.capacity_factor=0"],  # nothing dropped: equals the plain layer
        ["moe.capacity_factor=0.75"],  # drops: equals the layer routing the same groups
        [
            "moe.score=sigmoid",
            "moe.top_k=1",
            "moe.route_scale=input",
            "moe.shared_expert_hidden=16",
            "moe.expert_bias=true",
            "moe.router_bias=true",
            "moe.capacity_factor=1.0",
        ],
        [  # DeepSeek-V3's routing: groups, the choice's bias, scaling, the sequence loss
            "moe.score=sigmoid",
            "moe.top_k=3",
            "moe.n_group=4",
            "moe.topk_group=2",
            "moe.correction_bias=true",
            "moe.routed_scaling_factor=2.5",
            "moe.shared_expert_hidden=16",
            "moe.seq_aux_loss_weight=0.001",
            "moe.capacity_factor=0",
        ],
    ],
    ids=["nodrop", "drops", "llama4_bias", "deepseek"],
)
def test_expert_parallel_equals_unsharded(mesh_name, variant):
    cfg, mesh, ref, sharded = moe_pair(MESHES[mesh_name], *variant)
    x = jax.random.normal(jax.random.key(1), (8, 4, cfg.model.d_model))
    groups = n_batch_shards(mesh)

    grad_fn = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True), static_argnums=2)
    (l_ref, (y_ref, s_ref)), g_ref = grad_fn(ref, x, groups)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        (l_sh, (y_sh, s_sh)), g_sh = grad_fn(sharded, xs, 1)

    np.testing.assert_allclose(y_sh, y_ref, **TOL)
    np.testing.assert_allclose(l_sh, l_ref, **TOL)
    for k in s_ref:
        np.testing.assert_allclose(s_sh[k], s_ref[k], **TOL)
    if "moe.capacity_factor=0.75" in variant:
        assert float(s_ref["dropped_frac"]) > 0  # the case really drops
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), g_sh, g_ref)


@pytest.mark.parametrize("mesh_name", ["one_device", "data8", "fsdp2_expert2_tensor2"])
def test_decoding_reads_only_the_picked_experts_where_all_are_local(mesh_name):
    """A few tokens whose rows the batch axes split: where every expert is on each device
    (no expert axis), the layer gathers the picked experts' weights instead of running all
    E experts' buffers (which held a float32 product of every expert weight, a layer's whole
    experts, in gpt-oss-20b's batch-1 decode); with an expert axis the buffers stay. Either
    way the unsharded layer's outputs."""
    cfg, mesh, ref, sharded = moe_pair(MESHES[mesh_name], "moe.capacity_factor=0")
    x = jax.random.normal(jax.random.key(1), (8, 1, cfg.model.d_model))  # 8 x 1 x 2 > E = 8
    x = x[:2] if mesh_name == "one_device" else x  # 2 x 1 x 2 < 8: few tokens per device
    want = nnx.jit(lambda m, x: m(x)[0])(ref, x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        got = nnx.jit(lambda m, x: m(x)[0])(sharded, xs)
        jaxpr = str(jax.make_jaxpr(lambda x: sharded(x)[0])(xs))
    np.testing.assert_allclose(got, want, **TOL)
    m = cfg.moe
    local_rows = x.shape[0] // n_batch_shards(mesh)
    gathered = f"[{local_rows},1,{m.top_k},{cfg.model.d_model},"
    assert (gathered in jaxpr) == (mesh_name != "fsdp2_expert2_tensor2")


@pytest.mark.parametrize("unrolled", [True, False], ids=["unrolled", "lax_map"])
def test_expert_parallel_training_sizes_equal_unsharded(monkeypatch, unrolled):
    """The per-expert path of training-size buffers (forced on these small ones), unrolled or
    mapped, under expert and tensor parallelism. It used to fail: its hand-written backward
    returned the input's cotangent as a per-tensor-shard partial sum, typed unlike the input."""
    one_expert_at_a_time(monkeypatch, unrolled)
    test_expert_parallel_equals_unsharded("fsdp2_expert2_tensor2", ["moe.capacity_factor=0.75"])


def compiled_hlo(mesh_overrides, *extra, grad=False):
    """The compiled MoE forward (or the gradient of its summed output) on the mesh, as text."""
    cfg, mesh, _, sharded = moe_pair(mesh_overrides, *extra)
    x = jnp.zeros((8, 4, cfg.model.d_model))
    graphdef, state = nnx.split(sharded)

    def fwd(state, x):
        return nnx.merge(graphdef, state)(x)[0]

    fn = jax.grad(lambda state, x: jnp.sum(fwd(state, x))) if grad else fwd
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        return jax.jit(fn).lower(state, xs).compile().as_text()


def loop_computations(hlo: str) -> str:
    """The text of every computation that runs inside a while loop (bodies and their callees)."""
    comps = {
        m.group(1): m.group(0) for m in re.finditer(r"^(?:ENTRY )?%(\S+) .*?^}", hlo, re.M | re.S)
    }
    todo = re.findall(r"while\(.*?body=%([\w.\-]+)", hlo)
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in comps:
            seen.add(name)
            todo += re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", comps[name])
    return "\n".join(comps[n] for n in seen)


@pytest.mark.parametrize("mesh_name", ["expert8", "fsdp2_expert2_tensor2"])
def test_hlo_has_two_all_to_alls_and_never_gathers_expert_weights(mesh_name):
    hlo = compiled_hlo(MESHES[mesh_name], "moe.capacity_factor=1.25")
    assert len(re.findall(r"^\s*%[\w.\-]+ = .*? all-to-all\(", hlo, re.M)) == 2
    # Expert weights are [8, 32, 16] / [8, 16, 32]: no all-gather may produce a full-E tensor.
    for line in re.findall(r"^\s*%[\w.\-]+ = .*? all-gather\(.*$", hlo, re.M):
        shape = re.search(r"= \w+\[([\d,]*)\]", line)
        dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
        assert not (len(dims) == 3 and dims[0] == 8), f"expert weights all-gathered: {line}"


def test_expert_gradients_are_summed_over_data_shards_once_not_per_expert(monkeypatch):
    """Through the per-expert map (forced here on small buffers), each data shard's expert
    weight gradients are all-reduced once, after the map's loop: inside it that would be one
    small all-reduce per local expert and weight."""
    one_expert_at_a_time(monkeypatch, unrolled=False)
    hlo = compiled_hlo(MESHES["data2_expert4"], "moe.capacity_factor=0", grad=True)
    assert "while(" in hlo  # the map is there
    loops = loop_computations(hlo)
    assert "all-reduce(" in hlo and "all-reduce(" not in loops


def test_one_device_mesh_runs_no_collectives():
    """On a one-device mesh (the trainer's default) the gradient has no all-reduce or
    all-to-all: XLA:CPU ran the size-1 axes' all-reduce of the expert weight gradients as a
    full copy of them, every layer."""
    hlo = compiled_hlo(MESHES["one_device"], "moe.capacity_factor=1.25", grad=True)
    assert "while(" in hlo or "dot(" in hlo  # a real compiled gradient
    for op in ("all-reduce", "all-to-all", "all-gather", "collective-permute"):
        assert f" {op}(" not in hlo and f" {op}-start(" not in hlo, op


def test_mesh_validation_messages():
    with pytest.raises(ConfigError, match="has 4 devices but 8 are available"):
        make_mesh(tiny_config("mesh.data=4"))
    with pytest.raises(ConfigError, match=r"moe.n_experts \(4\) must be divisible by mesh.expert"):
        make_mesh(tiny_config("mesh.expert=8", "moe.n_experts=4", "moe.top_k=2"))
    with pytest.raises(ConfigError, match=r"attention.n_kv_heads \(2\) must be divisible"):
        make_mesh(tiny_config("mesh.tensor=4", "mesh.data=2"))
    with pytest.raises(ConfigError, match=r"micro-batch .* \(4\) must be divisible"):
        make_mesh(tiny_config("mesh.data=8", "train.batch_size=4"))
    mesh = make_mesh(tiny_config("mesh.data=-1", "mesh.expert=2"))
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "expert": 2, "context": 1, "tensor": 1}
    # ZeRO splits a dim over two axes at once: each alone divides it, their product does not
    with pytest.raises(
        ConfigError,
        match=r"model.d_model \(132\) must be divisible by "
        r"mesh.fsdp\*expert \(8\)",
    ):
        make_mesh(
            tiny_config(
                "mesh.fsdp=2", "mesh.expert=4", "model.d_model=132", "attention.head_dim=32"
            )
        )
    with pytest.raises(
        ConfigError,
        match=r"moe.expert_hidden \(36\) must be divisible by "
        r"mesh.tensor\*fsdp \(8\)",
    ):
        make_mesh(tiny_config("mesh.tensor=2", "mesh.fsdp=4", "moe.expert_hidden=36"))
    # the steps' groups must tile the axes they split
    with pytest.raises(ConfigError, match=r"mesh.gather_group \(3\) must divide mesh.fsdp \(8\)"):
        make_mesh(tiny_config("mesh.fsdp=8", "mesh.gather_group=3"))
    make_mesh(tiny_config("mesh.fsdp=8", "mesh.gather_group=4"))
    make_mesh(tiny_config("mesh.fsdp=2", "mesh.expert=2", "mesh.data=2", "mesh.gather_group=3"))


def test_params_are_created_sharded():
    cfg, mesh, _, sharded = moe_pair(MESHES["fsdp2_expert2_tensor2"])
    w = sharded.experts.w_gate[...]
    assert w.sharding.spec == P("expert", None, ("tensor", "fsdp"))
    # Each device holds 1/8 of the expert tensor: it was never materialised whole on one device.
    assert w.addressable_shards[0].data.shape == (4, 32, 4)


def _result_shapes(hlo: str, op: str) -> list[tuple[int, ...]]:
    """The result shapes of every `op` in the HLO (a tuple result gives each of its parts)."""
    shapes = []
    for line in re.findall(rf"^\s*%[\w.\-]+ = (.*?) {op}(?:-start)?\(", hlo, re.M):
        for dims in re.findall(r"\w+\[([\d,]*)\]", line):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def test_expert_weight_gradients_leave_as_reduce_scatters_over_fsdp():
    """Each fsdp shard keeps its slice of the expert weights' gradient: one reduce-scatter of
    the local experts' [E_loc, D, F_loc] gradient per weight, along its minor dim (the weights
    are gathered inside the expert shard_map, whose transpose that is), never an all-reduce of
    it (a gather outside left one, of the whole gradient, then sliced)."""
    hlo = compiled_hlo(MESHES["fsdp2_expert2_tensor2"], "moe.capacity_factor=1.25", grad=True)
    full = {(4, 32, 8), (4, 8, 32)}  # w_gate / w_up and w_down per device before the scatter
    assert not full & set(_result_shapes(hlo, "all-reduce")), "expert gradients all-reduced"
    scattered = _result_shapes(hlo, "reduce-scatter")
    assert scattered.count((4, 32, 4)) == 2 and scattered.count((4, 8, 16)) == 1, scattered


def test_activations_are_pinned_to_the_batch_split_at_every_layer_boundary():
    """sharding.at_block_boundary: under a mesh each decoder layer's input and output are
    constrained to rows over the batch axes (size-1 axes left out), 2 per layer; a batch the
    axes do not divide, or no mesh, adds none (left to the partitioner)."""
    from moe_jax.model import Transformer

    cfg = tiny_config("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "model.n_layers=2")
    mesh = make_mesh(cfg)
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)

    def constraints(batch, mesh_context):
        tokens = jnp.zeros((batch, 8), jnp.int32)
        with mesh_context:
            text = str(jax.make_jaxpr(lambda t: model(t)[0])(tokens))
        return re.findall(r"sharding_constraint\[[^\]]*?P\(\('fsdp', 'expert'\),?\)", text)

    assert len(constraints(8, jax.set_mesh(mesh))) == 2 * cfg.model.n_layers
    assert constraints(3, jax.set_mesh(mesh)) == []  # 3 rows over 4 shards: replicated
    assert constraints(8, contextlib.nullcontext()) == []
