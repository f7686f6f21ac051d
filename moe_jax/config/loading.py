"""A `Config` from a YAML file and dotted command-line overrides (OmegaConf merges them and
coerces types against the dataclass schema), back to and from YAML, the keys a user gave, and
the config sampling may change of a saved run."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from moe_jax.config.checks import ConfigError
from moe_jax.config.tree import Config, validate


def _suggest(key: str, parent_path: str, parent: object) -> str:
    """The hint after an unknown key: the closest key of its section, else the closest key of
    any section (a key given in the wrong section, or without one), by its full dotted name."""
    prefix = f"{parent_path}." if parent_path else ""
    names = [f.name for f in fields(parent)] if is_dataclass(parent) else []
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    from moe_jax.config.reference import keys

    leaves = {k.name.rpartition(".")[2]: k.name for k in keys()}  # last part -> dotted
    close = difflib.get_close_matches(key, leaves, n=1)
    if close:
        return f"; did you mean '{leaves[close[0]]}'?"
    if len(names) > 16:  # a long section: its listing, with types and defaults, is one command
        return f"; its section's keys: moe-jax train --help-config {parent_path}"
    listed = ", ".join(prefix + n for n in names)
    return f"; valid keys: {listed} (every key: moe-jax train --help-config)"


def _node_at(path: str) -> object:
    node: object = Config
    for part in path.split(".") if path else []:
        sub = {f.name: f for f in fields(node)}.get(part) if is_dataclass(node) else None
        if sub is None:
            return None
        node = sub.default_factory() if callable(sub.default_factory) else sub.default
    return node() if isinstance(node, type) else node


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    full_key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError) and full_key:
        parent, _, key = full_key.rpartition(".")
        hint = _suggest(key, parent, _node_at(parent))
        return ConfigError(f"unknown config key '{full_key}' in {source}{hint}")
    first_line = str(err).splitlines()[0]
    where = f" for '{full_key}'" if full_key else ""
    return ConfigError(f"bad config value{where} in {source}: {first_line}")


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, default_file: bool = False
) -> Config:
    """Schema defaults <- YAML file at `path` <- `key.sub=value` overrides, then validated.
    `default_file`: `path` is the CLI's default config, which the user did not name: its
    train.steps then gives way to a train.epochs of the overrides (`_one_length`)."""
    cfg = OmegaConf.structured(Config)
    file_cfg = None
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(
                f"config file '{path}' does not exist; pass a YAML file from configs/"
            )
        if not path.is_file():
            raise ConfigError(f"config path '{path}' is not a file; pass a YAML file from configs/")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as e:  # yaml.YAMLError and friends
            detail = " ".join(str(e).split())
            raise ConfigError(f"config file '{path}' is not valid YAML: {detail}") from None
        if not isinstance(file_cfg, type(OmegaConf.create({}))):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
        try:
            cfg = OmegaConf.merge(cfg, file_cfg)  # file_cfg kept: which keys the file sets
        except OmegaConfBaseException as e:
            raise _explain(e, str(path)) from None
    cfg = _merge_overrides(cfg, overrides)
    _one_length(cfg, None if default_file else file_cfg, path, overrides)
    if path is not None and _is_source_config(path, OmegaConf.select(cfg, "init_from")):
        cfg = _without_run_keys(cfg, overrides, path)
    return _validated(cfg)


# What belongs to one run, not to its model or its training recipe: a run's saved config
# holds them, and a new run started from that file (init_from) must not carry them over.
PER_RUN_KEYS = ("run_dir", "init_step", "train.resume_step", "train.profile_start",
                "train.profile_steps", "train.trackers", "train.tracker_project",
                "train.tracker_uri", "checkpoint.export_hf")  # fmt: skip
RUN_CONFIG_FILE = "config.yaml"  # a run directory's saved config (run/layout.py CONFIG_FILE)


def _is_source_config(path: Path, init_from: str | None) -> bool:
    """Whether `path` is the saved config of the run `init_from` names."""
    return (
        init_from is not None
        and path.name == RUN_CONFIG_FILE
        and path.resolve().parent == Path(init_from).resolve()
    )


def _without_run_keys(cfg, overrides: Sequence[str], path: Path):
    """`cfg` read from a source run's own config: its PER_RUN_KEYS the defaults again, but
    those the overrides set; run_dir must be one of those (the file's is the source's)."""
    given = {item.partition("=")[0] for item in overrides}
    if "run_dir" not in given:
        raise ConfigError(
            f"{path} is the saved config of init_from's run, whose run_dir is that run's own; "
            "name the new run's directory with run_dir=NEW"
        )
    defaults = OmegaConf.to_container(OmegaConf.structured(Config))
    again = OmegaConf.create()
    for key in PER_RUN_KEYS:
        if key not in given:
            section, _, name = key.rpartition(".")
            value = defaults[section][name] if section else defaults[name]
            OmegaConf.update(again, key, value, force_add=True)
    return OmegaConf.merge(cfg, again)


def _one_length(cfg, file_cfg, path, overrides: Sequence[str]) -> None:
    """A run's length is train.steps or train.epochs: ConfigError, naming where each was
    set, when the named file (`file_cfg`; None: none, or the unnamed default, whose steps
    the epochs replace) or the overrides set both."""
    epochs = OmegaConf.select(cfg, "train.epochs")
    if epochs is None:
        return
    said = [f"{i.partition('=')[2]} on the command line" for i in overrides
            if i.partition("=")[0] == "train.steps"]  # fmt: skip
    in_file = None if file_cfg is None else OmegaConf.select(file_cfg, "train.steps")
    if in_file is not None and not said:
        said = [f"{in_file} in {path}"]
    if not said:
        return
    raise ConfigError(
        f"train.steps ({said[-1]}) and train.epochs ({epochs:g}) are both set; a run's length "
        "is one of them: drop train.steps, or set train.epochs=null to train for the steps"
    )


def _validated(cfg) -> Config:
    """The OmegaConf config as a validated Config."""
    try:
        result = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _explain(e, "config") from None
    validate(result)
    return result


def _merge_overrides(cfg, overrides: Sequence[str]):
    """An OmegaConf config <- `key.sub=value` overrides, each checked against the schema."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            value = item.partition("=")[2]
            if "is not a TupleConfig" not in str(e) or value.startswith("["):
                raise _explain(e, f"override '{item}'") from None
            # a list key given bare names: train.trackers=wandb,mlflow
            cfg = _merge_overrides(cfg, [f"{key}=[{value}]"])
        except yaml.YAMLError as e:  # the value is parsed as YAML: `{`, `,,` ...
            detail = " ".join(str(e).split())
            raise ConfigError(
                f"override '{item}' has a value that is not valid YAML ({detail}); put the "
                f"value in double quotes inside the argument: '{key}=\"...\"'"
            ) from None
    return cfg


# What sampling may change in a run's saved config: where and how it runs, not what the
# weights mean (the mesh, the compute dtype, the sample section).
SAMPLING_OVERRIDES = ("mesh.", "sample.", "model.dtype=")


def sampling_config(saved: Config, overrides: Sequence[str]) -> Config:
    """A run's saved config <- sampling overrides (SAMPLING_OVERRIDES only), validated. Call
    with `saved=Config()` to check overrides before a run is read."""
    for item in overrides:
        if not item.startswith(SAMPLING_OVERRIDES):
            key = item.partition("=")[0]
            raise ConfigError(
                f"'{key}' cannot be set when sampling: the run's checkpoint fixes it; set "
                "mesh.*, model.dtype or sample.* (e.g. mesh.expert=2 sample.weights=int8)"
            )
    return _validated(_merge_overrides(OmegaConf.structured(saved), overrides))


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_yaml(text: str) -> Config:
    """Inverse of `config_to_yaml` (used for configs saved inside run directories)."""
    try:
        saved = _renamed_keys(OmegaConf.create(text))
        merged = OmegaConf.merge(OmegaConf.structured(Config), saved)
        result = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _explain(e, "saved config") from None
    validate(result)
    return result


def _renamed_keys(saved):
    """A saved config with the keys of earlier versions renamed: train.tensorboard (a bool)
    became train.trackers (a list)."""
    train = saved.get("train") if hasattr(saved, "get") else None
    if train is not None and "tensorboard" in train:
        tensorboard = train.pop("tensorboard")
        if "trackers" not in train:
            train.trackers = ["tensorboard"] if tensorboard else []
    return saved


def given_keys(path: str | Path | None, overrides: Sequence[str] = ()) -> frozenset[str]:
    """The dotted keys that the YAML file at `path` (None: no file) and the `key=value`
    overrides set: what the user chose, as against what the schema's defaults left (a Hugging
    Face checkpoint's family then sets those: `interop.as_run.with_run_keys`)."""
    keys = {item.partition("=")[0] for item in overrides}
    if path is not None:
        keys |= _dotted(OmegaConf.to_container(OmegaConf.load(path)))
    return frozenset(keys)


def _dotted(tree, prefix: str = "") -> set[str]:
    """The dotted paths of the leaves of a nested dict."""
    if not isinstance(tree, dict):
        return {prefix[:-1]}
    return set().union(*(_dotted(v, f"{prefix}{k}.") for k, v in tree.items()))


def cli_given_keys(argv: Sequence[str]) -> frozenset[str]:
    """The keys a CLI's `[CONFIG.yaml] [key=value ...]` sets: the named file's and the
    overrides' (a default config the user did not name sets none)."""
    args = list(argv)
    path = args.pop(0) if args and "=" not in args[0] else None
    return given_keys(path, args)


def cli_config(argv: Sequence[str], default_path: str | Path | None) -> Config:
    """For the CLIs: `[CONFIG.yaml] [key=value ...]`; a bad config prints one line and exits 2."""
    args = list(argv)
    path, named = default_path, bool(args and "=" not in args[0])
    if named:
        path = args.pop(0)
    try:
        return load_config(path, args, default_file=path == default_path and not named)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
