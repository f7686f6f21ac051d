"""Orbax checkpoints and run directories: exact round trip (params, optimizer, data position,
config, tokenizer), keep-last-K, a crash mid-save keeping the previous checkpoint, load_run and
its errors, and refusing run directories that cannot be continued, with nothing touched; a
full disk mid-save as one error line, and resuming from an earlier checkpoint than the latest.
Two tests compile the tiny train step (the same program as tests/test_train.py's, cached);
budget: ~30 s (three short subprocesses)."""

from __future__ import annotations

import errno
import os
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax.data.corpus import train_iterator
from moe_jax.inference.load import load_run, on_device
from moe_jax.model import Transformer
from moe_jax.observe.writers import read_metrics
from moe_jax.run.checkpoints import Checkpointer, SaveError, write_inference_run
from moe_jax.run.layout import RunError
from moe_jax.run.policy import incompatible_keys, inspect_run
from moe_jax.tokenizer import ByteTokenizer
from moe_jax.train.loop import train
from moe_jax.train.step import init_state, make_optimizer
from tests.helpers import TINY_BASE
from tests.test_train import TINY, _cfg, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
TRAIN_MAIN = runpy.run_path(str(ROOT / "train.py"))["main"]
TOKENS = np.arange(5000, dtype=np.int32) % 256


def _write_checkpoints(cfg, steps=(3,)):
    """Save the freshly initialised state at `steps`, the data iterator advanced to each."""
    tx = make_optimizer(cfg.train)
    _, state = init_state(cfg, tx)
    it = train_iterator(TOKENS, cfg.train.seq_len, cfg.train.batch_size, cfg.seed)
    ckpt = Checkpointer(cfg)
    done = 0
    try:
        for step in steps:
            for _ in range(step - done):
                next(it)
            done = step
            meta = {"config": cfg, "tokenizer": ByteTokenizer(), "fingerprint": "f00d"}
            ckpt.save(step, state["params"], state["opt_state"], it, meta)
    finally:
        ckpt.close()
    return state, it


def _snapshot(directory: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_round_trip_is_exact(tmp_path):
    cfg = _cfg(tmp_path / "run")
    state, it = _write_checkpoints(cfg, steps=(3,))
    expected_next = next(it)

    resume = inspect_run(cfg)
    assert resume.step == 3 and resume.config == cfg and resume.fingerprint == "f00d"
    assert resume.tokenizer.kind == "byte"
    assert (tmp_path / "run/config.yaml").is_file()  # marks the directory as a run

    tx = make_optimizer(cfg.train)
    _, abstract = init_state(cfg, tx, abstract=True)
    fresh_it = train_iterator(TOKENS, cfg.train.seq_len, cfg.train.batch_size, cfg.seed)
    ckpt = Checkpointer(cfg)
    dev = jax.devices()[0]
    params, opt_state = ckpt.restore(
        3, on_device(abstract["params"], dev), on_device(abstract["opt_state"], dev), fresh_it
    )
    ckpt.close()
    _assert_trees_equal(params, state["params"])
    _assert_trees_equal(opt_state, state["opt_state"])
    np.testing.assert_array_equal(next(fresh_it), expected_next)  # data position restored


def test_keeps_only_the_last_k_checkpoints(tmp_path):
    cfg = _cfg(tmp_path / "run", "checkpoint.keep=2")
    _write_checkpoints(cfg, steps=(1, 2, 3, 4))
    assert sorted(
        int(p.name) for p in (tmp_path / "run/checkpoints").iterdir() if p.name.isdigit()
    ) == [3, 4]


def test_load_run_restores_params_config_and_tokenizer(tmp_path):
    cfg = _cfg(tmp_path / "run")
    state, _ = _write_checkpoints(cfg, steps=(2, 5))
    loaded_cfg, model, tok = load_run(tmp_path / "run")
    assert loaded_cfg == cfg and tok.kind == "byte" and isinstance(model, Transformer)
    _assert_trees_equal(nnx.state(model, nnx.Param), state["params"])
    _, model2, _ = load_run(tmp_path / "run", step=2)
    _assert_trees_equal(nnx.state(model2, nnx.Param), state["params"])


def test_load_run_errors(tmp_path):
    with pytest.raises(RunError, match=r"run directory '.*nowhere' does not exist"):
        load_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match=r"no checkpoint in '.*empty'"):
        load_run(tmp_path / "empty")
    _write_checkpoints(_cfg(tmp_path / "run"), steps=(2,))
    with pytest.raises(RunError, match=r"no checkpoint for step 7 .* saved steps: \[2\]"):
        load_run(tmp_path / "run", step=7)


def _damage(run: Path, step: int, how: str) -> None:
    """Break checkpoint `step` the way a full disk or a stray edit would."""
    ckpt = run / "checkpoints" / str(step)
    if how == "params":  # the array data of every parameter gone
        for chunk in (ckpt / "params").rglob("d/*"):
            chunk.unlink()
    elif how == "meta":
        (ckpt / "meta" / "metadata").write_text("not json{")
    else:  # the data iterator's position
        (ckpt / "data" / "process_0-of-1.json").write_text("garbage")


# Orbax's abandoned reads of the failed restore: the CLI drops them (test below), pytest warns.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["params", "meta", "data"])
def test_a_damaged_checkpoint_is_named_with_the_fix_and_nothing_touched(tmp_path, capsys, how):
    run = tmp_path / "run"
    cfg = _cfg(run)
    _write_checkpoints(cfg, steps=(2, 5))
    _damage(run, 5, how)
    before = _snapshot(run)
    what = {
        "params": r"array '[\w.]+' of its params cannot be read \(NOT_FOUND\)",
        "meta": r"'.*run/checkpoints/5/meta/metadata' cannot be read \(JSONDecodeError: .*\)",
        "data": r"'.*run/checkpoints/5/data/process_0-of-1.json' cannot be read \(JSONDe.*\)",
    }[how]
    fix = rf"checkpoint 5 in '.*run' is damaged: {what}; use an earlier checkpoint \(saved "
    fix += r"steps: \[2, 5\]\): --step 2 to sample, quantise or export it, train.resume_step=2 "
    fix += r"to resume training from it \(the later ones are moved to superseded/ in the run\)$"
    if how != "data":  # sampling reads params and meta only
        with pytest.raises(RunError, match=fix):
            load_run(run)
        load_run(run, step=2)  # the earlier one still loads
    assert TRAIN_MAIN(["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match("error: " + fix, err), err
    assert _snapshot(run) == before


def test_cli_damaged_checkpoint_prints_only_its_one_line(tmp_path):
    """Orbax's other reads of a failed restore die in coroutines nobody awaits: Python would
    print each one's traceback at exit, under the error line."""
    run = tmp_path / "run"
    _write_checkpoints(_cfg(run), steps=(2, 5))
    _damage(run, 5, "params")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--run", str(run), "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: checkpoint 5 in")


def _stopped_read(stop: BaseException):
    """A CheckpointManager.restore that a stop lands in, wrapped as Orbax's array read wraps
    whatever it catches (orbax/checkpoint/_src/serialization/serialization.py: `except
    BaseException as e: raise Exception(...) from e`)."""

    def restore(*args, **kwargs):
        try:
            raise stop
        except BaseException as e:
            raise Exception(
                "Encountered error while reading array index: (slice(0, 8, None),). See full "
                "TensorStore details: {'driver': 'zarr'}."
            ) from e

    return restore


def test_a_stop_during_a_checkpoint_read_is_a_stop_not_damage(tmp_path, capsys, monkeypatch):
    """SIGINT / SIGTERM landing in Orbax's read reaches us wrapped in a plain Exception: the
    command ends as stopped (130 / 143), no damage told, no `--step` / `resume_step` advice
    (which on a resume would move good checkpoints to superseded/), nothing touched."""
    import orbax.checkpoint as ocp

    from moe_jax.run.output import Interrupted

    run = tmp_path / "run"
    _write_checkpoints(_cfg(run), steps=(2, 5))
    before = _snapshot(run)
    sample = runpy.run_path(str(ROOT / "sample.py"))["main"]
    commands = [
        (KeyboardInterrupt(), lambda: sample(["--run", str(run), "--max-new-tokens", "2"]), 130),
        (
            Interrupted(15),  # SIGTERM, as the door raises it, in a resume's read
            lambda: TRAIN_MAIN(["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={run}"]),
            143,
        ),
    ]
    for stop, command, code in commands:
        monkeypatch.setattr(ocp.CheckpointManager, "restore", _stopped_read(stop))
        capsys.readouterr()
        assert command() == code
        err = capsys.readouterr().err
        assert err.startswith("error: stopped by SIG") and err.count("\n") == 1, err
        assert "damaged" not in err and "resume_step" not in err
        assert _snapshot(run) == before and not (run / "superseded").exists()


def test_resuming_with_another_process_count_is_refused_by_name(tmp_path, capsys):
    """Each process saves its own data position (process_P-of-N.json)."""
    run = tmp_path / "run"
    _write_checkpoints(_cfg(run), steps=(2,))
    data = run / "checkpoints" / "2" / "data"
    for p in (0, 1):
        (data / f"process_{p}-of-2.json").write_text((data / "process_0-of-1.json").read_text())
    (data / "process_0-of-1.json").unlink()
    before = _snapshot(run)
    assert TRAIN_MAIN(["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "was saved by 2 processes, each with its own data position; resume it with 2 " in err
    assert _snapshot(run) == before


def test_paths_that_cannot_hold_a_run_are_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("precious")
    argv = ["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={tmp_path / 'file' / 'run'}"]
    assert TRAIN_MAIN(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: cannot create run_dir '{tmp_path / 'file' / 'run'}' (Not a directory); "
        "choose a writable path\n"
    )
    with pytest.raises(RunError, match="is a file, not a run directory"):
        load_run(tmp_path / "file")
    with pytest.raises(RunError, match=r"'.*file' \(a file of that name is in the way\)"):
        write_inference_run(tmp_path / "file" / "int8", 1, {}, {})
    assert (tmp_path / "file").read_text() == "precious"


def test_a_kernel_the_backend_cannot_run_is_one_line_and_exit_2(tmp_path, capsys):
    """backends.KernelError (here cuDNN attention asked of a CPU) from inside the traced step
    reaches the user as one line, not a traceback."""
    argv = ["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={tmp_path / 'run'}"]
    assert TRAIN_MAIN([*argv, "attention.impl=cudnn"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: attention implementation 'cudnn' runs on gpu only, not cpu; set the attention "
        "impl to auto\n"
    )


def test_a_run_dir_that_never_saved_names_its_stale_config(tmp_path, capsys):
    """A run that failed before its first checkpoint leaves config.yaml behind: a corrected
    command is told exactly that, and what to delete, instead of 'cannot be continued'."""
    run = tmp_path / "run"
    Checkpointer(_cfg(run, "model.d_model=64")).close()  # writes config.yaml, saves nothing
    before = _snapshot(run)
    assert TRAIN_MAIN(["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint, only the config.yaml of a run that stopped before its first " in err
    assert "model.d_model: 64 -> 32" in err and f"delete '{run}'" in err
    assert _snapshot(run) == before


def test_architecture_changes_are_incompatible_training_changes_are_not(tmp_path):
    base = _cfg(tmp_path)
    assert (
        incompatible_keys(
            base,
            _cfg(
                tmp_path,
                "train.lr=1e-4",
                "train.steps=5000",
                "moe.capacity_factor=2.0",
                "moe.bias_update_rate=0",  # a training choice (DeepSeek-V3 ends its run at 0)
                # how a step computes, not what: kernels, exchange, chunks, remat
                "attention.impl=blocked",
                "moe.impl=ragged",
                "moe.exchange=buffers",
                "moe.row_chunks=2",
                "moe.recv_factor=2",
                "model.scan_layers=true",
                "model.remat=full",
                "model.remat_save=qkv_proj",
                "model.max_seq_len=4096",
                "seed=3",
                "data.path=x.txt",
            ),
        )
        == []
    )
    assert incompatible_keys(base, _cfg(tmp_path, "moe.top_k=1", "data.tokenizer=char")) == [
        "data.tokenizer: 'byte' -> 'char'",
        "moe.top_k: 2 -> 1",
    ]


def test_incompatible_run_dir_is_refused_with_nothing_touched(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = _cfg(run)
    _write_checkpoints(cfg, steps=(2,))
    before = _snapshot(run)
    argv = [
        "configs/tiny.yaml",
        *TINY,
        "model.d_model=64",
        "model.ffn_hidden=48",
        "moe.expert_hidden=40",
        f"run_dir={run}",
    ]
    assert TRAIN_MAIN(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run_dir") and "model.d_model: 32 -> 64" in err
    assert err.count("\n") == 1
    assert _snapshot(run) == before


def test_non_run_directory_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("precious")
    assert TRAIN_MAIN([f"run_dir={tmp_path}", "train.steps=2", "train.warmup_steps=1"]) == 2
    assert "is not a moe_jax run directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_cli_bad_data_path_exits_2_without_traceback(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            f"data.path={tmp_path}/missing.txt",
            f"run_dir={run}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: data file") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run.exists()  # nothing written


CRASH_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
import grain._src.python.checkpoint.handler as grain_handler
from tests.test_checkpoint import _cfg, _write_checkpoints
from moe_jax.run.checkpoints import Checkpointer
cfg = _cfg({run!r})
_write_checkpoints(cfg, steps=(1,))
def die(*args, **kwargs):  # the process is killed while step 2 is being written
    os.kill(os.getpid(), signal.SIGKILL)
grain_handler.CheckpointHandler.save = die
_write_checkpoints(cfg, steps=(2,))
"""


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    script = textwrap.dedent(CRASH_SCRIPT).format(root=str(ROOT), run=str(run))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == -9, proc.stderr
    ckpt_dir = run / "checkpoints"
    leftovers = [p.name for p in ckpt_dir.iterdir() if "orbax-checkpoint-tmp" in p.name]
    assert leftovers and leftovers[0].startswith("2.")  # the save of step 2 was cut short

    cfg = _cfg(run)
    assert inspect_run(cfg).step == 1
    _, model, _ = load_run(run)
    _, state = init_state(cfg, make_optimizer(cfg.train))  # what step 1 saved
    _assert_trees_equal(nnx.state(model, nnx.Param), state["params"])
    Checkpointer(cfg).close()  # opening the run for training clears the unfinished save
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith("_")) == ["1"]


def _fill_the_disk_at(step: int, setattr=setattr, tensorstore: bool = False) -> None:
    """Make the save of checkpoint `step` fail with ENOSPC, in Orbax's background threads: in
    the metadata files it writes from Python (TensorStore writes the arrays, in C++, and
    reports ENOSPC as the ValueError that `tensorstore=True` raises instead)."""
    from orbax.checkpoint._src.path import async_path

    write_text = async_path.write_text

    async def full_disk(path, text):
        if f"/{step}.orbax-checkpoint-tmp" in str(path):
            if tensorstore:
                raise ValueError(
                    f'RESOURCE_EXHAUSTED: Error writing local file "{path}": Failed to write '
                    "6999 bytes to file 9: No space left on device [os_error_code='28']"
                )
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return await write_text(path, text)

    setattr(async_path, "write_text", full_disk)


NO_SPACE = (
    r"no space left on the device of '{run}' \(checkpoint 4 takes about 0\.\d MiB\); free space "
    r"there and rerun the same command: it resumes from checkpoint 2, the last complete one"
)


@pytest.mark.parametrize("async_save, tensorstore", [(True, False), (False, True)])
def test_a_full_disk_fails_the_save_in_one_error_and_keeps_the_previous_one(
    tmp_path, monkeypatch, async_save, tensorstore
):
    run = tmp_path / "run"
    cfg = _cfg(run, f"checkpoint.async_save={async_save}")
    _fill_the_disk_at(4, monkeypatch.setattr, tensorstore)
    with pytest.raises(SaveError, match=NO_SPACE.format(run=re.escape(str(run)))):
        _write_checkpoints(cfg, steps=(2, 4))  # async: raised when closing, which waits for it
    assert inspect_run(cfg).step == 2
    load_run(run)  # checkpoint 2 is whole
    assert not (run / "train.lock").exists()  # closed all the same


def test_a_full_disk_under_the_metrics_is_the_same_one_error(tmp_path, monkeypatch):
    """The metrics writers fill the same disk (and, after a failed save, may raise again as
    they close): their ENOSPC is the same one line."""
    from moe_jax.observe.writers import MetricsWriter

    def full_disk(self, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(MetricsWriter, "write", full_disk)
    run = tmp_path / "run"
    with pytest.raises(SaveError) as e:
        train(_cfg(run), stop_at=2)  # the first record is written before the first step
    assert str(e.value) == (
        f"no space left on the device of '{run}'; free space there and rerun the same "
        "command: no checkpoint is complete yet, so it starts again from step 0"
    )


FULL_DISK_SCRIPT = """
import runpy, sys
sys.path.insert(0, {root!r})
from moe_jax.process_setup import import_jax
import_jax()  # as train.py does, before this test module imports jax
from tests.test_checkpoint import _fill_the_disk_at
_fill_the_disk_at(4)
sys.exit(runpy.run_path({train!r})["main"]({argv!r}))
"""


def test_cli_full_disk_is_one_line_and_the_run_resumes_after(tmp_path):
    """A full disk while the async save of step 4 runs: Orbax logs each failed write with its
    traceback, and Python prints the coroutines it abandons at exit; what is left is one line,
    and the next run resumes from checkpoint 2."""
    run = tmp_path / "run"
    argv = ["configs/tiny.yaml", *TINY_BASE, *TINY, "checkpoint.every=2", f"run_dir={run}"]
    script = FULL_DISK_SCRIPT.format(root=str(ROOT), train=str(ROOT / "train.py"), argv=argv)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=subprocess_env(),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.fullmatch("error: " + NO_SPACE.format(run=re.escape(str(run))) + "\n", proc.stderr)
    assert sorted(p.name for p in (run / "checkpoints").glob("[0-9]*")) == [
        "2",
        "4.orbax-checkpoint-tmp",
    ]
    assert train(_cfg(run, "checkpoint.every=2"), stop_at=4).step == 4
    assert sorted(p.name for p in (run / "checkpoints").glob("[0-9]*")) == ["2", "4"]


def test_training_resumes_from_an_earlier_checkpoint_than_a_damaged_latest(tmp_path, capsys):
    run = tmp_path / "run"
    _write_checkpoints(_cfg(run), steps=(2, 5))
    _damage(run, 5, "params")
    assert TRAIN_MAIN(["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={run}"]) == 2
    assert "train.resume_step=2 to resume training from it" in capsys.readouterr().err
    damaged = _snapshot(run / "checkpoints" / "5")

    with pytest.raises(RunError, match=r"resume_step=3, but .* no checkpoint for step 3 \(saved"):
        train(_cfg(run, "train.resume_step=3"), stop_at=4)
    assert train(_cfg(run, "train.resume_step=2"), stop_at=3).step == 3
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [3]  # from 2
    assert sorted(p.name for p in (run / "checkpoints").glob("[0-9]*")) == ["2", "3"]
    moved = {
        p.relative_to(run / "superseded" / "5"): v
        for p, v in _snapshot(run / "superseded" / "5").items()
    }
    assert moved == {p.relative_to(run / "checkpoints" / "5"): v for p, v in damaged.items()}
    # The same command again (as after a SIGTERM) goes on from 3, not back to 2.
    assert train(_cfg(run, "train.resume_step=2"), stop_at=4).step == 4
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [3, 4]
    assert sorted(p.name for p in (run / "checkpoints").glob("[0-9]*")) == ["3", "4"]  # keep 2
    assert sorted(p.name for p in (run / "superseded").iterdir()) == ["5"]
