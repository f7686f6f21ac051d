"""The config's error and the small checks every section's `check` is written with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, is_dataclass

from moe_jax.errors import MoeJaxError

INT32_MAX = 2**31 - 1  # sizes and counts index int32 arrays
SEEDS = ("seed", "sample.seed")
SEED_LIMIT = 2**32  # PRNG keys take 32 bits: larger seeds would collide


class ConfigError(MoeJaxError, ValueError):
    """An impossible or malformed configuration; the message says what to change."""


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def one_of(value: str, allowed: Sequence[str], key: str) -> None:
    require(value in allowed, f"{key}='{value}' is not supported; use one of {', '.join(allowed)}")


def positive(obj: object, section: str, names: Sequence[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        require(v > 0, f"{section}.{n} must be positive, got {v}")


def non_negative(obj: object, section: str, names: Sequence[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        require(v >= 0, f"{section}.{n} must be >= 0, got {v}")


def numbers_in_range(obj: object, prefix: str = "") -> None:
    """Every float of the config is finite and every int fits the arrays it sizes."""
    for f in fields(obj):
        v, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(v):
            numbers_in_range(v, f"{key}.")
        elif isinstance(v, float):
            require(math.isfinite(v), f"{key} must be a finite number, got {v}")
        elif isinstance(v, int) and not isinstance(v, bool):
            if key in SEEDS:
                require(0 <= v < SEED_LIMIT, f"{key} must be within [0, 2^32), got {v}")
            else:
                require(abs(v) <= INT32_MAX, f"{key} must be within +-{INT32_MAX:,}, got {v}")


MXFP4_BLOCK = 32  # MXFP4 scales blocks of 32 values (moe_jax/model/fp4.py's BLOCK)


def check_mxfp4(cfg) -> None:
    """MXFP4 experts (`sample.weights=mxfp4`, `quantize --mode mxfp4`) fit the model's dims:
    checked on the config, before a checkpoint is read."""
    m = cfg.model
    require(
        not (m.d_model % MXFP4_BLOCK or cfg.moe.expert_hidden % MXFP4_BLOCK),
        f"mxfp4 packs the experts' inputs in blocks of {MXFP4_BLOCK}; model.d_model "
        f"({m.d_model}) and moe.expert_hidden ({cfg.moe.expert_hidden}) must be multiples "
        "of it: quantise to int8 instead",
    )


def check_inference(cfg) -> None:
    """What sampling, serving, evaluating and compiling the decode step need of a run's
    config (after the sampling overrides), before any weight is read: the one check every
    one of those commands makes (`load.load_sampler`, `aot --step decode`)."""
    m, s = cfg.model, cfg.sample
    if s.weights == "mxfp4":
        check_mxfp4(cfg)
    if s.speculative:
        require(
            m.mtp_depth > 0,
            "sample.speculative drafts with the model's MTP module, and this model has none "
            "(model.mtp_depth=0); train with model.mtp_depth=1, or sample without it",
        )
        depth = s.draft_depth
        require(
            depth is None or 1 <= depth <= m.mtp_depth,
            f"sample.draft_depth {depth} is not within [1, {m.mtp_depth}] (the model's MTP "
            f"depths, model.mtp_depth={m.mtp_depth}); set it to at most {m.mtp_depth}",
        )
