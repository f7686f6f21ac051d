"""`moe_jax.aot.command`: compiling the real steps for TPU slices and GPU clusters on this CPU.

Needs the `aot` extra (libtpu and the jax CUDA plugin, compile-only); CI installs it. The
figures are checked against values worked out by hand on toy programs (exact: they are
integer counts of bytes and multiply-adds), the step's FLOPs against 6 N T on a dense model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.aot import command as aot
from moe_jax.aot import hlo
from moe_jax.aot.topology import TopologyError, get_topology, torus_3d
from moe_jax.config import ConfigError
from moe_jax.sharding import make_mesh
from moe_jax.summary.counts import param_breakdown
from moe_jax.summary.peaks import chip_peak_flops
from tests.helpers import tiny_config

pytest.importorskip("libtpu", reason="the `aot` extra (libtpu) is not installed")
pytest.importorskip(
    "jax_plugins.xla_cuda12", reason="the `aot` extra (jax CUDA plugin) is not installed"
)

TOPOLOGIES = ["v5p-8", "h100:1x4"]


def _toy_matmul(name: str):
    """x [1024, 2048] @ w [2048, 512] with the contracted dim split over 4 devices, the
    result replicated: each device multiplies its [1024, 512] x [512, 512] blocks and one
    all-reduce of the [1024, 512] f32 partial sums adds them."""
    topo = get_topology(name)
    mesh = Mesh(np.array(topo.devices), ("x",))
    x = jax.ShapeDtypeStruct((1024, 2048), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
    w = jax.ShapeDtypeStruct((2048, 512), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    out = NamedSharding(mesh, P())
    return jax.jit(lambda x, w: x @ w, out_shardings=out).lower(x, w).compile()


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_figures_of_a_sharded_matmul_equal_the_hand_count(name):
    compiled = _toy_matmul(name)
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes == (1024 * 512 + 512 * 512) * 4
    assert mem.output_size_in_bytes == 1024 * 512 * 4
    a = hlo.analyze(compiled.as_text())
    assert a.flops == 2 * 1024 * 512 * 512
    assert hlo.collectives_json(a.collectives) == {
        "all-reduce": {"count": 1, "bytes": 1024 * 512 * 4}
    }


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_a_scanned_loop_counts_its_trips(name):
    """The layer scan's body runs L times: XLA's cost analysis counts it once."""
    topo = get_topology(name)
    mesh = Mesh(np.array(topo.devices), ("x",))
    L, B, D = 6, 256, 512
    xs = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    ws = jax.ShapeDtypeStruct((L, D, D), jnp.float32, sharding=NamedSharding(mesh, P()))

    def f(x, ws):
        def layer(h, w):
            return jnp.tanh(h @ w) + jax.lax.psum(0.0, ()), None

        return jax.lax.scan(layer, x, ws)[0].sum()

    compiled = jax.jit(jax.grad(f, argnums=1)).lower(xs, ws).compile()
    a = hlo.analyze(compiled.as_text())
    # forward h @ w, backward dh = g @ w^T and dw = h^T @ g per layer, on B/4 rows per device
    assert a.flops == 3 * L * 2 * (B // 4) * D * D
    assert a.unknown_trip_loops == 0
    # dw is summed over the 4 devices' rows: one all-reduce of [L, D, D] f32 (or L of [D, D])
    assert a.collectives["all-reduce"].bytes == L * D * D * 4


def _dense_cfg(*overrides):
    """A dense model whose matmuls dwarf its attention and elementwise work."""
    return tiny_config(
        "moe.n_experts=0",
        "model.d_model=256",
        "model.ffn_hidden=1024",
        "model.vocab_size=1024",
        "model.n_layers=2",  # a scan of 2 trips: enough to tell it from one counted once
        "attention.nope_interval=0",
        "attention.n_heads=4",
        "attention.n_kv_heads=4",
        "train.seq_len=32",
        "train.batch_size=16",
        "mesh.data=4",
        *overrides,
    )


@pytest.mark.parametrize("scan", [False, True])
def test_train_step_flops_equal_6NT(scan):
    """Compiled matmul FLOPs of the train step against 6 N T (+ attention's, tiny here):
    within 2%, the attention blocks' and the loss's small matmuls. Scanned and unrolled
    must agree, which the loop's trip count makes so."""
    cfg = _dense_cfg(f"model.scan_layers={str(scan).lower()}")
    topo = get_topology("v5p-8")
    r = aot.compile_step(cfg, topo, "train")
    N = param_breakdown(cfg).active_matmul
    T = cfg.train.batch_size * cfg.train.seq_len
    assert r["flops_per_device"] * 4 == pytest.approx(6 * N * T, rel=0.02)
    assert r["flops_per_device"] / r["model_flops_per_device"] == pytest.approx(1.0, rel=0.02)
    assert r["loops_of_unknown_trip_count"] == 0


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("step", ["train", "decode"])
def test_tiny_expert_parallel_steps_compile(name, step):
    # Two layers, a dense and a MoE one: each further layer adds to the compile, not a case.
    over = ["model.n_layers=2", "mesh.data=2", "mesh.expert=2"]
    cfg = tiny_config(*over, "sample.batch_size=2", "sample.prompt_len=8")
    cfg = dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, max_new_tokens=4))
    # The suite's "highest" matmul precision (conftest) is refused by Mosaic for bf16 operands
    # ("Bad lhs type"): the accelerators' kernels compile at the default, as users run them.
    with jax.default_matmul_precision("default"):
        r = aot.compile_step(cfg, get_topology(name), step)
    assert r["fits"] and r["devices"] == 4 and r["mesh"]["expert"] == 2
    b = r["bytes"]
    assert 0 < b["peak"] <= r["hbm_bytes_per_device"]
    assert b["arguments"] > 0 and b["temps"] > 0
    if step == "train":
        assert b["aliased"] > 0  # the donated train state is updated in place
        # the expert-parallel dispatch and return of the MoE layer, forward and backward
        assert r["collectives"]["all-to-all"]["count"] >= 2 * 2
        # the model formula counts attention over every key; the blocked causal attention
        # skips the masked blocks (below 1), capacity 1.25 pads the experts (above). On TPU
        # the splash kernels carry no cost estimate, nor cuDNN's on GPU (where cuDNN is
        # installed): their FLOPs are left out, and said so.
        ratio = r["flops_per_device"] / r["model_flops_per_device"]
        if r["uncosted_kernels"]:
            assert 0.5 <= ratio < 1.5
        else:
            assert 0.8 <= ratio < 1.5
        # the accelerators' kernels (moe_jax/backends.py) leave no conditional in the step
        assert r["conditionals"] == 0
        assert r["loops_of_unknown_trip_count"] == 0
    else:
        assert r["loops_of_unknown_trip_count"] == 1  # the stop-token loop, counted at 3 steps


def test_attention_weights_gathered_by_steps_compile_for_tpu(monkeypatch):
    """TPU's auto mesh.weight_gather=steps: the attention weights, split over fsdp x expert,
    are gathered inside a shard_map one axis at a time; the train step compiles for v5p-8
    with the projections going that way, no conditionals, gradients leaving as
    reduce-scatters."""
    from moe_jax.model import weight_gather

    gathers = []
    steps = weight_gather.gather
    monkeypatch.setattr(
        weight_gather, "gather", lambda w, p, *a: gathers.append(p) or steps(w, p, *a)
    )
    cfg = tiny_config("model.n_layers=2", "mesh.fsdp=2", "mesh.expert=2")
    with jax.default_matmul_precision("default"):  # Mosaic's kernels: see above
        r = aot.compile_step(cfg, get_topology("v5p-8"), "train")
    assert (("fsdp", None), ("expert", None)) in gathers
    assert r["fits"] and r["conditionals"] == 0
    assert r["collectives"]["reduce-scatter"]["count"] > 0
    # the weights' floor (moe_jax.aot.collectives) is reported, and every weight is gathered (at
    # these tiny sizes libtpu all-reduces some gradients: the full-size figures are in
    # benchmarks/results/aot.md)
    floor = r["weight_collectives_floor"]
    assert 0 < floor["all-gather"] <= r["collectives"]["all-gather"]["bytes"]


def test_fsdp_in_groups_and_expert_windows_compile_for_tpu(monkeypatch):
    """One fsdp axis of 4 gathered in two steps of 2 (`mesh.gather_group`, as fsdp 64 in
    steps of 8 on v5p-128), and the experts' row windows each gathering their own experts'
    weights inside the layer's scan: compiles for v5p-8 with no conditionals, the gathers
    going by groups of devices."""
    from moe_jax.model import experts, grouped, weight_gather

    monkeypatch.setattr(experts, "MAP_MIN_CAPACITY", 1)  # the tiny exchange: ragged
    windows = []
    chunked = grouped._swiglu_chunked
    monkeypatch.setattr(grouped, "_swiglu_chunked", lambda *a: windows.append(a[-1]) or chunked(*a))
    plans = []
    steps = weight_gather.gather
    monkeypatch.setattr(
        weight_gather, "gather", lambda w, p, *a: plans.append(p) or steps(w, p, *a)
    )
    over = ["model.n_layers=2", "mesh.fsdp=4", "mesh.gather_group=2", "moe.row_chunks=2"]
    cfg = tiny_config(*over, "train.batch_size=8")
    with jax.default_matmul_precision("default"):  # Mosaic's kernels: see above
        r = aot.compile_step(cfg, get_topology("v5p-8"), "train")
    assert plans and all(
        p == (("fsdp", [[0, 2], [1, 3]]), ("fsdp", [[0, 1], [2, 3]])) for p in plans
    )
    assert windows and all(whole is not None for whole in windows)  # gathering their own
    assert r["fits"] and r["conditionals"] == 0
    assert r["collectives"]["reduce-scatter"]["count"] > 0


def test_down_projections_gradients_leave_as_reduce_scatters_on_tpu(tmp_path):
    """libtpu (0.0.42) compiles a reduce-scatter along a minor dim whose result is an odd
    multiple of 128 wide into an all-reduce (benchmarks/tpu_reduce_scatters.py). The dense
    and shared MLPs' down projections [F, D] are therefore gathered on a leading shard axis
    (`weight_gather.einsum`): with D 512 over fsdp 2 x expert 2 their gradients leave as
    reduce-scatters to [F, 256] then [F, 128]. Gathered along D itself (`gather_leading`
    patched to `gather`) libtpu made them all-reduces of [F, 256], which this check finds."""
    F = 1024
    over = ["model.d_model=512", f"moe.shared_expert_hidden={F}"]
    cfg = tiny_config(
        "model.n_layers=1", "moe.interleave_step=1", "mesh.fsdp=2", "mesh.expert=2", *over
    )
    path = tmp_path / "step.hlo"
    with jax.default_matmul_precision("default"):  # Mosaic's kernels: see above
        aot.compile_step(cfg, get_topology("v5p-8"), "train", hlo_path=str(path))
    comps, _, types = hlo.parse(path.read_text())
    reduced = [  # the arrays plain all-reduces sum (not the all-reduce-scatter fusions' own)
        shape
        for name, insts in comps.items()
        if not name.startswith("all-reduce-scatter")
        for inst in insts
        if inst.opcode in ("all-reduce", "all-reduce-start")
        for operand in inst.operands
        for _, shape in hlo.arrays(types.get(operand, ""))
    ]
    assert reduced and not [s for s in reduced if len(s) == 2 and s[0] == F], reduced


@pytest.mark.parametrize("name, batch", [("h100:1x4", 1), ("v5p-8", 4)])
def test_expert_parallel_decode_moves_tokens_not_weights(name, batch):
    """Decoding on an expert-parallel mesh: batch 4 splits over the 4 `expert` shards
    (all_to_all of tokens), batch 1 runs replicated (each device its own experts, one
    all-reduce of the [1, 1, D] output per layer). Either way every weight stays where it is:
    all collectives of the prefill and 3 decode steps move under 10% of one device's weight
    bytes (gathering the attention weights, or the picked experts, each step moves more)."""
    cfg = tiny_config(
        "mesh.expert=4",
        f"sample.batch_size={batch}",
        "sample.prompt_len=8",
        "model.d_model=256",
        "moe.expert_hidden=512",
        "model.dtype=bfloat16",
        "model.n_layers=2",  # a dense and a MoE layer: more would add to both sides alike
    )
    cfg = dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, max_new_tokens=4))
    r = aot.compile_step(cfg, get_topology(name), "decode")
    moved = sum(c["bytes"] for c in r["collectives"].values())
    assert moved < 0.1 * r["bytes"]["arguments"]
    assert ("all-to-all" in r["collectives"]) == (batch == 4)


def test_max_batch_doubles_then_bisects(monkeypatch):
    """Probes 1, 2, 4, 8, 16 rows per shard, then bisects to the largest that fits (12)."""
    probed = []

    def fake_compile(cfg, topo, step, verbose=False, hlo_path=None):
        rows = cfg.train.batch_size
        probed.append(rows)
        if rows > 12 * 4:
            raise aot.DoesNotFit(rows * 1e9, topo.hbm_bytes, "TPU v5", "chip")
        return {"batch": rows, "bytes": {"peak": rows, "temps": rows}, "compile_s": 0.0}

    monkeypatch.setattr(aot, "compile_step", fake_compile)
    cfg = tiny_config("mesh.data=4")
    topo = dataclasses.replace(get_topology("v5p-8"))
    best, refusal = aot.max_batch(cfg, topo, "train", False, lambda msg: None)
    assert [p // 4 for p in probed] == [1, 2, 4, 8, 16, 12, 14, 13]
    assert best["batch"] == 12 * 4
    assert refusal is not None


def test_meshes_that_split_torus_axes_or_span_slices():
    topo = get_topology("v5p-128")
    assert (topo.n_devices, topo.n_hosts, topo.shape) == (64, 16, "4x4x4")
    split = (
        "mesh.fsdp=8",
        "mesh.expert=8",
        "moe.n_experts=8",
        "train.batch_size=64",
        "model.d_model=64",
    )
    with pytest.raises(ConfigError, match="mesh.split_physical_axes=true"):
        make_mesh(tiny_config(*split), list(topo.devices))
    mesh = make_mesh(tiny_config(*split, "mesh.split_physical_axes=true"), list(topo.devices))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "expert": 8, "context": 1, "tensor": 1}
    assert {d.id for d in mesh.devices.flat} == {d.id for d in topo.devices}

    # two v5p-8 slices: the data axis crosses them, everything else stays inside one
    two = get_topology("v5p-8", num_slices=2)
    mesh = make_mesh(tiny_config("mesh.data=2", "mesh.fsdp=4", "mesh.slices=2"), list(two.devices))
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
    # GPUs name no slices: hosts are the units
    gpus = get_topology("h100:2x4")
    mesh = make_mesh(tiny_config("mesh.data=2", "mesh.fsdp=4", "mesh.slices=2"), list(gpus.devices))
    assert [{d.process_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
    with pytest.raises(ConfigError, match="mesh.slices"):
        make_mesh(tiny_config("mesh.data=1", "mesh.fsdp=8", "mesh.slices=2"), list(gpus.devices))


@pytest.mark.parametrize(
    "name, peak",
    [
        ("v4-8", 275e12),
        ("v5e-4", 197e12),
        ("v5p-8", 459e12),
        ("v6e-4", 918e12),
        ("h100:1x1", 989e12),
        ("h200:1x1", 989e12),
    ],
)
def test_every_chip_we_compile_for_has_its_bf16_peak_for_mfu(name, peak):
    """MFU on an accelerator is against the chip's bf16 peak, looked up by jax's device_kind
    (the names below are the compile-only devices'; the table matches by their start)."""
    assert chip_peak_flops(get_topology(name).devices[0].device_kind) == peak


def test_topology_names():
    assert torus_3d(64) == ((4, 4, 4), (True, True, True))
    assert torus_3d(1024)[0] == (8, 8, 16)  # v5p-2048, the squarest with sides of 4s
    assert torus_3d(192)[0] == (4, 4, 12)
    assert get_topology("v6e-256").n_devices == 256
    assert get_topology("v4-8").devices[0].device_kind == "TPU v4"
    assert get_topology("h100:4x8").n_hosts == 4
    for bad in ("v5p-12", "v5e-2", "h100:1x9", "a100:1x8", "tpu"):
        with pytest.raises(TopologyError, match="valid: v4-N"):
            get_topology(bad)


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "moe_jax.aot", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_needs_no_platform_setting():
    """As a user runs it: without JAX_PLATFORMS (the tests set it to cpu), libtpu and the CUDA
    plugin must not try to start, and the GPU topology must be found (it is offered only with
    the CPU as the platform). The mesh error comes after the topology is built."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = _cli("--topology", "h100:1x4", "mesh.expert=3", env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: moe.n_experts (4) must be divisible"), r.stderr
    assert r.stderr.count("\n") == 1


def test_cli_reports_json_and_refuses_what_does_not_fit():
    """The command line around compile_step (the compiles are the tests above; the train step
    through the CLI: tests/test_benchmarks.py's aot_figures): docs/accelerators.md's decode
    command on 2 layers (a dense and a MoE one), a refusal on 1: tiny.yaml's 4 would only cost
    compiling."""
    argv = ["configs/tiny.yaml", "--topology", "v5e-4", "--step", "decode", "mesh.data=4"]
    ok = _cli(*argv, "sample.batch_size=8", "model.n_layers=2")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout.strip().splitlines()[-1])
    assert report["topology"] == "v5e-4" and report["step"] == "decode" and report["fits"] is True
    assert set(report["bytes"]) == {
        "arguments",
        "outputs",
        "aliased",
        "temps",
        "host_temps",
        "peak",
    }
    # the compiler's own host memory (a tiny model has nothing model-sized): 2.2-4.2 GiB,
    # the most with the suite's two workers compiling at once
    assert 0 < report["host_peak_rss_bytes"] < 8 << 30
    assert "per device" in ok.stdout and ok.stderr == ""

    # 1 G embedding parameters with their Adam moments: 16 GiB of state on a 15.75 GiB chip
    big = _cli(
        "--topology", "v5e-1", "model.vocab_size=1048576", "model.d_model=1024", "model.n_layers=1"
    )
    assert big.returncode == 1, big.stderr
    assert big.stderr == ""
    (line,) = big.stdout.strip().splitlines()
    assert line.startswith("does not fit: needs ")
    assert line.endswith("per chip, a TPU v5 lite chip has 15.75 GiB")


@pytest.mark.parametrize(
    "args, message",
    [
        (("--topology", "v5p-7"), "unknown topology 'v5p-7'"),
        (("--topology", "v5p-8", "mesh.expert=3"), "moe.n_experts (4) must be divisible"),
        (("--topology", "v5p-8"), "the mesh uses 1 of the 4 devices"),
        (("--topology", "v5p-8", "mesh.data=4", "model.bogus=1"), "unknown config key"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message, capsys):
    """`aot.main` in this process (a child's start-up would cost a second a case): what the
    process adds around it, the plugins kept quiet, is the subprocess tests' above."""
    assert aot.main(list(args)) == 2  # an exception instead fails the test
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
