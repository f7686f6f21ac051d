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
