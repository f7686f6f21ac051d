"""The launchers in launch/, run as a cluster would run them, with the cluster faked.

SLURM: launch/slurm.sbatch under a fake SLURM environment (SLURM_* variables as a job of one
node and two tasks sets them) and a fake `srun` that starts each step's tasks as local
processes with their SLURM_PROCID / SLURM_LOCALID: the two tasks, 2 CPU devices each, join
through jax.distributed's own SLURM detection (coordinator 127.0.0.1, JAX_COORDINATOR_PORT)
and train one data 2 x expert 2 mesh. TPU: launch/tpu_pod.sh with a fake `gcloud` that runs
each `--command` here, as a one-worker slice would. Both check the shared-storage rule first
(moe_jax.cli.shared_storage), which is tested apart from them too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_COMPILE
from tests.helpers import TINY_BASE

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.n_layers=2",
    "moe.n_experts=4",
    "train.seq_len=16",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.peak_flops=1e11",
    "train.steps=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "checkpoint.every=2",
    "data.embedded_max_bytes=200000",
]
# A step's tasks as local processes: srun's own variables for each, as SLURM sets them.
FAKE_SRUN = """#!{python}
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
n = int(opts.get("ntasks", os.environ["SLURM_NTASKS"]))
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(f"{{n}} task(s): {{' '.join(a.splitlines()[0] for a in args[:4])}}\\n")
step = {{
    "SLURM_NTASKS": str(n),
    "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"],
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": str(n),
}}
task = lambda i: {{"SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}}
procs = [subprocess.Popen(args, env=os.environ | step | task(i)) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
"""
# One TPU worker: gcloud's --command run here by a shell, as the worker's shell runs it.
FAKE_GCLOUD = """#!/usr/bin/env bash
while [[ $# -gt 0 && "$1" != --command ]]; do shift; done
exec bash -c "$2"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_bin(tmp_path: Path, name: str, text: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
    return bin_dir


def slurm_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = fake_bin(tmp_path, "srun", FAKE_SRUN.format(python=sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return env | {
        "PATH": f"{bin_dir}:{env['PATH']}",
        "FAKE_SRUN_LOG": str(tmp_path / "srun.log"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "JAX_COORDINATOR_PORT": str(_free_port()),  # jax's own: instead of the job id's port
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}",
        "MOE_JAX_TRAIN": f"{sys.executable} {ROOT / 'train.py'}",
        "MOE_JAX_PYTHON": sys.executable,
    }


def test_the_sbatch_script_trains_two_tasks_as_one_mesh(tmp_path):
    run = tmp_path / "shared" / "run"
    mesh = ["mesh.data=2", "mesh.expert=2"]
    proc = subprocess.run(
        ["bash", "launch/slurm.sbatch", "tiny", *TINY_BASE, *SMALL, *mesh, f"run_dir={run}"],
        cwd=ROOT,
        env=slurm_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        "'data': 2, 'fsdp': 1, 'expert': 2, 'context': 1, 'tensor': 1} over 4 devices, 2 process"
        in out
    )
    assert "step 2/2 | loss" in out and "[process 1/2] step 2/2" in out
    assert (run / "checkpoints" / "2").is_dir()
    steps = (tmp_path / "srun.log").read_text().splitlines()
    assert [s.split(":")[0] for s in steps] == ["1 task(s)"] * 3 + ["2 task(s)"]
    assert [s.split()[5] for s in steps[:3]] == ["write", "check", "clean"]
    assert not list(run.parent.glob(".moe_jax_shared_*"))  # the marker is gone


def test_the_sbatch_script_stops_where_a_node_misses_the_data(tmp_path):
    missing = tmp_path / "local_disk" / "tokens"
    proc = subprocess.run(
        ["bash", "launch/slurm.sbatch", "tiny", f"data.path={missing}", f"run_dir={tmp_path}/r"],
        cwd=ROOT,
        env=slurm_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: host ") and f"does not see data.path '{missing}'" in line
    assert "storage every host sees" in line
    assert len((tmp_path / "srun.log").read_text().splitlines()) == 3  # no training step


def test_the_tpu_script_runs_the_check_then_the_same_command_on_every_worker(tmp_path):
    bin_dir = fake_bin(tmp_path, "gcloud", FAKE_GCLOUD)
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "MOE_JAX_DIR": str(ROOT),
        "MOE_JAX_PYTHON": sys.executable,
        "MOE_JAX_TRAIN": "echo TRAIN",
    }
    run_dir = tmp_path / "runs" / "a b"  # quoted through ssh's --command
    cmd = [
        "bash",
        str(ROOT / "launch/tpu_pod.sh"),
        "my-tpu",
        "us-east5-a",
        "recipes/mixtral_8x7b_v5p128",
    ]
    proc = subprocess.run(
        [*cmd, f"run_dir={run_dir}", "data.path=null", "data.tokenizer=byte"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == (
        f"TRAIN recipes/mixtral_8x7b_v5p128 run_dir={run_dir} data.path=null data.tokenizer=byte "
        "mesh.distributed=true\n"
    )
    dry = subprocess.run(
        [*cmd, "run_dir=/nfs/r"],
        env=env | {"MOE_JAX_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = dry.stdout.splitlines()
    assert len(lines) == 4 and all(
        x.startswith("gcloud compute tpus tpu-vm ssh my-tpu") for x in lines
    )
    assert [x.split()[8] for x in lines] == [
        "--worker=0",
        "--worker=all",
        "--worker=0",
        "--worker=all",
    ]
    # The recipe's own /shared/... data path is on no disk here: the check stops the launch.
    stopped = subprocess.run([*cmd], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert stopped.returncode == 2 and "TRAIN" not in stopped.stdout
    assert "does not see data.path '/shared/data/mixtral_tokens'" in stopped.stderr


@pytest.mark.parametrize("missing", [False, True])
def test_the_shared_storage_check_names_the_host_and_what_it_misses(tmp_path, missing):
    from moe_jax.cli.shared_storage import main

    data = tmp_path / "data.txt"
    data.write_text("hello")
    args = [f"run_dir={tmp_path}/runs/r", f"data.path={data}"]
    assert main(["write", "t1", "tiny", *args]) == 0
    assert (tmp_path / "runs" / ".moe_jax_shared_t1").is_file()  # beside, not in, the run dir
    if missing:  # another host: the marker is not on its disk
        (tmp_path / "runs" / ".moe_jax_shared_t1").unlink()
    assert main(["check", "t1", "tiny", *args]) == (2 if missing else 0)
    assert main(["clean", "t1", "tiny", *args]) == 0
    assert not (tmp_path / "runs" / ".moe_jax_shared_t1").exists()


def test_a_task_alone_on_its_node_is_given_all_its_gpus(tmp_path):
    """jax's SLURM default gives a task the one GPU its SLURM_LOCALID numbers; with one task a
    node (--ntasks-per-node=1) the script hands it every GPU nvidia-smi lists."""
    four_gpus = "#!/usr/bin/env bash\nfor i in 0 1 2 3; do echo GPU $i; done\n"
    fake_bin(tmp_path, "nvidia-smi", four_gpus)
    env = slurm_env(tmp_path) | {"SLURM_NTASKS": "1", "MOE_JAX_TRAIN": "bash -c env"}
    proc = subprocess.run(
        ["bash", "launch/slurm.sbatch", "tiny", f"run_dir={tmp_path}/r"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "JAX_LOCAL_DEVICE_IDS=0,1,2,3\n" in proc.stdout
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95\n" in proc.stdout
