"""Typed configuration tree: dataclass schema <- YAML file <- dotted command-line overrides.

OmegaConf does the merging and type coercion against the dataclass schema; each section
checks its own fields (`model.py`: model, attention, moe; `run.py`: data, train, mesh,
checkpoint, sample, eval; `lora.py`, `rl.py`), `Config.check` (`tree.py`) the checks across
sections, and every failure is one
`ConfigError` whose message names the problem and the fix. The result is a tree of frozen
(hence hashable) dataclasses, so a config can be a static argument to `jax.jit`. Reading one
from YAML and overrides, and writing it back: `loading.py`.

    cfg = load_config("configs/tiny.yaml", ["model.n_layers=4", "moe.capacity_factor=1.25"])
"""

from __future__ import annotations

from moe_jax.config.checks import ConfigError
from moe_jax.config.loading import (
    SAMPLING_OVERRIDES,
    cli_config,
    cli_given_keys,
    config_from_yaml,
    config_to_yaml,
    given_keys,
    load_config,
    sampling_config,
)
from moe_jax.config.lora import LORA_TARGETS, LoRAConfig
from moe_jax.config.mesh import MESH_AXES, MeshConfig
from moe_jax.config.model import (
    DTYPES,
    REMAT_NAMES,
    REMAT_POLICIES,
    AttentionConfig,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
)
from moe_jax.config.rl import RLConfig
from moe_jax.config.run import (
    DEFAULT_WARMUP_STEPS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SAMPLING_RANGES,
    SCHEDULES,
    SFT_FORMATS,
    WEIGHT_KINDS,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    SampleConfig,
    TrainConfig,
    sampling_problem,
)
from moe_jax.config.tree import Config, check_context, check_lora_targets, lora_groups, validate

__all__ = [
    "check_context",
    "check_lora_targets",
    "lora_groups",
    "DEFAULT_WARMUP_STEPS",
    "DTYPES",
    "MAX_TEMPERATURE",
    "MESH_AXES",
    "MIN_TEMPERATURE",
    "REMAT_NAMES",
    "REMAT_POLICIES",
    "SAMPLING_OVERRIDES",
    "SAMPLING_RANGES",
    "SCHEDULES",
    "SFT_FORMATS",
    "WEIGHT_KINDS",
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LORA_TARGETS",
    "LoRAConfig",
    "RLConfig",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeScalingConfig",
    "SampleConfig",
    "TrainConfig",
    "cli_config",
    "cli_given_keys",
    "given_keys",
    "config_from_yaml",
    "config_to_yaml",
    "load_config",
    "sampling_config",
    "sampling_problem",
    "validate",
]
