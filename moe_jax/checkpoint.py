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

    resume = inspect_run(cfg)    # read-only: None for a new run, else the latest step and its
                                 # saved config/tokenizer; RunError if cfg cannot continue it
    ckpt = Checkpointer(cfg)     # creates the run dir (config.yaml) and its CheckpointManager
    ckpt.save(step, params, opt_state, data_iterator, meta)      # async; keeps the last K
    params, opt_state = ckpt.restore(step, params_target, opt_target, data_iterator)

Layout of a run directory:

    RUN_DIR/config.yaml           the config the run was started with (marks a run directory)
    RUN_DIR/checkpoints/<step>/   one Orbax checkpoint per saved step, items:
        params/     the model's nnx.Param state        (Orbax PyTree, sharded arrays)
        opt_state/  the optax state                     (Orbax PyTree)
        data/       the Grain iterator position, one JSON file per process
        meta/       resolved config (YAML text), tokenizer, corpus fingerprint (JSON)
    RUN_DIR/metrics.jsonl, RUN_DIR/tb/   metrics (see moe_jax/metrics.py)

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
(it is deleted when the run is next opened for training).

Compatibility: a run directory can be continued with a config that differs only in training
settings and in the keys of `RESUMABLE_CHANGES`; any other difference in the `model`,
`attention` or `moe` sections, or in `data.tokenizer`, changes what the parameters mean, so
the run directory is refused (before anything is written).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from moe_jax.config import Config, ConfigError, config_from_yaml, config_to_yaml
from moe_jax.data import DataError, Tokenizer, tokenizer_from_dict

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
UNFINISHED_GLOB = "*.orbax-checkpoint-tmp*"  # Orbax's name for a checkpoint being written
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
    """After a failed restore, Orbax's other array reads fail too, in coroutines nobody awaits
    any more, and TensorStore's callbacks find the restore's event loop closed. Python would
    print each one's traceback at exit, under the one-line error already given."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
        return "orbax" in code.co_filename
    e = unraisable.exc_value
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _drop_orbax_leftovers() -> None:
    """Installed before the first restore (the leftovers print from other threads, as soon as
    it fails); every other unraisable exception still prints."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_orbax_leftovers", False):
        return

    def hook(unraisable):
        if not _is_orbax_leftover(unraisable):
            previous(unraisable)

    hook.drops_orbax_leftovers = True
    sys.unraisablehook = hook


def _restore(manager: ocp.CheckpointManager, step: int, run_dir: Path, **items):
    """`manager.restore` of `items`; a damaged checkpoint (missing or truncated files, bad
    JSON) becomes a RunError naming it instead of Orbax's many-line traceback."""
    _drop_orbax_leftovers()
    try:
        return manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
        lines = str(e).split(" See full TensorStore")[0].strip().splitlines() or [""]
        earlier = [s for s in manager.all_steps() if s < step]
        fix = (
            f"use an earlier one (saved steps: {sorted(manager.all_steps())}): --step "
            f"{max(earlier)} to sample, quantise or export it, or move "
            f"'{run_dir / CHECKPOINT_DIR / str(step)}' aside to resume training from it"
            if earlier
            else "it is the run's only checkpoint: train again in a new run_dir"
        )
        raise RunError(
            f"checkpoint {step} in '{run_dir}' is damaged and cannot be read "
            f"({type(e).__name__}: {lines[0][:200]}); {fix}"
        ) from None


def _read_meta(manager: ocp.CheckpointManager, step: int, run_dir: Path) -> dict:
    meta = _restore(manager, step, run_dir, meta=ocp.args.JsonRestore()).meta
    try:
        meta["config"] = config_from_yaml(meta["config"])
        meta["tokenizer"] = tokenizer_from_dict(meta["tokenizer"])
    except (ConfigError, DataError, KeyError) as e:
        raise RunError(
            f"checkpoint {step} in '{run_dir}' has an unreadable config or tokenizer ({e}); "
            "it was written by an incompatible version of moe_jax"
        ) from None
    return meta


def inspect_run(cfg: Config) -> Resume | None:
    """What `cfg.run_dir` holds, without writing anything: None for a new (or empty, or
    never-checkpointed but compatible) run dir, else the latest checkpoint to resume from."""
    run_dir = Path(cfg.run_dir)
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise RunError(f"run_dir '{run_dir}' is a file; choose a directory for run_dir")
    config_file = run_dir / CONFIG_FILE
    if not config_file.is_file():
        if any(run_dir.iterdir()):
            raise RunError(
                f"run_dir '{run_dir}' is not empty and holds no {CONFIG_FILE}, so it is not a "
                "moe_jax run directory; choose a new or empty run_dir"
            )
        return None
    manager = _read_only_manager(run_dir)
    steps = manager.all_steps() if manager else []
    if steps:
        meta = _read_meta(manager, max(steps), run_dir)
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
    return Resume(max(steps), saved, meta["tokenizer"], meta.get("fingerprint", ""))


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


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Config, nnx.Module, Tokenizer]:
    """(config, Transformer with the checkpoint's params on the host, tokenizer)."""
    from moe_jax.model import Transformer  # imported here: the model imports the config only

    run_dir = Path(run_dir)
    manager, step = _open_run(run_dir, step)
    meta = _read_meta(manager, step, run_dir)
    cfg = meta["config"]
    build = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    if meta.get("quantization"):
        from moe_jax.quantize import QUANTIZATIONS, quantize_model  # it imports this module

        mode = meta["quantization"]
        if mode not in QUANTIZATIONS:
            raise RunError(
                f"checkpoint {step} in '{run_dir}' is quantised as '{mode}', which this "
                "version of moe_jax does not know"
            )
        build = lambda: quantize_model(Transformer(cfg, rngs=nnx.Rngs(0)), mode)
    graphdef, abstract_params = nnx.split(nnx.eval_shape(build), nnx.Param)
    target = on_device(abstract_params, jax.devices()[0])
    restored = _restore(manager, step, run_dir, params=ocp.args.StandardRestore(target))
    return cfg, nnx.merge(graphdef, restored.params), meta["tokenizer"]


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
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    make_dir(out_dir.parent, "the output directory's parent")
    make_dir(tmp, "a temporary directory next to the output")  # not tempfile.mkdtemp: umask
    try:
        comment = f"# {meta['quantization']} copy of {meta['source']}: inference only\n"
        (tmp / CONFIG_FILE).write_text(comment + config_to_yaml(meta["config"]), encoding="utf-8")
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


def make_dir(path: Path, what: str) -> None:
    """mkdir -p, with an OSError (a file in the way, no permission) as a one-line RunError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = "a file of that name is in the way" if path.is_file() else e.strerror
        raise RunError(
            f"cannot create {what} '{path}' ({reason}); choose a writable path"
        ) from None


class Checkpointer:
    """Saves and restores a training run's checkpoints in `cfg.run_dir`.

    Opening one creates the run directory, writes config.yaml when the run is new, and
    removes unfinished temporary checkpoint directories left by a crash mid-save.
    """

    def __init__(self, cfg: Config):
        self.run_dir = Path(cfg.run_dir)
        make_dir(self.run_dir, "run_dir")
        config_file = self.run_dir / CONFIG_FILE
        if not config_file.exists() and jax.process_index() == 0:
            config_file.write_text(config_to_yaml(cfg), encoding="utf-8")
        if jax.process_index() == 0:
            for unfinished in (self.run_dir / CHECKPOINT_DIR).glob(UNFINISHED_GLOB):
                shutil.rmtree(unfinished)
        c = cfg.checkpoint
        self.manager = _manager(
            self.run_dir, max_to_keep=c.keep, enable_async_checkpointing=c.async_save
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, data_iterator, meta: dict) -> None:
        """Start saving `step` (returns once arrays are copied off the device when async).

        meta: JSON-able dict with at least "config" (a Config) and "tokenizer" (a Tokenizer).
        """
        meta = meta | {
            "step": step,
            "config": config_to_yaml(meta["config"]),
            "tokenizer": meta["tokenizer"].to_dict(),
        }
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
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
