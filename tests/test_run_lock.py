"""One training run at a time in a run directory: a second one is refused by name with nothing
touched, readers still read (quietly), the lock of a killed run is taken over, a run that saved
while another was starting is not resumed from a stale step, and a two-process run holds one
lock (process 0's). Nothing is compiled here; budget: ~15 s (a lock holder and two processes)."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import socket
import subprocess
import sys

import pytest

from moe_jax.inference.load import load_run
from moe_jax.run.checkpoints import Checkpointer
from moe_jax.run.layout import LOCK_FILE, RunError
from moe_jax.run.policy import inspect_run
from moe_jax.train import loop as trainer
from moe_jax.train.loop import train
from tests.helpers import TINY_BASE
from tests.test_checkpoint import ROOT, TRAIN_MAIN, _snapshot, _write_checkpoints
from tests.test_distributed import start_two_processes
from tests.test_train import TINY, _cfg, subprocess_env

HOLDER = """
import sys, time
from pathlib import Path
from moe_jax.run.lock import RunLock
RunLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def locked_by_another_process(run_dir):
    """A process that holds `run_dir`'s lock as a training run would, until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        out = []
        while (line := proc.stdout.readline()) not in ("locked\n", ""):
            out.append(line)
        assert line, "".join(out)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_run_is_refused_readers_read_and_a_killed_runs_lock_is_taken_over(
    tmp_path, capsys
):
    run = tmp_path / "run"
    _write_checkpoints(_cfg(run), steps=(2,))
    with locked_by_another_process(run) as holder:
        before = _snapshot(run)
        # train.steps=2: were it not refused, it would end at once (already at step 2)
        argv = ["configs/tiny.yaml", *TINY_BASE, *TINY, "train.steps=2", f"run_dir={run}"]
        assert TRAIN_MAIN(argv) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(
            f"error: run_dir '{re.escape(str(run))}' is in use by another training run "
            rf"\(pid {holder.pid} on host {re.escape(socket.gethostname())}, since [\d-]+ "
            r"[\d:]+\); wait for it to finish or stop it \(SIGTERM saves a checkpoint\), or "
            r"choose another run_dir\n",
            err,
        ), err
        assert _snapshot(run) == before
        load_run(run)  # sampling, quantising and exporting take no lock

        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"pid {holder.pid} " in (run / LOCK_FILE).read_text()  # left behind, stale
    ckpt = Checkpointer(_cfg(run))  # takes it over
    assert f"pid {holder.pid} " not in (run / LOCK_FILE).read_text()
    ckpt.close()
    assert not (run / LOCK_FILE).exists()


def test_a_reader_listing_a_checkpoint_being_deleted_prints_nothing(tmp_path, caplog):
    """A run deletes its oldest checkpoint (checkpoint.keep) as it trains: a reader listing
    the steps meanwhile meets that directory with its metadata gone, which Orbax warns of."""
    run = tmp_path / "run"
    _write_checkpoints(_cfg(run), steps=(2, 5))
    (run / "checkpoints" / "1" / "params").mkdir(parents=True)  # half deleted
    with caplog.at_level(logging.INFO):
        load_run(run)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_lock_file_alone_is_an_empty_run_dir(tmp_path):
    """What a run killed between locking its new run dir and writing config.yaml leaves."""
    (tmp_path / LOCK_FILE).write_text("pid 1 on host h, since 2025-01-01 00:00:00")
    assert inspect_run(_cfg(tmp_path)) is None


def test_a_run_that_saved_while_this_one_started_is_not_resumed_from_a_stale_step(
    tmp_path, monkeypatch
):
    """The run dir is read (inspect_run) before it is locked: had another run saved since,
    resuming from the step read would overwrite that run's newer checkpoints."""
    run = tmp_path / "run"
    cfg = _cfg(run)
    _write_checkpoints(cfg, steps=(2,))
    real = trainer.load_run_data

    def load_data_while_another_run_saves(*args):
        _write_checkpoints(cfg, steps=(3,))  # another run saves step 3 and ends
        return real(*args)

    monkeypatch.setattr(trainer, "load_run_data", load_data_while_another_run_saves)
    with pytest.raises(RunError, match=r"changed while this run was starting \(another run saved "):
        train(cfg, stop_at=4)
    assert inspect_run(cfg).step == 3


def test_a_two_process_run_holds_one_lock_and_both_stop_when_it_is_taken(tmp_path):
    """Only process 0 locks (it writes the run's files), so the processes of one run do not
    exclude each other (tests/test_distributed.py trains with two); when the lock is taken,
    process 1 stops with process 0 instead of waiting for it in the next collective."""
    run = tmp_path / "run"
    run.mkdir()  # new: the other run has only just locked it
    with locked_by_another_process(run):
        before = _snapshot(run)
        procs = start_two_processes(run)
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [2, 2], outs
        assert "error: run_dir" in outs[0] and "is in use by another training run" in outs[0]
        assert f"error: process 0 could not open run_dir '{run}' for training" in outs[1]
        assert _snapshot(run) == before
