"""Orbax checkpoints of a run directory: saving and restoring them, reading a checkpoint's
meta, a damaged checkpoint named in one line, and Orbax's own noise kept off the terminal.

    ckpt = Checkpointer(cfg)     # locks the run dir, creates it (config.yaml) and its
                                 # CheckpointManager; RunError if another run holds it
    ckpt.save(step, params, opt_state, data_iterator, meta)      # async; keeps the last K
    params, opt_state = ckpt.restore(step, params_target, opt_target, data_iterator)
    ckpt.close()                 # waits for the last save, unlocks
    SaveError(RuntimeError)      # a checkpoint could not be written (disk full...); the one
                                 # before it is intact. train.py prints `error: ...`, exits 1.
    write_inference_run(out_dir, step, params, meta)   # a new params-only run (e.g. int8)

Crash safety: Orbax writes each checkpoint into `<step>.orbax-checkpoint-tmp-*` and renames it
to `<step>` only after every item is written, so a crash mid-save leaves the previous
checkpoints intact, and an unfinished temporary directory is never taken for a checkpoint
(it is deleted when the run is next opened for training). A save that fails (a full disk)
is reported as one SaveError line, and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import NoReturn

import grain
import jax
import orbax.checkpoint as ocp

from moe_jax.config import Config, ConfigError, config_from_yaml, config_to_yaml
from moe_jax.errors import MoeJaxError
from moe_jax.run.layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    ITEMS,
    SUPERSEDED_DIR,
    TOKENIZER_DIR,
    UNFINISHED_GLOB,
    RunError,
)
from moe_jax.run.lock import RunLock, make_dir, on_process_0
from moe_jax.run.output import (
    disk_problem,
    new_output,
    no_space,
    quiet_unraisable,
    raise_stop_in,
    signals_deferred,
    write_text,
)
from moe_jax.tokenizer import DataError, Tokenizer, tokenizer_from_dict
from moe_jax.tokenizer.files import SavedFilesError, holds, write_files


def _manager(run_dir: Path, **options) -> ocp.CheckpointManager:
    _quiet_orbax()
    return ocp.CheckpointManager(
        (run_dir / CHECKPOINT_DIR).absolute(),
        options=ocp.CheckpointManagerOptions(**options),
        item_names=ITEMS,
    )


# A reader's listing of the steps may race the deletions of a run training there; each try that
# meets one lists again (each try takes milliseconds, a checkpoint's save far longer).
LISTING_TRIES = 5


def read_only_manager(run_dir: Path) -> ocp.CheckpointManager | None:
    if not (run_dir / CHECKPOINT_DIR).is_dir():
        return None
    # Not `read_only=True`, which logs warnings on every use: a manager that is never asked to
    # save, creates no directory and writes no root metadata writes nothing.
    for _ in range(LISTING_TRIES - 1):
        try:
            return _manager(run_dir, create=False, save_root_metadata=False)
        except FileNotFoundError:  # a step listed was removed (by training) while read: again
            pass
    return _manager(run_dir, create=False, save_root_metadata=False)


def _is_orbax_leftover(unraisable) -> bool:
    """After a failed restore or save, Orbax's other array reads or writes fail too, in
    coroutines nobody awaits any more, and TensorStore's callbacks find the event loop closed.
    Python would print each one's traceback at exit, under the one-line error already given."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
        return "orbax" in code.co_filename
    e = unraisable.exc_value
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _keep_log_record(record: logging.LogRecord) -> bool:
    """Orbax logs each failure in a background save with its traceback (dozens for one full
    disk) before raising it in the main thread, where `Checkpointer` makes it one line; and
    it warns of a step directory without metadata when a reader lists the steps of a run that
    is deleting its oldest checkpoint: its WARNING and ERROR records are dropped."""
    return record.levelno < logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def _quiet_orbax() -> None:
    """Installed (process-wide, once) with the first CheckpointManager, before any restore or
    save can fail: the leftovers print from other threads as soon as one does. A leftover
    coroutine of jax's array serialisation (under Orbax's writes) that is collected unawaited
    is reported as a RuntimeWarning, not an unraisable exception: ignored too."""
    quiet_unraisable(_is_orbax_leftover)  # every other unraisable exception still prints
    warnings.filterwarnings(
        "ignore",
        message=r"coroutine '[^']*(serialize|write_fragment)[^']*' was never awaited",
        category=RuntimeWarning,
    )
    logging.getLogger("absl").addFilter(_keep_log_record)


def restore(manager: ocp.CheckpointManager, step: int, run_dir: Path, **items):
    """`manager.restore` of `items`, one item at a time (Orbax's composite handler reads them
    one after another too), so that a damaged checkpoint (missing or truncated files, bad
    JSON) becomes a RunError naming what cannot be read instead of Orbax's many-line
    traceback. A stop (SIGINT, SIGTERM) landing in the read, which Orbax wraps in a plain
    Exception, is raised as the stop: the checkpoint is whole, and its advice to read an
    earlier one would, on a resume, move the good ones to superseded/."""
    restored = {}
    for name, args in items.items():
        try:
            restored[name] = manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as e:
            read_failed(manager, step, run_dir, name, e)
    return ocp.args.Composite(**restored)


def read_failed(manager, step: int, run_dir: Path, item: str, e: Exception) -> NoReturn:
    """Raise what reading `item` of checkpoint `step` failing with `e` is: the stop that
    landed in it, the checkpoint removed meanwhile (CheckpointRemoved), or else damage
    (RunError naming what cannot be read, and the earlier checkpoint to read instead)."""
    _quiet_orphaned_tasks()
    raise_stop_in(e)  # a stop during the read (Orbax wraps it) is no damage
    if _being_removed(run_dir, step):
        raise CheckpointRemoved(
            f"checkpoint {step} in '{run_dir}' was removed while reading it (a run "
            "training there keeps only its newest checkpoint.keep checkpoints); read "
            "again for the newest, or name a step it keeps"
        ) from None
    raise RunError(_damaged(manager, step, run_dir, item, e)) from None


def _being_removed(run_dir: Path, step: int, wait_s: float = 2.0) -> bool:
    """Whether checkpoint `step` is gone, or going: training deletes an old checkpoint file by
    file once it has saved a newer one, so a read can fail on a directory still there."""
    step_dir = run_dir / CHECKPOINT_DIR / str(step)
    newer = any(p.name.isdigit() and int(p.name) > step for p in step_dir.parent.iterdir())
    deadline = time.monotonic() + (wait_s if newer else 0.0)
    while step_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not step_dir.exists()


class CheckpointRemoved(RunError):
    """The checkpoint being read was deleted meanwhile: a training run keeping only its
    newest `checkpoint.keep` saved a newer one. Not damage: the newest reads fine."""


def _quiet_orphaned_tasks() -> None:
    """After a failed restore, TensorStore's reads still in flight end as asyncio tasks
    whose exceptions no one retrieves; asyncio logs each (86-305 lines in 5 of 12 runs under
    the one-line error). Drop those records from then on: the error that matters is told."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedTasks) for f in logger.filters):
        logger.addFilter(_OrphanedTasks())


class _OrphanedTasks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Task exception was never retrieved")


# TensorStore's errors start with a status (NOT_FOUND, DATA_LOSS, ...) and quote what it failed
# on, an array's metadata or a chunk: a key of OCDBT's database ("embed.embedding.value/.zarray",
# "head.value/0.1"), or a file path ending so (a plain zarr array's: an import's).
_ARRAY_ERROR = re.compile(
    r'^([A-Z_]+): .*?"(?:[^"]*/)?([^"/]+)/(?:\.zarray|zarr\.json|[\d.]+)"', re.S
)


def _damaged(manager: ocp.CheckpointManager, step: int, run_dir: Path, item: str, e) -> str:
    """What of checkpoint `step` cannot be read (an array, a file, or else the `item` whose
    restore raised `e`), and which earlier checkpoint to use instead."""
    text = str(e).split(" See full TensorStore")[0].strip()
    if m := _ARRAY_ERROR.match(text):
        what = f"array '{m[2].removesuffix('.value')}' of its {item} cannot be read ({m[1]})"
    else:
        # A JSON error carries the text it failed on, not the file: find the file by it.
        item_dir = run_dir / CHECKPOINT_DIR / str(step) / item
        doc = getattr(e, "doc", None)
        files = sorted(f for f in item_dir.glob("*") if f.is_file()) if doc else []
        bad = next((f"'{f}'" for f in files if f.read_text(errors="replace") == doc), None)
        why = f"{type(e).__name__}: {(text.splitlines() or [''])[0][:200]}"
        what = f"{bad or f'its {item}'} cannot be read ({why})"
    saved = sorted(manager.all_steps())
    earlier = [s for s in saved if s < step]
    fix = (
        f"use an earlier checkpoint (saved steps: {saved}): --step {earlier[-1]} to sample, "
        f"quantise or export it, train.resume_step={earlier[-1]} to resume training from it "
        f"(the later ones are moved to {SUPERSEDED_DIR}/ in the run)"
        if earlier
        else "it is the run's only checkpoint: train again in a new run_dir"
    )
    return f"checkpoint {step} in '{run_dir}' is damaged: {what}; {fix}"


def read_meta(manager: ocp.CheckpointManager, step: int, run_dir: Path) -> dict:
    meta = restore(manager, step, run_dir, meta=ocp.args.JsonRestore()).meta
    try:
        meta["config"] = config_from_yaml(meta["config"])
        meta["tokenizer"] = tokenizer_from_dict(meta["tokenizer"], run_dir / TOKENIZER_DIR)
    except SavedFilesError as e:
        raise RunError(f"checkpoint {step} in '{run_dir}': {e}") from None
    except (ConfigError, DataError, KeyError) as e:
        raise RunError(
            f"checkpoint {step} in '{run_dir}' has an unreadable config or tokenizer ({e}); "
            "it was written by an incompatible version of moe_jax"
        ) from None
    return meta


def open_checkpoints(run_dir: Path, step: int | None) -> tuple[ocp.CheckpointManager, int]:
    """The run's checkpoint manager and the step asked for (default: the latest)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"'{run_dir}' is a file, not a run directory; pass a run directory")
    if not run_dir.is_dir():
        raise RunError(
            f"run directory '{run_dir}' does not exist; train one with "
            f"`python train.py run_dir={run_dir}`"
        )
    for _ in range(LISTING_TRIES):
        manager = read_only_manager(run_dir)
        steps = sorted(manager.all_steps()) if manager else []
        # None listed, yet one there now: the listing met the old step going and the new one
        # not yet finished (a run training there); list again.
        if steps or not any(p.name.isdigit() for p in (run_dir / CHECKPOINT_DIR).glob("*")):
            break
    if not steps:
        raise RunError(
            f"no checkpoint in '{run_dir}'; train (or resume) with "
            f"`python train.py run_dir={run_dir}` until a checkpoint is saved"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise RunError(f"no checkpoint for step {step} in '{run_dir}'; saved steps: {steps}")
    return manager, step


# The params' chunks on disk are at most this large (Orbax's default chunk is each device's
# whole shard): the streaming HF export (interop/export.py) reads a tensor by decoding only
# the chunks it touches, so this bounds its memory whatever the mesh that saved the run.
PARAMS_CHUNK_BYTES = 1 << 26


def chunked(params):
    """Orbax save args for `params`: chunks of at most PARAMS_CHUNK_BYTES."""
    return jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=PARAMS_CHUNK_BYTES), params)


class SaveError(MoeJaxError, RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the ones before it are
    intact, and training resumes from the latest of them."""

    exit_code = 1  # the run is fine up to its last complete checkpoint


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


def _supersede(run_dir: Path, step: int) -> None:
    """Move the checkpoints after `step` to RUN_DIR/superseded, so that the training resumed
    from `step` saves its own (Orbax refuses to write a step that exists)."""
    later = [p for p in (run_dir / CHECKPOINT_DIR).iterdir() if p.name.isdigit()]
    later = [p for p in later if int(p.name) > step]
    dest = run_dir / SUPERSEDED_DIR
    taken = [dest / p.name for p in later if (dest / p.name).exists()]
    if taken:
        raise RunError(
            f"'{taken[0]}' exists (from an earlier train.resume_step); move or delete it, "
            "then rerun"
        )
    if later:
        dest.mkdir(exist_ok=True)
    for p in later:
        p.rename(dest / p.name)


def keep_tokenizer_files(run_dir: Path, tokenizer: Tokenizer, checkpointed: bool) -> None:
    """Write a file tokenizer's files to RUN_DIR/tokenizer (atomically) unless they are there
    already. Other files there are left by a start with another tokenizer that saved no
    checkpoint (replaced), or, if the run has checkpoints (`checkpointed`), were changed under
    it (RunError: they are what those checkpoints need)."""
    if not tokenizer.files:
        return
    target = run_dir / TOKENIZER_DIR
    if holds(target, tokenizer.files):
        return
    if target.exists():
        if checkpointed:
            raise RunError(
                f"'{target}' holds other files than the tokenizer this run trains with, and the "
                "run's checkpoints need them; put the original files back, or train in a new "
                "run_dir"
            )
        shutil.rmtree(target)
    write_files(tokenizer.files, target)


def write_inference_run(out_dir: str | Path, step: int, params, meta: dict) -> None:
    """A new run directory holding one checkpoint of `params` only (no optimizer or data
    state), e.g. a quantised copy; `meta` as for `Checkpointer.save`, plus "quantization" and
    "source". Written into a temporary sibling and renamed when complete, so `out_dir` holds
    the whole run or does not exist; an existing `out_dir` is refused, never touched."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise RunError(f"'{out_dir}' already exists; choose a new directory")
    with new_output(out_dir, f"'{out_dir}'") as tmp:
        comment = f"# {meta['quantization']} copy of {meta['source']}: inference only\n"
        (tmp / CONFIG_FILE).write_text(comment + config_to_yaml(meta["config"]), encoding="utf-8")
        keep_tokenizer_files(tmp, meta["tokenizer"], checkpointed=False)
        meta = meta | {
            "step": step,
            "config": config_to_yaml(meta["config"]),
            "tokenizer": meta["tokenizer"].to_dict(),
        }
        # Orbax writes from threads of its own: a stop raised into the main thread mid-save
        # left them writing into the sibling being removed (partial files stayed behind; once
        # a C++ abort). So the save is not cut: a signal during it acts once it returns.
        with signals_deferred():
            manager = _manager(tmp, enable_async_checkpointing=False)
            manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)
                ),
            )
            manager.close()


class Checkpointer:
    """Saves and restores a training run's checkpoints in `cfg.run_dir`.

    Opening one locks the run directory (`RunLock`, held by process 0 until `close()`),
    creates it, writes config.yaml when the run is new, removes unfinished temporary
    checkpoint directories left by a crash mid-save, and moves the checkpoints after
    `supersede_after` (the step an earlier than latest resume starts from) to
    RUN_DIR/superseded.
    """

    def __init__(self, cfg: Config, supersede_after: int | None = None, run_dir=None):
        # `run_dir`: where to write, if not cfg.run_dir (import writes a temporary sibling
        # that becomes cfg.run_dir when complete)
        self.run_dir = Path(run_dir if run_dir is not None else cfg.run_dir)
        make_dir(self.run_dir, "run_dir")
        self._lock = on_process_0(lambda: self._open(cfg, supersede_after), self.run_dir)
        c = cfg.checkpoint
        self.manager = _manager(
            self.run_dir, max_to_keep=c.keep, enable_async_checkpointing=c.async_save
        )
        self._saving: int | None = None  # the step of the save last started
        self._bytes = 0  # of its arrays: about a checkpoint's size

    def _open(self, cfg: Config, supersede_after: int | None) -> RunLock:
        """Process 0's part of opening: lock the run directory, then prepare it."""
        lock = RunLock(self.run_dir)
        try:
            config_file = self.run_dir / CONFIG_FILE
            if not config_file.exists():  # whole or not at all: a full disk leaves none
                try:
                    write_text(config_file, config_to_yaml(cfg))
                except OSError as e:
                    if problem := disk_problem(e):
                        raise RunError(
                            f"cannot write '{config_file}' ({problem}); free some space there"
                        ) from None
                    raise
            for unfinished in (self.run_dir / CHECKPOINT_DIR).glob(UNFINISHED_GLOB):
                shutil.rmtree(unfinished)
            if supersede_after is not None:
                _supersede(self.run_dir, supersede_after)
        except BaseException:
            lock.release()
            raise
        return lock

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, data_iterator, meta: dict) -> None:
        """Start saving `step` (returns once arrays are copied off the device when async).

        meta: JSON-able dict with at least "config" (a Config) and "tokenizer" (a Tokenizer;
        a file tokenizer's files go to RUN_DIR/tokenizer first, see `keep_tokenizer_files`).
        """
        tokenizer = meta["tokenizer"]
        meta = meta | {
            "step": step,
            "config": config_to_yaml(meta["config"]),
            "tokenizer": tokenizer.to_dict(),
        }
        self.wait()  # Orbax would wait here too: a failure of the previous save is its own
        self._saving = step
        self._bytes = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
        try:
            if jax.process_index() == 0:  # the run's own files are process 0's to write
                checkpointed = self.manager.latest_step() is not None
                keep_tokenizer_files(self.run_dir, tokenizer, checkpointed)
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params, save_args=chunked(params)),
                    opt_state=ocp.args.StandardSave(opt_state),
                    data=grain.checkpoint.CheckpointSave(data_iterator),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except RunError:
            raise
        except Exception as e:
            raise_stop_in(e)  # a stop is no failed save
            raise self.save_error(e) from None

    def restore(self, step: int, params_target, opt_target, data_iterator):
        """-> (params, opt_state) of `step`, laid out like the targets (abstract arrays with
        shardings); `data_iterator` is moved to the saved position in place. A params-only
        checkpoint (an import's) gives opt_state None and leaves the iterator at its start."""
        step_dir = self.run_dir / CHECKPOINT_DIR / str(step)
        if not (step_dir / "opt_state").is_dir():
            args = ocp.args.StandardRestore(params_target)
            return restore(self.manager, step, self.run_dir, params=args).params, None
        data_files = (step_dir / "data").glob("process_*.json")
        counts = {f.stem.rpartition("-of-")[2] for f in data_files}
        if counts and str(jax.process_count()) not in counts:
            n = ", ".join(sorted(counts))
            raise RunError(
                f"checkpoint {step} in '{self.run_dir}' was saved by {n} processes, each with "
                f"its own data position; resume it with {n} processes (mesh.num_processes={n})"
            )
        restored = restore(
            self.manager,
            step,
            self.run_dir,
            params=ocp.args.StandardRestore(params_target),
            opt_state=ocp.args.StandardRestore(opt_target),
            data=grain.checkpoint.CheckpointRestore(data_iterator),
        )
        return restored.params, restored.opt_state

    def wait(self) -> None:
        """Wait for the save in flight to finish; SaveError if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # Orbax raises a failure once, so close() after it succeeds
            raise_stop_in(e)  # a stop is no failed save
            raise self.save_error(e) from None
        self._saving = None

    def save_error(self, e: Exception) -> SaveError:
        """The one-line error for `e`: a failed save, or a full disk under the run's files."""
        last = self.manager.latest_step()  # Orbax forgets a step whose save failed
        resumes = (
            f"it resumes from checkpoint {last}, the last complete one"
            if last is not None
            else "no checkpoint is complete yet, so it starts again from step 0"
        )
        ckpt = f"checkpoint {self._saving}" if self._saving is not None else "a checkpoint"
        if no_space(e):
            size = f" ({ckpt} takes about {_size(self._bytes)})" if self._bytes else ""
            return SaveError(
                f"no space left on the device of '{self.run_dir}'{size}; free space there and "
                f"rerun the same command: {resumes}"
            )
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return SaveError(
            f"{ckpt} could not be written in '{self.run_dir}' ({type(e).__name__}: "
            f"{first_line}); fix that and rerun the same command: {resumes}"
        )

    def close(self) -> None:
        """Wait for the last save (SaveError if it failed), then unlock the run directory."""
        try:
            self.wait()
        finally:
            self.manager.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
