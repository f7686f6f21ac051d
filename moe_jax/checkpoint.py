"""Run directories and Orbax checkpoints.

Public API:

    cfg, model, tokenizer = load_run("runs/tiny")            # latest checkpoint, params on host
    cfg, model, tokenizer = load_run("runs/tiny", step=200)  # a given step
        # cfg: the resolved Config saved with the checkpoint; model: a `Transformer` with the
        # checkpoint's params; tokenizer: the run's tokenizer (`.encode(text)`, `.decode(ids)`).
    RunError(ValueError)   # missing run dir, no checkpoint, unknown step, incompatible config;
                           # CLIs print `error: <message>` and exit 2.
    meta = read_run_meta("runs/tiny")    # {"step", "config", "tokenizer", "fingerprint", ...}
    write_inference_run(out_dir, step, params, meta)   # a new params-only run (e.g. int8)

    resume = inspect_run(cfg)    # read-only: None for a new run, else the latest step (or
                                 # train.resume_step) and its saved config/tokenizer; RunError
                                 # if cfg cannot continue it
    ckpt = Checkpointer(cfg)     # locks the run dir, creates it (config.yaml) and its
                                 # CheckpointManager; RunError if another run holds it
    ckpt.save(step, params, opt_state, data_iterator, meta)      # async; keeps the last K
    params, opt_state = ckpt.restore(step, params_target, opt_target, data_iterator)
    ckpt.close()                 # waits for the last save, unlocks
    SaveError(RuntimeError)      # a checkpoint could not be written (disk full...); the one
                                 # before it is intact. train.py prints `error: ...`, exits 1.

Layout of a run directory:

    RUN_DIR/config.yaml           the config the run was started with (marks a run directory)
    RUN_DIR/tokenizer/            a file tokenizer's files (tokenizer.json or tokenizer.model and
                                  its config files), written before the first checkpoint; each
                                  checkpoint's meta records their SHA-256s, checked on loading,
                                  so the run directory is self-contained (copy or move it whole)
    RUN_DIR/checkpoints/<step>/   one Orbax checkpoint per saved step, items:
        params/     the model's nnx.Param state        (Orbax PyTree, sharded arrays)
        opt_state/  the optax state                     (Orbax PyTree)
        data/       the Grain iterator position, one JSON file per process
        meta/       resolved config (YAML text), tokenizer, corpus fingerprint (JSON)
    RUN_DIR/metrics.jsonl, RUN_DIR/tb/   metrics (see moe_jax/metrics.py)
    RUN_DIR/train.lock            while a run trains: its pid and host (see `RunLock`)
    RUN_DIR/superseded/<step>/    checkpoints after the one `train.resume_step` resumed from

An inference-only run (`python -m moe_jax.quantize`) has the same layout with `params/` and
`meta/` only; its meta says `"quantization": "int8"` (config.yaml says so in a comment), so
`load_run` rebuilds the quantised model, and training it is refused.

The step is the checkpoint's directory name. Training draws no random numbers after
initialisation (no dropout; the params seed is used once), and the data order is Grain's
seeded index shuffle, so the random state to restore is fully described by the saved config's
`seed` plus the iterator position in `data/`.

Crash safety: Orbax writes each checkpoint into `<step>.orbax-checkpoint-tmp-*` and renames it
to `<step>` only after every item is written, so a crash mid-save leaves the previous
checkpoints intact, and an unfinished temporary directory is never taken for a checkpoint
(it is deleted when the run is next opened for training). A save that fails (a full disk)
is reported as one SaveError line, and the previous checkpoint stays the latest.

One writer: `Checkpointer` holds the run's `RunLock` from opening to `close()`, so a second
training process on the same run_dir stops before writing anything. Readers (`load_run`,
hence sampling, quantising and exporting) take no lock: they can read a run that is training.

Compatibility: a run directory can be continued with a config that differs only in training
settings and in the keys of `RESUMABLE_CHANGES`; any other difference in the `model`,
`attention` or `moe` sections, or in `data.tokenizer`, changes what the parameters mean, so
the run directory is refused (before anything is written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from moe_jax.config import Config, ConfigError, config_from_yaml, config_to_yaml
from moe_jax.model.int8 import QUANTIZATIONS
from moe_jax.sharding import INFERENCE_RULES, state_shardings
from moe_jax.tokenizer import DataError, Tokenizer, tokenizer_from_dict
from moe_jax.tokenizer.files import SavedFilesError, holds, write_files
from moe_jax.weights import WeightsDoNotFit, abstract_model, check_fits, to_kind, weights_kind

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
UNFINISHED_GLOB = "*.orbax-checkpoint-tmp*"  # Orbax's name for a checkpoint being written
SUPERSEDED_DIR = "superseded"  # where train.resume_step moves the checkpoints after its step
LOCK_FILE = "train.lock"
TOKENIZER_DIR = "tokenizer"  # a file tokenizer's files (moe_jax/tokenizer/files.py)
ITEMS = ("params", "opt_state", "data", "meta")

# Architecture keys that may change when resuming: none of them changes the parameters' shapes
# or what they mean (context length, compute dtype, layer scan on/off, init scale, MoE
# capacity and aux-loss weights are run-time or training choices).
RESUMABLE_CHANGES = frozenset(
    {
        "model.max_seq_len",
        "model.dtype",
        "model.scan_layers",
        "model.init_std",
        "moe.capacity_factor",
        "moe.lb_loss_weight",
        "moe.z_loss_weight",
    }
)
ARCHITECTURE_SECTIONS = ("model", "attention", "moe")


class RunError(ValueError):
    """A run directory that cannot be used as asked; the message names the fix."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def incompatible_keys(saved: Config, requested: Config) -> list[str]:
    """'key: saved -> requested' for each difference that forbids resuming `saved`."""
    a, b = dataclasses.asdict(saved), dataclasses.asdict(requested)
    fa = _flat(
        {s: a[s] for s in ARCHITECTURE_SECTIONS} | {"data": {"tokenizer": a["data"]["tokenizer"]}}
    )
    fb = _flat(
        {s: b[s] for s in ARCHITECTURE_SECTIONS} | {"data": {"tokenizer": b["data"]["tokenizer"]}}
    )
    return [
        f"{k}: {fa[k]!r} -> {fb[k]!r}"
        for k in sorted(fa)
        if fa[k] != fb[k] and k not in RESUMABLE_CHANGES
    ]


# ----------------------------------------------------------------------------- reading runs


@dataclass(frozen=True)
class Resume:
    step: int
    config: Config  # the config saved with that checkpoint
    tokenizer: Tokenizer
    fingerprint: str  # of the corpus the run was trained on


def _manager(run_dir: Path, **options) -> ocp.CheckpointManager:
    _quiet_orbax()
    return ocp.CheckpointManager(
        (run_dir / CHECKPOINT_DIR).absolute(),
        options=ocp.CheckpointManagerOptions(**options),
        item_names=ITEMS,
    )


def _read_only_manager(run_dir: Path) -> ocp.CheckpointManager | None:
    if not (run_dir / CHECKPOINT_DIR).is_dir():
        return None
    # Not `read_only=True`, which logs warnings on every use: a manager that is never asked to
    # save, creates no directory and writes no root metadata writes nothing.
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


def _drop_orbax_leftovers() -> None:
    """Every unraisable exception but Orbax's leftovers still prints."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_orbax_leftovers", False):
        return

    def hook(unraisable):
        if not _is_orbax_leftover(unraisable):
            previous(unraisable)

    hook.drops_orbax_leftovers = True
    sys.unraisablehook = hook


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
    _drop_orbax_leftovers()
    warnings.filterwarnings(
        "ignore",
        message=r"coroutine '[^']*(serialize|write_fragment)[^']*' was never awaited",
        category=RuntimeWarning,
    )
    logging.getLogger("absl").addFilter(_keep_log_record)


def _restore(manager: ocp.CheckpointManager, step: int, run_dir: Path, **items):
    """`manager.restore` of `items`, one item at a time (Orbax's composite handler reads them
    one after another too), so that a damaged checkpoint (missing or truncated files, bad
    JSON) becomes a RunError naming what cannot be read instead of Orbax's many-line
    traceback."""
    restored = {}
    for name, args in items.items():
        try:
            restored[name] = manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as e:
            raise RunError(_damaged(manager, step, run_dir, name, e)) from None
    return ocp.args.Composite(**restored)


# TensorStore's errors start with a status (NOT_FOUND, DATA_LOSS, ...) and quote the key it
# failed on in the item's database: an array's metadata or one of its chunks, e.g.
# "embed.embedding.value/.zarray" or "head.value/0.1".
_ARRAY_ERROR = re.compile(r'^([A-Z_]+): .*?"([^"/]+)/(?:\.zarray|zarr\.json|[\d.]+)"', re.S)


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


def _read_meta(manager: ocp.CheckpointManager, step: int, run_dir: Path) -> dict:
    meta = _restore(manager, step, run_dir, meta=ocp.args.JsonRestore()).meta
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


def inspect_run(cfg: Config) -> Resume | None:
    """What `cfg.run_dir` holds, without writing anything: None for a new (or empty, or
    never-checkpointed but compatible) run dir, else the checkpoint to resume from: the
    latest, or the one `train.resume_step` names unless the latest was saved after resuming
    from it."""
    run_dir = Path(cfg.run_dir)
    manager = _read_only_manager(run_dir)
    steps = sorted(manager.all_steps()) if manager else []
    wanted = cfg.train.resume_step
    if wanted and wanted not in steps:
        raise RunError(
            f"train.resume_step={wanted}, but '{run_dir}' holds no checkpoint for step "
            f"{wanted} (saved steps: {steps}); choose a saved step, or drop train.resume_step"
        )
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise RunError(f"run_dir '{run_dir}' is a file; choose a directory for run_dir")
    config_file = run_dir / CONFIG_FILE
    if not config_file.is_file():
        # A lock file alone: a run killed before it wrote its config (or starting right now).
        if any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            raise RunError(
                f"run_dir '{run_dir}' is not empty and holds no {CONFIG_FILE}, so it is not a "
                "moe_jax run directory; choose a new or empty run_dir"
            )
        return None
    step = steps[-1] if steps else None
    if wanted and wanted != step and not _resumed_from(wanted, manager, step, run_dir):
        step = wanted
    if step is not None:
        meta = _read_meta(manager, step, run_dir)
        saved = meta["config"]
        if meta.get("quantization"):
            raise RunError(
                f"run_dir '{run_dir}' holds a {meta['quantization']} copy of a run for "
                f"inference only; train the float run it came from ({meta.get('source')})"
            )
    else:
        meta = None
        try:
            saved = config_from_yaml(config_file.read_text(encoding="utf-8"))
        except ConfigError as e:
            raise RunError(
                f"'{config_file}' is not a valid config ({e}); fix or remove it"
            ) from None
    diffs = incompatible_keys(saved, cfg)
    if diffs and meta is None:
        raise RunError(
            f"run_dir '{run_dir}' has no checkpoint, only the {CONFIG_FILE} of a run that "
            f"stopped before its first save, with a different architecture "
            f"({'; '.join(diffs)}); delete '{run_dir}' or choose a new run_dir"
        )
    if diffs:
        raise RunError(
            f"run_dir '{run_dir}' holds a run with a different architecture "
            f"({'; '.join(diffs)}); its parameters cannot be continued with this config: "
            "choose a new run_dir or drop these overrides"
        )
    if meta is None:
        return None
    return Resume(step, saved, meta["tokenizer"], meta.get("fingerprint", ""))


def _resumed_from(wanted: int, manager: ocp.CheckpointManager, step: int, run_dir: Path) -> bool:
    """Whether checkpoint `step` was saved by a run that `train.resume_step=wanted` resumed:
    rerunning that command (after a SIGTERM, say) goes on from `step` then, not back again."""
    try:
        return _read_meta(manager, step, run_dir)["config"].train.resume_step == wanted
    except RunError:  # damaged, as the latest checkpoint often is when resume_step is given
        return False


def _open_run(run_dir: Path, step: int | None) -> tuple[ocp.CheckpointManager, int]:
    """The run's checkpoint manager and the step asked for (default: the latest)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"'{run_dir}' is a file, not a run directory; pass a run directory")
    if not run_dir.is_dir():
        raise RunError(
            f"run directory '{run_dir}' does not exist; train one with "
            f"`python train.py run_dir={run_dir}`"
        )
    manager = _read_only_manager(run_dir)
    steps = sorted(manager.all_steps()) if manager else []
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


def read_run_meta(run_dir: str | Path, step: int | None = None) -> dict:
    """The checkpoint's meta (latest or `step`): "step", "config" (a Config), "tokenizer",
    "fingerprint", and "quantization" / "source" for an inference-only copy."""
    run_dir = Path(run_dir)
    manager, step = _open_run(run_dir, step)
    return _read_meta(manager, step, run_dir) | {"step": step}


def load_run(
    run_dir: str | Path,
    step: int | None = None,
    *,
    cfg: Config | None = None,
    mesh: jax.sharding.Mesh | None = None,
    weights: str = "float32",
) -> tuple[Config, nnx.Module, Tokenizer]:
    """(config, Transformer with the checkpoint's params, tokenizer).

    `cfg`: the run's config with inference-time changes (mesh, model.dtype, sample.*; see
    `config.sampling_config`), else the saved one. `mesh`: restore each weight straight onto it,
    sharded by `sharding.INFERENCE_RULES` (no device or host ever holds a whole copy),
    else onto the first device. `weights`: the form to restore the weights in
    (`moe_jax.weights`: float32, bfloat16, int8, auto); a run written by `moe_jax.quantize`
    is int8 whatever it says. Float weights are cast as they are read; int8 of a float run is
    quantised after a float restore (bf16 where the compute is), which holds both forms for
    a moment. RunError before anything is read if the weights would not fit the devices."""
    run_dir = Path(run_dir)
    manager, step = _open_run(run_dir, step)
    meta = _read_meta(manager, step, run_dir)
    saved = meta["config"]
    if cfg is None:
        cfg = saved
    elif changed := incompatible_keys(saved, cfg):
        raise RunError(
            f"{', '.join(changed)} differ(s) from the run's saved config; a run's architecture "
            "is fixed by its checkpoint"
        )
    quantized = meta.get("quantization")
    if quantized and quantized not in QUANTIZATIONS:
        raise RunError(
            f"checkpoint {step} in '{run_dir}' is quantised as '{quantized}', which this "
            "version of moe_jax does not know"
        )
    kind = weights_kind(cfg, weights)
    # What is restored: int8 runs as int8; a float run as `auto` floats, quantised afterwards.
    restore_kind = weights_kind(cfg, "auto") if kind == "int8" else kind
    graphdef, abstract_params = nnx.split(abstract_model(cfg, restore_kind, quantized), nnx.Param)
    if mesh is None:
        target = on_device(abstract_params, jax.devices()[0])
    else:
        shardings = state_shardings(abstract_params, mesh, INFERENCE_RULES)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_params,
            shardings,
        )
    try:
        check_fits(target, also=kind if kind == "int8" and not quantized else None)
    except WeightsDoNotFit as e:
        raise RunError(f"run '{run_dir}': {e}") from None
    restored = _restore(manager, step, run_dir, params=ocp.args.StandardRestore(target))
    model = nnx.merge(graphdef, restored.params)
    if kind == "int8" and not quantized:
        model = to_kind(model, "int8")
    return cfg, model, meta["tokenizer"]


def restore_params(run_dir: str | Path, step: int | None, target):
    """A checkpoint's params (latest or `step`) restored into `target`: abstract arrays with
    the shardings (and dtypes) to restore onto. Read-only, like `load_run`."""
    run_dir = Path(run_dir)
    manager, step = _open_run(run_dir, step)
    try:
        return _restore(manager, step, run_dir, params=ocp.args.StandardRestore(target)).params
    finally:
        manager.close()


def on_device(abstract_tree, device: jax.Device):
    """Restore target: each leaf's shape and dtype, placed whole on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_tree
    )


# ----------------------------------------------------------------------------- writing runs


def write_inference_run(out_dir: str | Path, step: int, params, meta: dict) -> None:
    """A new run directory holding one checkpoint of `params` only (no optimizer or data
    state), e.g. a quantised copy; `meta` as for `Checkpointer.save`, plus "quantization" and
    "source". Written into a temporary sibling and renamed when complete, so `out_dir` holds
    the whole run or does not exist; an existing `out_dir` is refused, never touched."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise RunError(f"'{out_dir}' already exists; choose a new directory")
    tmp = make_temp_sibling(out_dir)
    try:
        comment = f"# {meta['quantization']} copy of {meta['source']}: inference only\n"
        (tmp / CONFIG_FILE).write_text(comment + config_to_yaml(meta["config"]), encoding="utf-8")
        keep_tokenizer_files(tmp, meta["tokenizer"], checkpointed=False)
        meta = meta | {
            "step": step,
            "config": config_to_yaml(meta["config"]),
            "tokenizer": meta["tokenizer"].to_dict(),
        }
        manager = _manager(tmp, enable_async_checkpointing=False)
        manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)
            ),
        )
        manager.close()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def make_dir(path: Path, what: str) -> None:
    """mkdir -p, with an OSError (a file in the way, no permission) as a one-line RunError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = "a file of that name is in the way" if path.is_file() else e.strerror
        raise RunError(
            f"cannot create {what} '{path}' ({reason}); choose a writable path"
        ) from None


def make_temp_sibling(out: Path) -> Path:
    """A new empty directory next to `out`, to write into and rename to `out` when complete.
    Not `tempfile.mkdtemp`, whose mode 700 the renamed output would keep: this one gets the
    user's umask, like any directory they create."""
    make_dir(out.parent, "the output directory's parent")
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    make_dir(tmp, "a temporary directory next to the output")
    return tmp


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk or a used-up quota: free space there


class SaveError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the ones before it are
    intact, and training resumes from the latest of them."""


def no_space(e: BaseException | None) -> bool:
    """Whether `e` or what caused it is a full disk: an OSError from Python, or a ValueError
    from TensorStore that names the OS error code."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return True
        if any(f"os_error_code='{code}'" in str(e) for code in NO_SPACE):
            return True
        e = e.__cause__ or e.__context__
    return False


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


class RunLock:
    """The right to train in a run directory: an exclusive `fcntl.flock` on RUN_DIR/train.lock
    from `RunLock(run_dir)` to `release()`; RunError if another process holds it.

    The kernel drops a flock when its holder exits, however it dies (kill -9, the OOM killer),
    so the lock file of a dead run is free by construction and simply taken over. The file
    records the holder's pid and host for the message of a run refused, and is removed on
    release. On NFS, Linux emulates flock with NFS byte-range locks, which exclude other hosts
    too; there the lock of a client that dies holds until the server notices (NFSv4: one lease
    time, typically 90 s).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunError(
                    f"cannot create the lock file '{self.path}' ({e.strerror}); choose a "
                    "writable run_dir"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 512).decode(errors="replace").strip() or "pid not written yet"
                os.close(fd)
                raise RunError(
                    f"run_dir '{run_dir}' is in use by another training run ({holder}); wait "
                    "for it to finish or stop it (SIGTERM saves a checkpoint), or choose "
                    "another run_dir"
                ) from None
            except OSError as e:
                os.close(fd)
                raise RunError(
                    f"cannot lock '{self.path}' ({e.strerror}); choose a run_dir on a "
                    "filesystem with file locks"
                ) from None
            # A holder removes the file as it lets go: a lock taken on the removed file just
            # after that would exclude no one, so lock the file now at that path instead.
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = f"pid {os.getpid()} on host {socket.gethostname()}, since {since}"
        # On a full disk (a rerun after a failed save) even this may not fit: the lock holds
        # without it, and opening the run goes on to delete the failed save's files.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, holder.encode())
        self._fd = fd

    def release(self) -> None:
        self.path.unlink(missing_ok=True)  # while still locked: see the check above
        os.close(self._fd)


def _on_process_0(open_run, run_dir: Path) -> RunLock | None:
    """`open_run()` on process 0 only, the one that writes the run's own files and holds its
    lock. In a multi-process run the others learn whether it succeeded (a collective, which
    also waits for it), so that all of them stop on its RunError instead of waiting for
    process 0 in the next collective."""
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = open_run()
        except RunError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if multihost_utils.broadcast_one_to_all(np.int32(error is not None)) and error is None:
            error = RunError(
                f"process 0 could not open run_dir '{run_dir}' for training; its error line "
                "says why and what to do"
            )
    if error is not None:
        raise error
    return lock


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


class Checkpointer:
    """Saves and restores a training run's checkpoints in `cfg.run_dir`.

    Opening one locks the run directory (`RunLock`, held by process 0 until `close()`),
    creates it, writes config.yaml when the run is new, removes unfinished temporary
    checkpoint directories left by a crash mid-save, and moves the checkpoints after
    `supersede_after` (the step an earlier than latest resume starts from) to
    RUN_DIR/superseded.
    """

    def __init__(self, cfg: Config, supersede_after: int | None = None):
        self.run_dir = Path(cfg.run_dir)
        make_dir(self.run_dir, "run_dir")
        self._lock = _on_process_0(lambda: self._open(cfg, supersede_after), self.run_dir)
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
            if not config_file.exists():
                config_file.write_text(config_to_yaml(cfg), encoding="utf-8")
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
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                    data=grain.checkpoint.CheckpointSave(data_iterator),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        except RunError:
            raise
        except Exception as e:
            raise self.save_error(e) from None

    def restore(self, step: int, params_target, opt_target, data_iterator):
        """-> (params, opt_state) of `step`, laid out like the targets (abstract arrays with
        shardings); `data_iterator` is moved to the saved position in place."""
        data_files = (self.run_dir / CHECKPOINT_DIR / str(step) / "data").glob("process_*.json")
        counts = {f.stem.rpartition("-of-")[2] for f in data_files}
        if counts and str(jax.process_count()) not in counts:
            n = ", ".join(sorted(counts))
            raise RunError(
                f"checkpoint {step} in '{self.run_dir}' was saved by {n} processes, each with "
                f"its own data position; resume it with {n} processes (mesh.num_processes={n})"
            )
        restored = _restore(
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
