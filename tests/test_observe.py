"""Seeing inside a run (issue 51): a profiled run's trace names the model's parts and the
summary prints them; W&B (offline) and MLflow (a local file store) trackers, continued on
resume; progress (elapsed, ETA, device memory) in a log without a terminal; a device out of
memory in the step as one line, the last checkpoint kept.

Budget: the tiny runs of test_train.py (the same compiled step), a few steps each.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from moe_jax.config import ConfigError
from moe_jax.named_scopes import PARTS
from moe_jax.observe import profile, trackers
from moe_jax.observe.writers import read_metrics
from moe_jax.run.policy import inspect_run
from moe_jax.train import console as train_log
from moe_jax.train import loop as trainer
from moe_jax.train.loop import OutOfMemory, train
from tests.helpers import TINY_BASE, tiny_config
from tests.test_train import TINY

ROOT = Path(__file__).resolve().parents[1]


def _cfg(run_dir, *overrides):
    return tiny_config(*TINY, f"run_dir={run_dir}", *overrides)


def test_a_profiled_run_leaves_a_trace_whose_ops_carry_the_parts(tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(run, "train.profile_start=2", "train.profile_steps=2"), stop_at=3)
    (session,) = (run / "profile/plugins/profile").iterdir()
    assert json.loads((session / profile.STEPS_FILE).read_text())["first_step"] == 2
    assert (session / "perfetto_trace.json.gz").is_file()
    # Beside the trace, the traced program's HLO: its ops' op_names carry the parts
    hlo = (session / profile.HLO_FILE).read_text()
    names = set(profile.op_names(hlo).values())
    for part in ("attention", "router", "dispatch", "experts", "combine", "head_loss",
                 "optimizer", "mlp"):  # fmt: skip
        assert any(profile.part_of(n) == part for n in names), part
    # ... the trace's op events carry them, and they are charged to them, forward and backward
    events = profile.read_events(session / "perfetto_trace.json.gz")
    carried = {e["args"]["part"] for e in events if "part" in e.get("args", {})}
    assert {"attention", "router", "experts", "head_loss", "optimizer"} <= carried
    parts = profile.summarise(events, 2, hlo)["parts_ms"]
    assert {"attention", "experts", "router", "head_loss", "optimizer"} <= set(parts)
    assert parts["attention"]["bwd"] > 0 and parts["experts"]["fwd"] > 0
    assert "profile: steps 2-3 traced into" in capsys.readouterr().out
    assert profile.main([str(run / "profile")]) == 0
    out = capsys.readouterr().out
    assert "steps 2-3: wall" in out and "kernel kind" in out
    assert all(p in out for p in ("attention", "experts", "optimizer"))
    assert profile.main([str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize(
    "name, content",
    [("perfetto_trace.json.gz", b"not gzip"), ("perfetto_trace.json.gz", b"cut"),
     ("perfetto_trace.json.gz", b"{no json"), ("perfetto_trace.json.gz", b'{"a": 1}'),
     ("steps.json", b'{"first_step": 2}')],
    ids=["not-gzip", "cut-off", "not-json", "no-events", "bad-steps"],
)  # fmt: skip
def test_an_unreadable_trace_is_one_line(tmp_path, capsys, name, content):
    """A trace (or its steps.json) that cannot be read: `error: ...` naming the file, exit 2
    (a traceback of gzip's or json's once)."""
    session = tmp_path / "profile" / "plugins" / "profile" / "2026_01_01"
    session.mkdir(parents=True)
    trace = session / "perfetto_trace.json.gz"
    trace.write_bytes(gzip.compress(b'{"traceEvents": []}'))
    if content == b"cut":  # a gzip stream cut off
        content = gzip.compress(b'{"traceEvents": []}')[:-12]
    elif name == trace.name and content != b"not gzip":
        content = gzip.compress(content)
    (session / name).write_bytes(content)
    assert profile.main([str(tmp_path / "profile")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read the trace file '{session / name}'"), err
    assert err.count("\n") == 1, err


def test_ops_are_charged_to_their_innermost_part_by_hand():
    assert profile.part_of("jit(train_step)/jvp(attention)/dot_general") == "attention"
    assert profile.part_of("jit(s)/transpose(jvp(router))/transpose(jvp(experts))/dot") == "experts"
    assert profile.part_of("jit(s)/add") == "other"
    assert set(PARTS) >= {"attention", "router", "dispatch", "experts", "combine", "optimizer"}
    # a loop's event spans its body's op: the loop keeps only its own time
    M = lambda pid, tid, name: {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                                "args": {"name": name}}  # fmt: skip
    X = lambda name, ts, dur: {"ph": "X", "pid": 1, "tid": 2, "ts": ts, "dur": dur,
                               "name": name, "args": {"hlo_op": name}}  # fmt: skip
    events = [M(1, 2, "tf_XLAEigen"), X("while.1", 0, 10), X("dot.2", 1, 6), X("fusion.3", 12, 2)]
    hlo = '%dot.2 = f32[2] dot(), metadata={op_name="jit(s)/transpose(jvp(experts))/dot"}\n'
    s = profile.summarise(events, 1, hlo)
    assert s["parts_ms"]["experts"] == {"fwd": 0.0, "bwd": 0.006}
    assert s["parts_ms"]["other"] == {"fwd": 0.006, "bwd": 0.0}  # while 4 + fusion 2 (us)
    assert s["busy_ms"] == 0.012 and s["kinds_ms"]["matmul"] == 0.006


def _skip_without(package: str):
    if importlib.util.find_spec(package) is None:
        pytest.skip(
            f"{package} is not installed (the trackers extra: pip install 'moe-jax[trackers]')"
        )


def test_wandb_offline_run_is_continued_on_resume(tmp_path, monkeypatch):
    _skip_without("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    cfg = _cfg(run, "train.trackers=[wandb]")
    train(cfg, stop_at=2)
    run_id = (run / trackers.WANDB_ID_FILE).read_text().strip()
    train(cfg, stop_at=3)  # resumed: the same W&B run
    assert (run / trackers.WANDB_ID_FILE).read_text().strip() == run_id
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline)
    assert not (run / "tb").exists()  # not listed: no TensorBoard files


def test_mlflow_file_store_holds_the_metrics_and_the_config(tmp_path, monkeypatch):
    _skip_without("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = tmp_path / "run"
    cfg = _cfg(run, "train.trackers=[tensorboard,mlflow]")
    train(cfg, stop_at=2)
    train(cfg, stop_at=3)  # resumed: the same MLflow run
    run_id = (run / trackers.MLFLOW_ID_FILE).read_text().strip()
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    want = {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}
    assert losses == pytest.approx(want) and sorted(losses) == [1, 2, 3]
    logged = client.get_run(run_id)
    assert logged.data.params["train.batch_size"] == "8"
    assert logged.data.params["moe.n_experts"] == str(cfg.moe.n_experts)
    assert logged.info.status == "FINISHED" and (run / "tb").is_dir()


def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'moe-jax\[trackers\]'") as e:
        train(_cfg(tmp_path / "run", "train.trackers=wandb"))
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_a_log_without_a_terminal_carries_eta_and_memory(tmp_path, monkeypatch, capsys):
    # The CPU reports no device memory (then none is shown): one that does, 1 of 8 GiB
    G = 2**30
    monkeypatch.setattr(train_log, "device_memory", lambda: (G, 2 * G, 8 * G))
    monkeypatch.setattr(trainer, "device_memory", lambda: (G, 2 * G, 8 * G))
    run = tmp_path / "run"
    train(_cfg(run, "train.log_every=3", "train.progress_every_s=1e-6"), stop_at=4)
    out = capsys.readouterr().out  # captured: not a terminal, so no bar
    progress = [line for line in out.splitlines() if line.startswith("progress: step 2/")]
    assert progress and "ETA 0:" in progress[0] and "elapsed 0:" in progress[0]
    step_line = next(line for line in out.splitlines() if line.startswith("step 3/"))
    assert "ETA " in step_line and "mem 1.00 GiB of 8.0, peak 2.00" in step_line
    record = next(r for r in read_metrics(run) if r["kind"] == "train")
    assert record["device_peak_bytes"] == 2 * G


def test_device_memory_is_omitted_where_the_backend_reports_none():
    if jax.default_backend() == "cpu" and jax.devices()[0].memory_stats() is None:
        assert train_log.device_memory() is None


def test_out_of_memory_in_the_step_is_one_line_and_keeps_the_checkpoint(
    tmp_path, monkeypatch, capsys
):
    make = trainer.make_train_step

    def failing_third_step(*args, **kwargs):
        step, calls = make(*args, **kwargs), []

        def run(state, batch):
            calls.append(1)
            if len(calls) == 3:
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1610612736 "
                    "bytes.\nBufferAssignment OOM Debugging.\n..."
                )
            return step(state, batch)

        return run

    monkeypatch.setattr(trainer, "make_train_step", failing_third_step)
    run = tmp_path / "run"
    cfg = _cfg(run, "checkpoint.every=2")
    with pytest.raises(OutOfMemory) as e:
        train(cfg, stop_at=5)
    line = str(e.value)
    assert "\n" not in line and "at step 3; asked for 1.50 GiB" in line
    for knob in ("train.batch_size", "model.remat", "moe.row_chunks", "mesh.fsdp"):
        assert knob in line
    assert "Last checkpoint: step 2" in line and inspect_run(cfg).step == 2
    # train.py: that line on stderr, exit status 1
    sys.path.insert(0, str(ROOT))
    try:
        import train as train_cli
    finally:
        sys.path.remove(str(ROOT))
    capsys.readouterr()
    # a step of its own, failing at its own third call: not the first run's, kept for the
    # same model (moe_jax/run/programs.py), whose calls are past three
    from moe_jax.run import programs

    programs.forget()
    assert train_cli.main([*TINY_BASE, *TINY, f"run_dir={tmp_path / 'run2'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: device out of memory")


def test_trackers_take_bare_names_and_old_run_configs_still_load():
    from moe_jax.config import config_from_yaml, config_to_yaml

    cfg = tiny_config("train.trackers=wandb,mlflow")
    assert cfg.train.trackers == ("wandb", "mlflow")
    with pytest.raises(ConfigError, match="train.trackers='comet' is not supported"):
        tiny_config("train.trackers=[comet]")
    # a run saved before train.trackers: train.tensorboard: false means no TensorBoard files
    old = config_to_yaml(cfg).replace(
        "  trackers:\n  - wandb\n  - mlflow\n", "  tensorboard: false\n"
    )
    assert "tensorboard: false" in old and config_from_yaml(old).train.trackers == ()


def test_tensorboard_writes_without_importing_torch(tmp_path):
    """tensorboardX imports torch where it is installed (4 s at every run's start); the run's
    writer leaves it out, and the event file still holds the scalar."""
    code = (
        "import sys; from moe_jax.observe.writers import TensorBoardTracker\n"
        f"t = TensorBoardTracker({str(tmp_path)!r})\n"
        "t.write({'kind': 'train', 'step': 3, 'loss': 1.5}); t.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
    (events,) = (tmp_path / "tb").iterdir()
    assert b"loss" in events.read_bytes()


def test_the_cpu_peak_is_measured_once_a_process():
    from moe_jax.summary import peaks

    first = peaks.measure_peak_flops(n=256, repeats=1)
    hits = peaks._matmul_flops.cache_info().hits
    assert peaks.measure_peak_flops(n=256, repeats=1) == first
    assert peaks._matmul_flops.cache_info().hits == hits + 1
