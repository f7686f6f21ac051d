"""Whole training on a mesh: the train step on 8 simulated devices equals the single-device
step; a run saved on one mesh resumes on another; two processes train together like one.

No token is dropped here (capacity_factor 0), so routing does not depend on how the batch is
grouped and every mesh must give the single-device numbers up to float summation order.
Tolerances: float32; the sharded step sums gradients in another order (psum over shards), so
losses agree to ~1e-6 relative. After Adam steps parameters agree to 1e-5 absolute: Adam's
normalised update is O(lr) = 3e-3 per weight and the reordering moves it by ~1e-7.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax.inference.load import load_run
from moe_jax.observe.writers import read_metrics
from moe_jax.sharding import global_batch, make_mesh
from moe_jax.train.loop import train
from moe_jax.train.step import init_state, make_optimizer, make_train_step
from tests.conftest import FAST_COMPILE
from tests.helpers import TINY_BASE, tiny_config
from tests.test_readme_commands import COORDINATOR_PORT, readme_commands

ROOT = Path(__file__).resolve().parents[1]

ARCH = [
    "model.n_layers=2",
    "moe.n_experts=8",
    "moe.capacity_factor=0",
    "moe.shared_expert_hidden=16",
    "train.seq_len=16",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.peak_flops=1e11",
    "train.steps=4",
    "train.eval_every=4",
    "train.eval_batches=1",
    "checkpoint.every=4",
    "data.embedded_max_bytes=200000",
]
# data x expert alone: the two-process run below (data 2 x expert 2) trains like one process
MESHES = {
    "expert8": ["mesh.expert=8"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    "data2_fsdp2_expert2": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
}


def run_steps(cfg, n_steps=2):
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg.train)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (8, 17), dtype=np.int32) for _ in range(n_steps)]
    with jax.set_mesh(mesh):
        graphdef, state = init_state(cfg, tx, mesh=mesh)
        step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
        losses = []
        for b in batches:
            state, metrics = step(state, global_batch(b, mesh))
            losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state["params"]), metrics


@pytest.fixture(scope="module")
def single_device():
    return run_steps(tiny_config(*ARCH))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_train_step_on_a_mesh_equals_single_device(single_device, mesh_name):
    # with the tensor-split head, the chunked loss too (4 chunks; the reference has none)
    chunked = ["train.loss_chunk=4"] if mesh_name == "fsdp2_expert2_tensor2" else []
    cfg = tiny_config(*ARCH, *MESHES[mesh_name], *chunked)
    losses, params, metrics = run_steps(cfg)
    ref_losses, ref_params, ref_metrics = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in ("ce", "lb_loss", "z_loss", "expert_load", "grad_norm"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # Adam divides each gradient by its own RMS: where a gradient is near 0, summation-order
    # noise is amplified up to the step size (lr 3e-3 a step here), so the params after two
    # steps are compared to 1/60 of it; the losses and gradient norms above are the tight check.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_a_hybrid_train_step_on_a_mesh_equals_single_device():
    """A Gated DeltaNet hybrid (a linear layer, then gated full attention; tests/test_hybrid's
    layout) over data 2 x fsdp 2 x tensor 2, the linear layers' heads split over `tensor`:
    two steps' losses, metrics and params as on one device, to the tolerances above."""
    from tests.test_hybrid import HYBRID

    arch = [*ARCH, *HYBRID, "model.n_layers=2", "model.vocab_size=256"]
    ref_losses, ref_params, ref_metrics = run_steps(tiny_config(*arch))
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    losses, params, metrics = run_steps(tiny_config(*arch, *mesh))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in ("ce", "lb_loss", "grad_norm"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """4 uninterrupted steps on one device: the reference of the runs below."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(tiny_config(*ARCH, f"run_dir={run_dir}"))
    return run_dir


def assert_same_run(run_dir, reference):
    a, b = _losses(reference), _losses(run_dir)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-5)
    pa = nnx.state(load_run(reference)[1], nnx.Param)
    pb = nnx.state(load_run(run_dir)[1], nnx.Param)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_save_on_one_mesh_resume_on_another(tmp_path, straight_run, monkeypatch):
    moved = tmp_path / "moved"
    # The MFU peak is measured on one device, outside the mesh (under it, the matmul would
    # run on all 8 devices at once and the peak come out ~8x low).
    from moe_jax.summary import peaks

    meshes, real_measure = [], peaks.measure_peak_flops
    measure = lambda: meshes.append(jax.sharding.get_abstract_mesh().empty) or 1e11
    monkeypatch.setattr(peaks, "measure_peak_flops", measure)
    cfg = tiny_config(*ARCH, *MESHES["expert8"], f"run_dir={moved}", "train.peak_flops=0")
    train(cfg, stop_at=2)
    assert meshes == [True]
    with jax.set_mesh(make_mesh(cfg)), pytest.raises(RuntimeError, match="under a mesh"):
        real_measure()
    train(tiny_config(*ARCH, *MESHES["fsdp2_expert2_tensor2"], f"run_dir={moved}"))
    assert_same_run(moved, straight_run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_processes(run_dir, *overrides) -> list[subprocess.Popen]:
    """docs/scaling.md's two `train.py ... mesh.num_processes=2` commands (2 processes x 2 CPU
    devices, gloo collectives, one data=2 x expert=2 mesh), started as its shell starts them,
    on a free port, with this file's model, `overrides` and `run_dir` appended: the page's
    own commands are the ones that must train like one process (its other commands run in
    tests/test_readme_commands.py)."""
    port = _free_port()
    procs = []
    for cmd in [c for c in readme_commands() if c.kind == "processes"]:
        env = os.environ | cmd.env  # the page's XLA_FLAGS: 2 devices per process
        env["XLA_FLAGS"] += f" {FAST_COMPILE}"
        words = [COORDINATOR_PORT.sub(rf"\g<1>{port}", w) for w in cmd.words]
        args = [*words[2:], *TINY_BASE, *ARCH, *overrides, f"run_dir={run_dir}"]
        procs.append(
            subprocess.Popen(
                [sys.executable, words[1], *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def test_two_processes_train_together_like_one(tmp_path, straight_run):
    """docs/scaling.md's 2 processes x 2 CPU devices (gloo collectives) form one data=2 x expert=2
    mesh, and train as one process does."""
    multi = tmp_path / "multi"
    procs = start_two_processes(multi)
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert (
        "'data': 2, 'fsdp': 1, 'expert': 2, 'context': 1, 'tensor': 1} over 4 devices, 2 process"
        in outs[0]
    )
    assert_same_run(multi, straight_run)
    # One host: MFU is against its peak once, as both processes' devices share its cores.
    (info,) = [r for r in read_metrics(multi) if r["kind"] == "info"]
    assert info["compute_units"] == 1 and info["peak_flops"] == 1e11
    assert "peak 100 GFLOP/s (train.peak_flops, 2 processes on 1 host)" in outs[0]
    # Process 0 prints the run; process 1 says how far it got; gloo's connection lines are gone.
    assert "step 4/4 | loss" in outs[0] and "[process" not in outs[0]
    assert "[process 1/2] step 1: compiled and ran the train step in" in outs[1]
    assert "[process 1/2] step 4/4\n" in outs[1] and "loss" not in outs[1]
    for out in outs:
        assert "Gloo" not in out and "peer ranks" not in out


def test_gloo_connection_lines_are_told_apart_from_the_rest():
    """Gloo's threads interleave their lines' pieces (seen in a run: the first line below
    holds two starts and one end, the second the rest)."""
    from moe_jax.process_setup import is_gloo_noise

    ends = " is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    for line in (f"[Gloo] Rank 0{ends}", f"[Gloo] Rank [Gloo] Rank 1{ends}", f"0{ends}"):
        assert is_gloo_noise(line.encode())
    for line in ("step 4/4 | loss 5.27", "[process 1/2] step 4/4", "3", "", "[Gloo] hello"):
        assert not is_gloo_noise(line.encode())


def test_sigterm_to_one_of_two_processes_stops_both_at_one_saved_step(tmp_path):
    """Both processes must agree on the step to stop at: had one begun the checkpoint's
    barrier while the other ran the next step's collectives, both would hang."""
    run = tmp_path / "run"
    quiet = ["train.steps=1000", "checkpoint.every=1000", "train.eval_every=1000"]
    one_layer = ["model.n_layers=1", "moe.interleave_step=1"]  # MoE: its collectives too
    procs = start_two_processes(run, *quiet, *one_layer)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240  # a safety net against a hung child, not a timing test
    try:
        while not (metrics.exists() and '"step": 3,' in metrics.read_text()):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)  # not the process that writes the metrics
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outs[0][-2000:]
    (step,) = {int(n) for n in re.findall(r"stopped at step (\d+);", outs[0])}
    assert f"[process 1/2] received SIGTERM: stopped at step {step};" in outs[1]
    saved = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved == [step]


def test_a_multi_process_run_without_a_coordinator_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "mesh.num_processes=2", f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: cannot join the multi-process run (")
    assert "set mesh.coordinator_address" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "mesh_overrides, ok",
    [
        (["mesh.data=2", "mesh.expert=4"], True),  # 8 row blocks: 0-3 on process 0
        (["mesh.data=2", "mesh.tensor=4"], True),  # 2 row blocks, one per process
        (["mesh.tensor=8"], False),  # every device holds every row
        ([], False),  # all axes 1: the first device only, so process 1 feeds nothing
    ],
)
def test_the_mesh_must_split_the_batch_over_the_processes(mesh_overrides, ok):
    """With the 8 simulated devices taken as 2 processes of 4 (devices 0-3 and 4-7)."""
    from moe_jax.config import ConfigError
    from moe_jax.sharding import check_batch_split

    cfg = tiny_config(*ARCH, "attention.n_heads=8", "attention.n_kv_heads=8", *mesh_overrides)
    mesh = make_mesh(cfg)
    check = lambda: check_batch_split(mesh, 8, process_of=lambda d: d.id // 4, n_processes=2)
    if ok:
        check()
    else:
        with pytest.raises(ConfigError, match="does not split the batch over the 2 processes"):
            check()


def test_a_process_fills_the_row_blocks_its_devices_hold_in_order():
    """On a TPU torus one host's devices hold row blocks that are not adjacent (here blocks
    0, 2, 5 and 7 of 8, with the tensor axis pairing devices on one block): the process's
    rows fill them in order, replicas alike."""
    from moe_jax.sharding import local_blocks

    block = lambda i: (slice(4 * i, 4 * (i + 1)), slice(None))
    index_of = {"d0": block(5), "d1": block(0), "d2": block(7), "d3": block(2), "d4": block(0)}
    assert local_blocks(index_of, 16) == {
        "d1": slice(0, 4),
        "d4": slice(0, 4),
        "d3": slice(4, 8),
        "d0": slice(8, 12),
        "d2": slice(12, 16),
    }


def test_a_torus_mesh_whose_hosts_hold_scattered_rows_splits_the_batch():
    """Devices in an order where process 0 (devices 0-3) holds row blocks 0, 2, 4, 6."""
    from jax.sharding import Mesh

    from moe_jax.sharding import MESH_AXES, check_batch_split

    order = np.array(jax.devices())[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(1, 8, 1, 1, 1)
    mesh = Mesh(order, MESH_AXES)
    check_batch_split(mesh, 8, process_of=lambda d: d.id // 4, n_processes=2)
