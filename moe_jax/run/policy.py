"""What a training run may do with a run directory: start it, resume it (from which
checkpoint), or be refused, and why.

Compatibility: a run directory can be continued with a config that differs only in training
settings and in the keys of `RESUMABLE_CHANGES`; any other difference in the `model`,
`attention` or `moe` sections, or in `data.tokenizer`, changes what the parameters mean, so
the run directory is refused (before anything is written).

The step is the checkpoint's directory name. Training draws no random numbers after
initialisation (no dropout; the params seed is used once), and the data order is Grain's
seeded index shuffle, so the random state to restore is fully described by the saved config's
`seed` plus the iterator position in `data/`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import orbax.checkpoint as ocp

from moe_jax.config import Config, ConfigError, config_from_yaml
from moe_jax.run.checkpoints import read_meta, read_only_manager
from moe_jax.run.layout import CONFIG_FILE, LOCK_FILE, RunError
from moe_jax.tokenizer import Tokenizer

# Architecture keys that may change when resuming (or starting from another run): none of
# them changes the parameters' shapes or what they mean. Context length, compute dtype, layer
# scan on/off, init scale, MoE capacity and aux-loss weights are run-time or training
# choices; the kernels, the MoE exchange, the row chunks and the remat policy decide how a
# step computes, not what.
RESUMABLE_CHANGES = frozenset(
    {
        "model.max_seq_len",
        "model.dtype",
        "model.scan_layers",
        "model.init_std",
        "model.remat",
        "model.remat_save",
        "model.remat_offload",
        "attention.impl",
        "moe.impl",
        "moe.exchange",
        "moe.row_chunks",
        "moe.recv_factor",
        "moe.capacity_factor",
        "moe.lb_loss_weight",
        "moe.z_loss_weight",
        "moe.bias_update_rate",
    }
)


ARCHITECTURE_SECTIONS = ("model", "attention", "moe")


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


@dataclass(frozen=True)
class Resume:
    step: int
    config: Config  # the config saved with that checkpoint
    tokenizer: Tokenizer
    fingerprint: str  # of the corpus the run was trained on


def inspect_run(cfg: Config) -> Resume | None:
    """What `cfg.run_dir` holds, without writing anything: None for a new (or empty, or
    never-checkpointed but compatible) run dir, else the checkpoint to resume from: the
    latest, or the one `train.resume_step` names unless the latest was saved after resuming
    from it."""
    run_dir = Path(cfg.run_dir)
    manager = read_only_manager(run_dir)
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
        meta = read_meta(manager, step, run_dir)
        check_compatible(meta, cfg, "train", run_dir)
        return Resume(step, meta["config"], meta["tokenizer"], meta.get("fingerprint", ""))
    try:
        saved = config_from_yaml(config_file.read_text(encoding="utf-8"))
    except ConfigError as e:
        raise RunError(f"'{config_file}' is not a valid config ({e}); fix or remove it") from None
    if diffs := incompatible_keys(saved, cfg):
        raise RunError(
            f"run_dir '{run_dir}' has no checkpoint, only the {CONFIG_FILE} of a run that "
            f"stopped before its first save, with a different architecture "
            f"({'; '.join(diffs)}); delete '{run_dir}' or choose a new run_dir"
        )
    return None


def check_compatible(
    meta: dict, cfg: Config, purpose: str, where: Path, same=lambda diff: False
) -> None:
    """RunError, naming the fix, unless the checkpoint of `meta` can serve `cfg` for `purpose`:
    "train" (resume it in `where`), "start" (init_from `where`: a new run from its params) or
    "load" (inference). A quantised copy serves inference only; the architecture must be
    `cfg`'s (every difference `incompatible_keys` lists, less those `same` accepts)."""
    quantized = meta.get("quantization")
    if quantized and purpose == "train":
        raise RunError(
            f"run_dir '{where}' holds a {quantized} copy of a run for inference only; train "
            f"the float run it came from ({meta.get('source')})"
        )
    if quantized and purpose == "start":
        raise RunError(
            f"init_from '{where}' holds an {quantized} copy of a run, for inference only; start "
            f"from the float run it came from ({meta.get('source')})"
        )
    saved = meta["config"].train.optimizer
    if purpose == "train" and saved != cfg.train.optimizer:  # train/muon.py: another state
        raise RunError(
            f"run_dir '{where}' was trained with train.optimizer={saved}, whose state its "
            f"checkpoints hold; resume it with train.optimizer={saved}, or switch in a new run "
            f"from its params: `train.py {where}/config.yaml init_from={where} run_dir=NEW "
            f"train.optimizer={cfg.train.optimizer}`"
        )
    diffs = [d for d in incompatible_keys(meta["config"], cfg) if not same(d)]
    if not diffs:
        return
    if purpose == "train":
        raise RunError(
            f"run_dir '{where}' holds a run with a different architecture "
            f"({'; '.join(diffs)}); its parameters cannot be continued with this config: "
            "choose a new run_dir or drop these overrides"
        )
    if purpose == "start":
        raise RunError(
            f"init_from '{where}' is a run of another architecture ({'; '.join(diffs)}); "
            "the new run takes the source's architecture: drop these overrides"
        )
    raise RunError(
        f"{', '.join(diffs)} differ(s) from the run's saved config; a run's architecture "
        "is fixed by its checkpoint"
    )


def _resumed_from(wanted: int, manager: ocp.CheckpointManager, step: int, run_dir: Path) -> bool:
    """Whether checkpoint `step` was saved by a run that `train.resume_step=wanted` resumed:
    rerunning that command (after a SIGTERM, say) goes on from `step` then, not back again."""
    try:
        return read_meta(manager, step, run_dir)["config"].train.resume_step == wanted
    except RunError:  # damaged, as the latest checkpoint often is when resume_step is given
        return False
