"""Dropless expert parallelism in rounds of a bounded receive buffer (`exchange_rounds.py`):
the rows that do not fit go in further rounds, never dropped. On 8 simulated CPU devices with
the ragged-all-to-all's stand-in (`tests/ragged_stand_in.py`).

Against the dense every-expert reference (`test_moe.dense_reference`) and the unbounded
exchange (`moe.recv_factor=0`: one round of the worst-case buffer), values and gradients:
balanced routing (one round), adversarial routing (every token's experts on one shard) and a
tiny factor (overflow on every shard). Then training: steps with overflow equal the unbounded
exchange's, resume equals uninterrupted, and the rounds reach metrics.jsonl and the plots.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.model import exchange_rounds
from moe_jax.model.moe import MoE
from moe_jax.observe.plot import main as plot_main
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh
from moe_jax.train.loop import train
from tests.helpers import randomize_biases, tiny_config
from tests.test_moe import dense_reference

# float32 (the suite's matmul precision is "highest"): the rounds move the same rows and run
# the same products per row; only the weight gradient's sum over rows is split by rounds, so
# values and gradients agree to ~1e-6 relative; a row lost or sent twice is off by a whole
# term (~1e-1).
TOL = dict(rtol=1e-5, atol=1e-5)

LAYER = [
    "moe.n_experts=8",
    "model.d_model=32",
    "moe.expert_hidden=16",
    "moe.impl=ragged",
    "moe.capacity_factor=0",
    "moe.expert_bias=true",
    "moe.router_bias=true",
]
MESHES = {
    "expert4_data2": ["mesh.expert=4", "mesh.data=2"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
}


def _loss(m, x):
    y, stats = m(x)
    return jnp.sum(jnp.sin(y)), (y, stats)


def _reference_loss(m, x):
    y = dense_reference(m, x)
    return jnp.sum(jnp.sin(y)), y


def _onto_first_shard(moe: MoE, ep: int) -> None:
    """Every token's top-2 experts on the first expert shard: a large router bias on experts
    0 and 1 (shard 0 owns experts 0 .. E / ep - 1)."""
    bias = np.zeros(8, np.float32)
    bias[:2] = 20.0
    assert 8 // ep >= 2
    sharding = getattr(moe.router_bias[...], "sharding", None)
    moe.router_bias[...] = jax.device_put(jnp.asarray(bias), sharding)


def _run(cfg, x, routing, mesh=None):
    """(loss, (y, stats)), grads of the layer: sharded over `mesh` (else unsharded)."""
    build = lambda: MoE(cfg, rngs=nnx.Rngs(0))
    moe = create_sharded(build, mesh) if mesh is not None else build()
    randomize_biases(moe)
    if routing == "adversarial":
        _onto_first_shard(moe, mesh.shape["expert"] if mesh is not None else 4)
    grad = nnx.value_and_grad(_loss if mesh is not None else _reference_loss, argnums=(0, 1),
                              has_aux=True)  # fmt: skip
    if mesh is None:
        return nnx.jit(grad)(moe, x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        return nnx.jit(grad)(moe, xs)


def assert_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TOL), a, b)


# (mesh, routing, recv_factor, rounds expected, overflow fraction expected; None: not by hand)
CASES = [
    ("expert4_data2", "balanced", 4.0, 1, 0.0),
    # 8 tokens a shard, top-2: 16 rows sent; shard 0 gets all 4 x 16 = 64 of its group's rows.
    # factor 1.25: a first buffer of 20 rows -> 24 (a multiple of 8), later ones of a quarter
    # of 16 -> 8: 1 + 40 / 8 = 6 rounds, (64 - 24) / 64 past the first
    ("expert4_data2", "adversarial", 1.25, 6, 40 / 64),
    # factor 0.1: 1.6 -> 8 rows, then 8: 1 + 56 / 8 = 8 rounds
    ("expert4_data2", "adversarial", 0.1, 8, 56 / 64),
    ("expert4_data2", "tiny_factor", 0.1, None, None),
    ("fsdp2_expert2_tensor2", "adversarial", 0.5, None, None),
    ("fsdp2_expert2_tensor2", "tiny_factor", 0.1, None, None),
]


@pytest.mark.parametrize("mesh_name, routing, factor, rounds, overflow", CASES)
def test_rounds_equal_the_dense_reference_and_the_unbounded_exchange(
    mesh_name, routing, factor, rounds, overflow, ragged_on_cpu
):
    """Values, aux statistics and gradients (parameters and input) equal the dense reference
    and the unbounded exchange's; the rounds and the overflow are as counted by hand."""
    over = [*LAYER, *MESHES[mesh_name], "train.batch_size=8"]
    mesh = make_mesh(tiny_config(*over))
    x = jax.random.normal(jax.random.key(1), (8, 8, 32))  # 8 tokens a shard on expert4_data2

    (_, y_ref), g_ref = _run(tiny_config(*LAYER), x, routing)
    (_, (y, s)), g = _run(tiny_config(*over, f"moe.recv_factor={factor}"), x, routing, mesh)
    (_, (y_all, s_all)), g_all = _run(tiny_config(*over, "moe.recv_factor=0"), x, routing, mesh)

    assert float(s["dropped_frac"]) == 0.0  # dropless, whatever the rounds
    assert float(s_all["exchange_rounds"]) == 1.0 and float(s_all["overflow_frac"]) == 0.0
    if rounds is not None:
        assert float(s["exchange_rounds"]) == rounds
        assert float(s["overflow_frac"]) == pytest.approx(overflow, abs=1e-7)
    elif routing != "balanced":  # overflow by construction
        assert float(s["exchange_rounds"]) >= 2 and float(s["overflow_frac"]) > 0.25
    assert_close(y, y_ref)
    assert_close(g, g_ref)
    stats = lambda s: {k: v for k, v in s.items() if k not in ("exchange_rounds", "overflow_frac")}
    assert_close((y, stats(s), g), (y_all, stats(s_all), g_all))


def test_receive_rows_scale_with_the_average_never_past_the_worst_case():
    Buffers = exchange_rounds.Buffers
    assert exchange_rounds.receive_rows(4096, 65536, 1.25) == Buffers(5120, 1024)
    assert exchange_rounds.receive_rows(100, 65536, 1.0) == Buffers(104, 32)  # multiples of 8
    assert exchange_rounds.receive_rows(4096, 5500, 1.25) == Buffers(5120, 380)  # the rest
    assert exchange_rounds.receive_rows(4096, 4500, 1.25).first == 4500  # capacity binds first
    assert exchange_rounds.receive_rows(4096, 65536, 0).first == 65536  # off: the worst case


TRAIN = [
    *LAYER,
    "model.n_layers=2",
    "moe.interleave_step=1",
    "mesh.expert=4",
    "mesh.data=2",
    "train.batch_size=8",
    "train.seq_len=16",
    "train.log_every=1",
    "train.warmup_steps=2",
    "train.peak_flops=1e11",  # skip the start-up matmul measurement
    "data.embedded_max_bytes=300000",
    "train.steps=1000",  # whole runs stop early with `stop_at`: one compiled train step
    "train.eval_every=1000",
    "checkpoint.every=4",
    "moe.recv_factor=0.3",
]


def _train(run_dir, *over, stop_at):
    cfg = tiny_config(*TRAIN, f"run_dir={run_dir}", *over)
    return train(cfg, stop_at=stop_at)


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def _params(run_dir):
    from moe_jax.inference.load import load_run

    return jax.tree.leaves(nnx.state(load_run(run_dir)[1], nnx.Param))


def test_training_with_overflow_equals_the_unbounded_exchange(tmp_path, ragged_on_cpu):
    """4 steps at a factor that overflows every layer on every step equal the unbounded
    exchange's; the rounds are in metrics.jsonl, and the plots draw them. (The rounds keep no
    state from step to step, so resuming is the trainer's: test_train's resume test.)"""
    straight, unbounded = tmp_path / "straight", tmp_path / "all"
    _train(straight, stop_at=4)
    _train(unbounded, "moe.recv_factor=0", stop_at=4)

    rec, rec_all = _records(straight), _records(unbounded)
    assert [r["step"] for r in rec] == [1, 2, 3, 4]
    for r in rec:
        assert min(r["exchange_rounds"]) >= 2 and min(r["overflow_frac"]) > 0
    assert all(r["exchange_rounds"] == [1.0, 1.0] and r["overflow_frac"] == [0, 0] for r in rec_all)
    np.testing.assert_allclose([r["loss"] for r in rec], [r["loss"] for r in rec_all], rtol=1e-5)
    for a, b in zip(_params(straight), _params(unbounded), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # 4 Adam steps of ~1e-6 apart

    assert plot_main([str(straight), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots/exchange.png").stat().st_size > 0
    assert plot_main([str(unbounded), "--out", str(tmp_path / "plots_all")]) == 0
    assert not (tmp_path / "plots_all/exchange.png").exists()  # never overflowed: no plot
