"""Memory options of the train step (issue 23), each against the default on 8 simulated devices.

Every option trades memory for time or precision, never the result: named remat policies
(kept in device memory or offloaded to host) recompute the same float ops, so they equal
`remat=none` to reassociation slack; sharded gradient accumulation equals one whole batch.
The runs are one sharded train step of a tiny model on fsdp 2 x expert 2 x tensor 2, float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moe_jax.config import REMAT_NAMES, ConfigError
from moe_jax.model.remat import policy
from moe_jax.sharding import batch_sharding, make_mesh
from moe_jax.train.step import init_state, loss_fn, make_optimizer, make_train_step
from tests.helpers import one_expert_at_a_time, tiny_config

MESH = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]
# Two one-layer blocks (period 1) under the scan, every named activation on the way:
# capacity buffers (capacity 1.0 drops some assignments), q/k/v, the attention kernel's output.
BASE = [
    *MESH,
    "model.n_layers=2",
    "attention.nope_interval=0",
    "moe.interleave_step=1",
    "model.scan_layers=true",
    "moe.capacity_factor=1.0",
    "train.batch_size=8",
    "train.seq_len=16",
    "model.max_seq_len=16",
]


def one_step(*overrides: str, steps: int = 1):
    """-> (metrics, new params) of train steps of the tiny model on the mesh."""
    cfg = tiny_config(*BASE, *overrides)
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx, mesh=mesh)
    step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, cfg.model.vocab_size, jnp.int32)
    with jax.set_mesh(mesh):
        for _ in range(steps):
            state, metrics = step(state, jax.device_put(tokens, batch_sharding(mesh)))
    return metrics, state["params"], state["opt_state"]


@pytest.fixture(scope="module")
def default_step():
    return one_step("model.remat=none")


def assert_same_step(got, want):
    # The same float ops in another order (recomputed, or summed per micro-batch): 1e-5 of
    # each tensor's scale after one AdamW step (whose update is ~lr = 3e-3 per weight).
    (m_got, p_got, _), (m_want, p_want, _) = got, want
    for k in ("loss", "ce", "grad_norm"):
        np.testing.assert_allclose(m_got[k], m_want[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(p_got), jax.tree.leaves(p_want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "remat",
    [
        # MaxText's v6e recipe, and the MoE buffers offloaded too
        ["model.remat=full", "model.remat_offload=layer_input,qkv_proj,out_proj,expert_in"],
        ["model.remat=dots", "model.remat_save=qkv_proj", "model.remat_offload=expert_out"],
    ],
    ids=["full_offload", "dots_save_offload"],
)
def test_named_remat_policies_equal_keeping_everything(default_step, remat):
    assert_same_step(one_step(*remat), default_step)


def test_expert_row_windows_under_full_remat_equal_keeping_everything(default_step, monkeypatch):
    """moe.row_chunks=2 with the grouped experts (their buffers' filled rows, as training-size
    buffers run) inside the remat'ed layer scan: the same step as the default's. The windows'
    custom VJP must really run (counted when traced)."""
    from moe_jax.model import experts, grouped

    monkeypatch.setattr(experts, "MAP_MIN_CAPACITY", 1)
    traced = []
    chunked = grouped._swiglu_chunked
    monkeypatch.setattr(grouped, "_swiglu_chunked", lambda *a: traced.append(1) or chunked(*a))
    got = one_step("model.remat=full", "moe.impl=ragged", "moe.row_chunks=2")
    assert traced
    assert_same_step(got, default_step)


def test_attention_weights_gathered_by_steps_equal_the_partitioners(default_step, monkeypatch):
    """mesh.weight_gather=steps (TPU's auto): the attention projections run inside a
    shard_map that gathers their weights over expert, then fsdp (tensor still splitting the
    heads); the same step as the partitioner's gathers. The projections must really go that
    way (their gathers counted when traced)."""
    from moe_jax.model import weight_gather

    gathers = []
    steps = weight_gather.gather
    monkeypatch.setattr(
        weight_gather, "gather", lambda w, plan, *a: gathers.append(plan) or steps(w, plan, *a)
    )
    got = one_step("model.remat=none", "mesh.weight_gather=steps")
    # the 4 projections of each attention layer (the expert weights' go over fsdp alone)
    both = [p for p in gathers if p == (("fsdp", None), ("expert", None))]
    assert len(both) >= 4
    assert_same_step(got, default_step)


def test_loss_head_gathered_by_steps_equals_the_partitioners(monkeypatch):
    """With the vocabulary whole on each device (no tensor axis) and the loss in chunks, the
    head too is gathered by steps, in the shard_map that runs the chunks on each device's
    rows: the same step as the partitioner's gathers."""
    from moe_jax.model import weight_gather

    mesh = ["mesh.tensor=1", "mesh.data=2", "train.loss_chunk=8"]
    want = one_step("model.remat=none", *mesh, "mesh.weight_gather=partitioner")
    ran = []
    statistics = weight_gather.head_statistics
    monkeypatch.setattr(
        weight_gather, "head_statistics", lambda *a: ran.append(statistics(*a)) or ran[-1]
    )
    got = one_step("model.remat=none", *mesh, "mesh.weight_gather=steps")
    assert ran and all(r is not None for r in ran)
    assert_same_step(got, want)


@pytest.mark.parametrize(
    "mesh, group, plan",
    [
        # fsdp 4 in two steps of 2, then expert
        (["mesh.fsdp=4", "mesh.expert=2"], 2, [[0, 2], [1, 3]]),
        # one batch axis of 8 (fsdp 64 on v5p-128 in steps of 8, fsdp 256 on v6e-256 in
        # steps of 8, 8 and 4, scaled down) in three steps of 2
        (["mesh.fsdp=8", "mesh.expert=1"], 2, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ],
)
def test_weights_gathered_in_groups_equal_the_partitioners(mesh, group, plan, monkeypatch):
    """mesh.gather_group: an fsdp axis longer than the group is gathered in two steps, within
    groups of consecutive devices, then across them (every step's transpose a reduce-scatter
    over those devices alone). Every gathered weight goes that way (attention, the dense and
    shared MLPs, the experts inside their map, the embedding and the head, these two in
    blocks of the vocabulary), and the step is the partitioner's."""
    from moe_jax.model import weight_gather

    mesh = [*mesh, "mesh.tensor=1", "mesh.data=1", "train.loss_chunk=8"]
    mesh += ["moe.interleave_step=2", "moe.shared_expert_hidden=32"]
    want = one_step("model.remat=none", *mesh, "mesh.weight_gather=partitioner")
    # the embedding and the head (32 KiB each) gathered in 4 blocks of the vocabulary
    monkeypatch.setattr(weight_gather, "TABLE_BLOCK_BYTES", 8 * 2**10)
    plans, shapes = [], []
    steps = weight_gather.gather
    monkeypatch.setattr(
        weight_gather,
        "gather",
        lambda w, p, *a: plans.append(p) or shapes.append(w.shape) or steps(w, p, *a),
    )
    ran = []
    statistics = weight_gather.head_statistics
    monkeypatch.setattr(
        weight_gather, "head_statistics", lambda *a: ran.append(statistics(*a)) or ran[-1]
    )
    got = one_step(
        "model.remat=none", *mesh, "mesh.weight_gather=steps", f"mesh.gather_group={group}"
    )
    # the first step, across the groups (major), holds each group's j-th device
    assert plans and all(p[0] == ("fsdp", plan) for p in plans)
    assert ran and all(r is not None for r in ran)
    # blocks of 64 of the 256 tokens, the model dim split 8 ways: the head's [4, 64]; the
    # embedding's [1, 64, 4] (on a leading shard axis); the shared expert's down projection
    # [32, 4] on a leading shard axis too, its up projection [4, 32] not
    assert (4, 64) in shapes and (1, 64, 4) in shapes
    assert (1, 32, 4) in shapes and (4, 32) in shapes and (32, 4) not in shapes
    # attention 4, dense MLP 3, shared expert 3, experts 3, embedding 4, head 4 (+ traces)
    assert len(plans) >= 21
    assert_same_step(got, want)


@pytest.mark.parametrize(
    "n, group, sizes",
    [(8, 4, [4, 2]), (64, 8, [8, 8]), (256, 8, [8, 8, 4]), (96, 8, [8, 12]), (8, 2, [2, 2, 2])],
)
def test_gather_steps_make_every_block_whole_in_order(n, group, sizes):
    """`weight_gather.steps` of an axis of n in groups: whole groups major, the rest they do
    not tile minor (sizes major first: the gradient's reduce-scatters run in that order), each
    step's groups tile the axis, and the steps, run minor first as tiled all-gathers (each
    device concatenating its group's blocks in group order), leave every device all n blocks
    in index order."""
    from moe_jax.model import weight_gather

    class Mesh:
        shape = {"fsdp": n}

    with weight_gather.gathering("steps", group):
        plan = weight_gather.steps(("fsdp",), Mesh)
    assert [len(groups[0]) for _, groups in plan] == sizes
    held = {i: [i] for i in range(n)}
    for _, groups in reversed(plan):
        assert sorted(i for g in groups for i in g) == list(range(n))
        held = {i: [b for j in g for b in held[j]] for g in groups for i in g}
    assert all(blocks == list(range(n)) for blocks in held.values())


def test_every_remat_name_is_named_by_the_model_and_offloads_go_to_host(monkeypatch):
    """A policy naming a tensor the model never names would silently keep nothing: every
    REMAT_NAMES entry must be a `checkpoint_name` in the train gradient's program, and an
    offloaded one must move to host memory (a device_put to a host array in the jaxpr). The
    experts run one at a time on their filled rows, as in training (tiny buffers otherwise
    take the batched matmul, which keeps nothing by name)."""
    one_expert_at_a_time(monkeypatch, unrolled=False)
    cfg = tiny_config(*BASE, "model.remat=full", "model.remat_offload=layer_input")
    from moe_jax.model import Transformer

    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jnp.zeros((2, 17), jnp.int32)
    grad = jax.grad(lambda p: loss_fn(p, graphdef, tokens, 0.0)[0])
    text = str(jax.make_jaxpr(grad)(params))
    for name in REMAT_NAMES:
        assert f"name={name}" in text, name
    assert "<host>" in text  # an array in host memory: f32<host>[...]
    # the policy itself: offloaded names go to host, saved stay, the rest is recomputed
    choose = policy("full", save=("qkv_proj",), offload=("layer_input",))
    name_p = jax.make_jaxpr(lambda x: checkpoint_name(x, "x"))(1.0).eqns[0].primitive
    assert choose(name_p, name="layer_input").dst == "pinned_host"
    assert choose(name_p, name="qkv_proj") is jax.ad_checkpoint.Saveable
    assert choose(name_p, name="out_proj") is jax.ad_checkpoint.Recompute


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.remat_offload=layer_inputs"], "model.remat_offload names 'layer_inputs'"),
        (
            ["model.remat_save=qkv_proj", "model.remat_offload=qkv_proj"],
            "qkv_proj is in both model.remat_save and model.remat_offload",
        ),
        (["model.remat=none", "model.remat_save=qkv_proj"], "set model.remat=full"),
    ],
)
def test_remat_names_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("model.scan_layers=true", "model.remat=full", *overrides)


def test_bfloat16_moments_store_half_and_track_the_float32_run():
    """train.moments_dtype=bfloat16: the moments are stored in bf16 (4 bytes a parameter
    fewer) and the update is computed in fp32. The first step's update comes from fp32
    moments, so it is the default's; after that the moments carry bf16 rounding (relative
    2^-9), which moves a step's update (~lr = 3e-3 per weight) by well under 1e-4."""
    want = one_step("model.remat=none", steps=3)
    got = one_step("model.remat=none", "train.moments_dtype=bfloat16", steps=3)
    floats = [a for a in jax.tree.leaves(got[2]) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and all(a.dtype == jnp.bfloat16 for a in floats)
    np.testing.assert_allclose(got[0]["loss"], want[0]["loss"], rtol=1e-4)
    pairs = list(zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True))
    for a, b in pairs:
        np.testing.assert_allclose(a, b, atol=1e-4)
    # and the rounding is really there: not the float32 run to the last bit
    assert any(not np.array_equal(a, b) for a, b in pairs)
