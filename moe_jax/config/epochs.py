"""A run's length in passes over its data (`train.epochs`) instead of steps.

    steps = epoch_steps(3, 10, 8)          # 4: ceil(3 x 10 pairs / 8 a step)
    cfg = with_epochs(cfg, rows=10, unit="pairs")   # train.steps that count, train.epochs null

A fine-tune's size is known in rows only once its data is read (SFT's packed windows, DPO's
pairs, GRPO's prompts: one batch row each), so the trainer turns epochs into steps then.
A step reads train.batch_size rows whatever train.grad_accum is (the micro-batches split
them), so grad_accum changes no count. The resolved config holds the steps and no epochs:
what a checkpoint saves says how long the run is, and reading it back is no config that
sets both. The data iterators shuffle each epoch afresh and run on across its end, so the
last step's batch may begin the next epoch: the count is rounded up, never down.
"""

from __future__ import annotations

import dataclasses
import math

from moe_jax.config.checks import ConfigError
from moe_jax.config.tree import Config, validate


def epoch_steps(epochs: float, rows: int, batch_size: int) -> int:
    """The steps of `epochs` passes over `rows` batch rows at `batch_size` rows a step (at
    least one)."""
    return max(1, math.ceil(epochs * rows / batch_size - 1e-9))  # 3 x 8 / 8 is 3, not 4


def with_epochs(cfg: Config, rows: int, unit: str) -> Config:
    """`cfg` with train.epochs turned into train.steps over `rows` (`unit`: "pairs",
    "prompts", "windows", for the message), validated again (warmup, wsd's decay and the
    profile window against the steps they now have); `cfg` itself without train.epochs."""
    t = cfg.train
    if t.epochs is None:
        return cfg
    steps = epoch_steps(t.epochs, rows, t.batch_size)
    resolved = dataclasses.replace(cfg, train=dataclasses.replace(t, steps=steps, epochs=None))
    try:
        validate(resolved)
    except ConfigError as e:
        raise ConfigError(
            f"train.epochs={t.epochs:g} over {rows:,} {unit} at train.batch_size={t.batch_size} "
            f"is {steps} steps, and then {e}"
        ) from None
    return resolved
