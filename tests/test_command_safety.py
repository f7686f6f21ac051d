"""Commands other than train.py stopped or out of space (moe_jax/run/output.py): an output is
whole or absent, a stopping signal ends a command with one line and exit 128 + signal, kill
-9 leaves no process behind and the next run removes what it left, and a full disk is one
line that names the path. Budget: ~25 s (a few `prepare` subprocesses, tiny runs)."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from moe_jax.run import output
from moe_jax.run.layout import CONFIG_FILE, RunError
from moe_jax.run.output import Interrupted, new_file, new_output, remove_dead_siblings

ROOT = Path(__file__).resolve().parents[1]


def _siblings(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def _full_disk(path="x"):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ----------------------------------------------------------------------------- the helpers


def test_new_output_is_whole_or_absent(tmp_path):
    out = tmp_path / "a" / "b" / "out"  # its parents are made, and removed on failure
    with pytest.raises(ValueError), new_output(out, "--out") as tmp:
        (tmp / "part").write_text("half")
        raise ValueError("boom")
    assert not (tmp_path / "a").exists()
    with new_output(out, "--out") as tmp:
        (tmp / "whole").write_text("done")
    assert [p.name for p in out.iterdir()] == ["whole"] and _siblings(out) == []
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory made by the caller is replaced
    with new_output(empty, "--out") as tmp:
        (tmp / "f").write_text("x")
    assert (empty / "f").read_text() == "x"


def test_sigterm_inside_the_block_removes_the_sibling(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Interrupted) as e, new_output(out, "--out") as tmp:
        (tmp / "part").write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
    assert e.value.signum == signal.SIGTERM
    assert not out.exists() and _siblings(out) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def _signal_in_a_gc_callback(signum):
    """Send `signum` from inside a gc callback, where its handler then runs, as it once ran
    in jax's `_xla_gc_callback` during an export: Python cannot raise from there."""

    def callback(phase, info):
        if phase == "start":
            os.kill(os.getpid(), signum)
            sum(range(1000))  # bytecode, where the handler runs if os.kill did not run it

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)


@pytest.fixture
def unraisable(monkeypatch) -> list[BaseException]:
    """What reaches the unraisable-exception hook the process had (Python's own prints the
    "Exception ignored in ..." traceback)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("writer", ["new_output", "new_file"])
def test_a_signal_lost_in_a_gc_callback_still_stops_before_the_commit(
    tmp_path, unraisable, writer, signum
):
    """The output is not committed, its sibling is removed, and nothing reaches the
    unraisable hook. Before: the block ran on and committed (an import SIGTERM'd inside jax's
    gc callback exited 0 with its output), under an "Exception ignored" traceback."""
    out = tmp_path / "out"
    # the handlers the process started with (a job started in the background by a
    # non-interactive shell has SIGINT ignored, not Python's default_int_handler)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = KeyboardInterrupt if signum == signal.SIGINT else Interrupted
    opened = new_output(out, "--out") if writer == "new_output" else new_file(out)
    with pytest.raises(stop), opened as tmp:
        _signal_in_a_gc_callback(signum)
        (tmp / "part" if writer == "new_output" else tmp).write_text("whole")  # it goes on
    assert not out.exists() and _siblings(out) == []
    assert unraisable == []
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # restored


def test_other_unraisable_exceptions_still_reach_the_hook(tmp_path, unraisable):
    class Broken:
        def __del__(self):
            raise ValueError("a real problem")

    with pytest.raises(Interrupted), new_file(tmp_path / "f"):
        _signal_in_a_gc_callback(signal.SIGTERM)
        Broken()  # collected at once: its exception is an unraisable one
    assert [str(e) for e in unraisable] == ["a real problem"]


def test_a_dead_process_sibling_is_removed_a_live_one_kept(tmp_path):
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}-0123456789ab"
    live = tmp_path / f".out.tmp-{os.getpid()}-0123456789ab"
    other = tmp_path / f".other.tmp-{int(dead.stdout)}-0123456789ab"
    for d in (stale, live, other):
        (d / "x").mkdir(parents=True)
    remove_dead_siblings(out)
    assert not stale.exists() and live.exists() and other.exists()


def test_new_file_keeps_the_old_file_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "loss.png"
    path.write_bytes(b"old plot")

    def write_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise _full_disk(tmp)

    with pytest.raises(OSError), new_file(path) as tmp:
        write_then_fail(tmp)
    assert path.read_bytes() == b"old plot" and _siblings(path) == []
    line, code = output.one_line(_full_disk(path), path)
    assert code == 1 and "no space left" in line and str(path) in line and "\n" not in line


# ----------------------------------------------------------------------------- prepare


def _big_input(tmp_path: Path) -> Path:
    """~8 MB of real text that does not change with this project: the standard library."""
    text, n = [], 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text.append(p.read_text(errors="replace"))
        n += len(text[-1])
        if n > 8e6:
            break
    f = tmp_path / "big.txt"
    f.write_text("".join(text))
    return f


def _session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`: a killed command's helpers."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


# `python -m moe_jax.prepare`, with SIGINT handled as at a terminal: a shell's background job
# (CI's) starts with it ignored, and Python then leaves it so.
PREPARE = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'moe_jax.prepare', *sys.argv[1:]])"
)


def _prepare_cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", PREPARE, str(src), "--tokenizer", "byte",
            "--separator", "\n", "--workers", "2", "--out", str(out)]  # fmt: skip


def _stopped(src: Path, out: Path, signum: int, delay: float) -> subprocess.CompletedProcess:
    """prepare, sent `signum` `delay` s after its temporary sibling appears."""
    proc = subprocess.Popen(_prepare_cmd(src, out), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not _siblings(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    deadline = time.monotonic() + 10  # the workers notice within 0.5 s
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_processes(proc.pid) == [], "processes outlived the stopped command"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_prepare_stopped_at_any_moment_leaves_nothing(tmp_path):
    src = _big_input(tmp_path)
    ref = tmp_path / "ref"
    subprocess.run(_prepare_cmd(src, ref), cwd=ROOT, check=True, capture_output=True)
    out = tmp_path / "out"
    for signum, delay in [(signal.SIGTERM, 0.3), (signal.SIGINT, 0.05), (signal.SIGKILL, 0.3),
                          (signal.SIGKILL, 0.0)]:  # fmt: skip
        r = _stopped(src, out, signum, delay)
        if r.returncode == 0:  # finished first: start again
            pytest.fail(f"prepare finished before {signum!r} after {delay} s; use a bigger input")
        assert not out.exists()
        if signum == signal.SIGKILL:
            assert r.returncode == -signal.SIGKILL
            assert "leaked semaphore" not in r.stderr, r.stderr  # multiprocessing's cleanup
            continue  # may leave its sibling: the next run removes it
        assert r.returncode == 128 + signum, r.stderr
        name = signal.Signals(signum).name
        assert r.stderr.strip().splitlines()[-1].startswith(f"error: stopped by {name}"), r.stderr
        assert "Traceback" not in r.stderr and _siblings(out) == []
    subprocess.run(_prepare_cmd(src, out), cwd=ROOT, check=True, capture_output=True)
    assert _siblings(out) == []  # the killed runs' siblings are gone
    for f in ("tokens.bin", "documents.bin"):
        assert (out / f).read_bytes() == (ref / f).read_bytes()


# ----------------------------------------------------------------------------- full disks


def test_a_full_disk_at_a_runs_start_leaves_no_config(tmp_path, monkeypatch):
    """config.yaml was left at 0 bytes, and the run refused afterwards as 'a different
    architecture'. Now: one line, nothing written, and the same start works once there is
    room."""
    from moe_jax.run.checkpoints import Checkpointer
    from tests.helpers import tiny_config

    cfg = tiny_config(f"run_dir={tmp_path / 'run'}")
    real = output.write_text

    def full(path, text):
        with new_file(path) as tmp:
            tmp.write_text(text[:10])
            raise _full_disk(tmp)

    monkeypatch.setattr("moe_jax.run.checkpoints.write_text", full)
    with pytest.raises(RunError, match=r"cannot write .*config.yaml' \(no space left"):
        Checkpointer(cfg)
    assert not (tmp_path / "run" / CONFIG_FILE).exists()
    monkeypatch.setattr("moe_jax.run.checkpoints.write_text", real)
    Checkpointer(cfg).close()
    assert "n_layers" in (tmp_path / "run" / CONFIG_FILE).read_text()


def test_export_and_quantize_on_a_full_disk_say_so_in_one_line(tmp_path, monkeypatch, capsys):
    from moe_jax import quantize
    from moe_jax.interop import __main__ as interop
    from moe_jax.interop.safetensors_io import ShardWriter
    from moe_jax.train.loop import train
    from tests.test_train import _cfg

    run = tmp_path / "run"  # Qwen3-MoE-shaped, so that it exports
    train(_cfg(run, "attention.qkv_bias=false", "moe.router_bias=false"), stop_at=2)

    def no_room(*a, **k):
        raise _full_disk(tmp_path / "hf" / "shard")

    monkeypatch.setattr(ShardWriter, "add", no_room)
    assert interop.main(["export", str(run), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err and "nothing was written" in err, err
    assert not (tmp_path / "hf").exists() and _siblings(tmp_path / "hf") == []
    monkeypatch.setattr("moe_jax.run.checkpoints.keep_tokenizer_files", no_room)
    assert quantize.main([str(run), "--out", str(tmp_path / "q")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err, err
    assert not (tmp_path / "q").exists() and _siblings(tmp_path / "q") == []


# ----------------------------------------------------------------------------- readers


@pytest.fixture
def two_checkpoints(tmp_path):
    """A run with checkpoints 2 and 4, and a hook that plays training with checkpoint.keep=1
    under a reader: checkpoint 4 is hidden until the reader starts reading 2, which then
    goes as 4 appears."""
    import orbax.checkpoint as ocp

    from moe_jax.run.layout import CHECKPOINT_DIR
    from moe_jax.train.loop import train
    from tests.test_train import _cfg

    run = tmp_path / "run"
    train(_cfg(run), stop_at=2)
    train(_cfg(run), stop_at=4)
    ckpts, aside = run / CHECKPOINT_DIR, tmp_path / "4"
    (ckpts / "4").rename(aside)
    real = ocp.CheckpointManager.restore

    def training_meanwhile(self, step, *a, **k):
        if aside.exists() and step == 2:
            aside.rename(ckpts / "4")
            shutil.rmtree(ckpts / "2")
        return real(self, step, *a, **k)

    return run, training_meanwhile


def test_readers_take_the_newest_when_training_removes_theirs(two_checkpoints, monkeypatch,
                                                              tmp_path, capsys):  # fmt: skip
    """quantize, sample.py and init_from were told a healthy run was damaged ('checkpoint N is
    damaged ... the run's only checkpoint') when training deleted it under them."""
    import orbax.checkpoint as ocp

    from moe_jax.quantize import quantize_run

    run, training_meanwhile = two_checkpoints
    monkeypatch.setattr(ocp.CheckpointManager, "restore", training_meanwhile)
    assert f"int8 copy of {run} step 4" in quantize_run(run, tmp_path / "q")


def test_a_step_asked_for_and_removed_is_said_so(two_checkpoints, monkeypatch):
    import orbax.checkpoint as ocp

    from moe_jax.inference.load import load_run

    run, training_meanwhile = two_checkpoints
    monkeypatch.setattr(ocp.CheckpointManager, "restore", training_meanwhile)
    with pytest.raises(RunError, match="checkpoint 2 in .* was removed while reading it"):
        load_run(run, step=2)


def test_init_from_a_training_run_takes_its_newest(two_checkpoints, monkeypatch, tmp_path,
                                                   capsys):  # fmt: skip
    import orbax.checkpoint as ocp

    from moe_jax.train.loop import train
    from tests.test_train import _cfg

    run, training_meanwhile = two_checkpoints
    monkeypatch.setattr(ocp.CheckpointManager, "restore", training_meanwhile)
    train(_cfg(tmp_path / "new", f"init_from={run}"), stop_at=1)
    assert f"initialised from {run} step 4" in capsys.readouterr().out


def test_readers_racing_keep_1_training_never_report_damage(tmp_path):
    """Real training (train.py, a checkpoint every third step, keep=1) under back-to-back
    reads that take about as long as a checkpoint interval: every read gets a whole
    checkpoint; none is told the run is damaged (one in three was) or has no checkpoint."""
    from moe_jax.inference.load import load_run, read_run_meta
    from moe_jax.run.layout import CHECKPOINT_DIR
    from tests.helpers import TINY_BASE
    from tests.test_train import TINY, subprocess_env

    run = tmp_path / "run"
    args = [*TINY, *TINY_BASE, "checkpoint.every=3", "checkpoint.keep=1", f"run_dir={run}"]
    # The trainer runs niced: on idle cores that changes nothing, and on cores shared with other
    # jobs (CI's other worker) it keeps a read shorter than a checkpoint interval, which the
    # test assumes (a reader slower than the interval is told so after load.READ_TRIES reads).
    proc = subprocess.Popen([sys.executable, "train.py", "configs/tiny.yaml", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(), preexec_fn=lambda: os.nice(5))  # fmt: skip
    try:
        saved = lambda: {p.name for p in (run / CHECKPOINT_DIR).glob("*") if p.name.isdigit()}
        deadline = time.monotonic() + 300  # a safety net against a hung child
        while not saved():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        seen, reads = set(), 0
        while len(seen) < 6 and proc.poll() is None:  # reads raced 5 deletions at least
            seen |= saved()
            read_run_meta(run)
            load_run(run)
            reads += 1
        assert proc.poll() is None, proc.communicate()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    assert reads >= 3


def test_tasks_orphaned_by_a_failed_restore_are_not_logged(caplog):
    import logging

    from moe_jax.run.checkpoints import _quiet_orphaned_tasks

    _quiet_orphaned_tasks()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logging.getLogger("asyncio").error("Task exception was never retrieved\nfuture: ...")
        logging.getLogger("asyncio").error("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


# ----------------------------------------------------------------------------- fit check


def test_train_refuses_a_model_that_cannot_fit_before_allocating(tmp_path, monkeypatch):
    """Mixtral-8x7B on a host that could not hold it ran 43 s and died with a 17-line
    out-of-memory error; now one line before anything is allocated or written."""
    from moe_jax.inference import weights
    from moe_jax.train.loop import train
    from tests.test_train import _cfg

    monkeypatch.setattr(weights, "host_memory", lambda: 1 << 10)  # a 1 KiB host
    with pytest.raises(RunError, match=r"training needs at least [\d.]+ GiB per device where "
                       r"this host has available 0\.0 GiB"):  # fmt: skip
        train(_cfg(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_prepare_and_plot_on_a_full_disk_say_so_in_one_line(tmp_path, monkeypatch, capsys):
    """prepare (OSError) and plot (50 lines, a 0-byte loss.png) gave tracebacks."""
    from matplotlib.figure import Figure

    from moe_jax import prepare
    from moe_jax.observe import plot
    from moe_jax.observe.writers import MetricsWriter
    from tests.test_plot import records

    src = tmp_path / "in.txt"
    src.write_text("To be, or not to be\n" * 100)
    real_write = prepare._write_store

    def full(tmp, *a, **k):
        (tmp / "tokens.bin").write_bytes(b"half")
        raise _full_disk(tmp / "tokens.bin")

    monkeypatch.setattr(prepare, "_write_store", full)
    out = tmp_path / "store"
    assert prepare.main([str(src), "--tokenizer", "byte", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err and "tokens.bin" in err, err
    assert not out.exists() and _siblings(out) == []
    monkeypatch.setattr(prepare, "_write_store", real_write)

    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for r in records():
            writer.write(r)
    assert plot.main([str(tmp_path)]) == 0
    before = (tmp_path / "loss.png").read_bytes()
    capsys.readouterr()

    def half_then_full(self, fname, **k):
        Path(fname).write_bytes(b"\x89PNG half")
        raise _full_disk(fname)

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    assert plot.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err, err
    assert (tmp_path / "loss.png").read_bytes() == before  # the old plot, whole
    assert _siblings(tmp_path / "loss.png") == []


@pytest.mark.parametrize("command", ["quantize", "export", "import"])
def test_quantize_export_and_import_stopped_leave_nothing(tmp_path, command):
    """SIGTERM while the output is written: one line, exit 143, no output and no sibling (a
    hidden sibling of up to 203 MB stayed; an import left a half-written run); after kill -9
    the rerun removes the sibling."""
    if command == "import":
        pytest.importorskip("transformers", reason="import needs the `interop` extra")
        from tests.test_interop import hf_model

        source = tmp_path / "hf"
        hf_model("llama", seed=7, vocab_size=256).save_pretrained(source)
    else:
        from moe_jax.train.loop import train
        from tests.test_train import _cfg

        source = tmp_path / "run"  # Qwen3-MoE-shaped, so that it exports
        train(_cfg(source, "attention.qkv_bias=false", "moe.router_bias=false"), stop_at=2)
    # The command with one step of its writing slowed down, so that the signal surely lands
    # while its output is being written (a tiny run's is written in milliseconds): its first
    # call only (export adds the tensors one by one: slowing each made this test 24 s).
    module, owner, name, argv = {
        "quantize": ("moe_jax.quantize", "moe_jax.run.checkpoints", "keep_tokenizer_files", []),
        "export": ("moe_jax.interop", "moe_jax.interop.safetensors_io.ShardWriter", "add",
                   ["export"]),
        "import": ("moe_jax.interop", "moe_jax.run.stream_save", "write_params", ["import"]),
    }[command]  # fmt: skip
    slow = (
        "import importlib, runpy, sys, time\n"
        f"path = {owner!r}.split('.')\n"
        "try:\n    owner = importlib.import_module('.'.join(path))\n"
        "except ImportError:\n"
        "    owner = getattr(importlib.import_module('.'.join(path[:-1])), path[-1])\n"
        f"real = getattr(owner, {name!r})\n"
        "calls = []\n"
        "def slowly(*a, **k):\n    time.sleep(0.5 if not calls else 0)\n    calls.append(a)\n"
        "    return real(*a, **k)\n"
        f"setattr(owner, {name!r}, slowly)\n"
        f"runpy.run_module({module!r}, run_name='__main__')\n"
    )
    args = ["-c", slow, *argv, str(source)]
    out = tmp_path / "out"
    for signum in (signal.SIGTERM, signal.SIGKILL):
        cmd = [sys.executable, *args, "--out", str(out)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        while not _siblings(out) and proc.poll() is None:
            time.sleep(0.001)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (128 + signum, -signum), err  # not finished first
        assert not out.exists()
        if signum == signal.SIGTERM:
            assert err.strip().splitlines()[-1] == (
                f"error: stopped by SIGTERM; nothing was written to '{out}'"
            ), err
            assert "Traceback" not in err and _siblings(out) == []
    subprocess.run(
        [sys.executable, *args, "--out", str(out)], cwd=ROOT, check=True, capture_output=True
    )  # fmt: skip (slowed, but not stopped)
    assert out.is_dir() and _siblings(out) == []
