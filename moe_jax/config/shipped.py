"""The configs shipped with moe_jax, found by name.

    config_path("tiny")                          # configs/tiny.yaml
    config_path("recipes/mixtral_8x7b_v5p128")   # configs/recipes/mixtral_8x7b_v5p128.yaml
    config_path("my_exp.yaml")                   # a file of one's own: taken as it is

In a clone (or an editable install) the configs are the clone's `configs/`; an installed wheel
carries the same files as package data, `moe_jax/configs/` (pyproject.toml maps the one onto
the other), so `moe-jax-train tiny` works from any directory. A path that exists wins over a
name: a file of one's own is never shadowed by a shipped one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from moe_jax.config.checks import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent  # moe_jax/ (this file: moe_jax/config/shipped.py)
# The wheel's copy first: in an installed wheel PACKAGE.parent is site-packages, whose
# `configs/` (if some other distribution left one there) is none of ours.
SEARCH = (PACKAGE / "configs", PACKAGE.parent / "configs")


def configs_dir() -> Path:
    """The directory of the shipped configs (the wheel's, else the clone's)."""
    for d in SEARCH:
        if (d / "tiny.yaml").is_file():
            return d
    raise FileNotFoundError(f"no shipped configs found (looked in {', '.join(map(str, SEARCH))})")


def names() -> list[str]:
    """The shipped configs' names: tiny, mixtral_8x7b, recipes/..., without .yaml."""
    root = configs_dir()
    found = [p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml")]
    # configs/eval holds lm-evaluation-harness task files, not training configs
    return sorted(n for n in found if not n.startswith("eval/"))


def config_path(name: str) -> Path:
    """The config file `name` means: an existing file as it is, else a shipped config by name
    (with or without .yaml, with or without a leading `configs/`). FileNotFoundError, naming
    the shipped configs, for neither."""
    given = Path(name)
    if given.is_file():
        return given
    stem = name.removeprefix("configs/").removesuffix(".yaml")
    root = configs_dir()
    candidate = root / f"{stem}.yaml"
    if stem and candidate.is_file() and stem in names():
        return candidate
    raise FileNotFoundError(
        f"config '{name}' is neither a file nor a shipped config; shipped: {', '.join(names())}"
    )


def config_argv(argv: Sequence[str]) -> list[str]:
    """argv with its config name, if it starts with one, made the config file's path; an
    unknown name is a ConfigError, as a bad config is."""
    args = list(argv)
    if args and "=" not in args[0]:
        try:
            args[0] = str(config_path(args[0]))
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
    return args
