"""The jitted programs a training run builds, kept for the rest of the process.

A second `train()` of the same model in one process (a stopped run resumed, a sweep in a
notebook, a test that checks resuming) reuses the first one's jitted initialiser, train and
eval steps (and GRPO's rollout sampler): jax's own cache then finds the compiled program by
the function, so nothing is traced, lowered or compiled again. Without this every run builds
new functions, and a tiny model's restart spends ~2 s of its ~3 s tracing and lowering them
again (the persistent compilation cache only skips the XLA compile, after the lowering it is
keyed by).

A program is kept under what it is built from: the config (less `run_dir` and the other keys
that only the loop reads: `config_key`) and the state's layout. The model's graph and the
optimizer are not in the key: the trainer builds both from the config alone
(`train.step.init_program`, `make_optimizer`), so the same key means the same graph and
optimizer (and the graph holds the config, `run_dir` included, so it would tell two
directories' runs apart). Whoever changes what a program reads outside its arguments (tests
patching module constants) calls `forget()` first; tests/conftest.py does.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax

from moe_jax.config import Config

KEEP = 8  # programs at most: a sweep's older configs let go (each holds its executable)
_kept: OrderedDict[Hashable, object] = OrderedDict()


def config_key(cfg: Config) -> Config:
    """`cfg` as a program's key: the same for two runs that differ only in what the loop
    alone reads (where the run lives, the checkpoint it resumes from, how often it logs and
    saves, where the metrics go), none of which a traced program reads."""
    train = dataclasses.replace(cfg.train, resume_step=0, log_every=1, trackers=())
    checkpoint = dataclasses.replace(cfg.checkpoint, every=1, keep=1)
    return dataclasses.replace(cfg, run_dir="", train=train, checkpoint=checkpoint)


def layout_key(tree) -> Hashable:
    """A pytree of shardings (or None) as a hashable key."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


def kept(name: str, cfg: Config, build: Callable[..., Any], *layout) -> Any:
    """The program `name` kept for `cfg` (`config_key`) and `layout` (meshes, pytrees of
    shardings, flags: what else it is built from), or `build(*layout)`'s, kept from now on."""
    full = (name, config_key(cfg), *map(layout_key, layout))
    if full in _kept:
        _kept.move_to_end(full)
        return _kept[full]
    program = _kept[full] = build(*layout)
    while len(_kept) > KEEP:
        _kept.popitem(last=False)
    return program


def forget() -> None:
    """Drop every kept program (their next use builds and traces them anew)."""
    _kept.clear()
