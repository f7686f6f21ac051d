"""Config loading: every validation error's message, precedence, round trip, the shipped configs.

Budget: ~5 s (one parametrised load per error case, three short CLI subprocesses).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_jax.config import (
    Config,
    ConfigError,
    config_from_yaml,
    config_to_yaml,
    load_config,
)
from moe_jax.config.shipped import names as shipped_names

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def load_error(overrides: list[str], path: Path | str = TINY) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert "\n" not in msg, f"error message is not one line: {msg!r}"
    return msg


# ----------------------------------------------------------------------------- schema errors


def test_unknown_key_suggests_the_closest_name():
    msg = load_error(["model.n_layrs=2"])
    assert msg == (
        "unknown config key 'model.n_layrs' in override 'model.n_layrs=2'; "
        "did you mean 'model.n_layers'?"
    )


def test_unknown_nested_key_suggests_the_closest_name():
    msg = load_error(["attention.rope_scaling.facter=2"])
    assert "unknown config key 'attention.rope_scaling.facter'" in msg
    assert msg.endswith("did you mean 'attention.rope_scaling.factor'?")


def test_unknown_key_in_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model:\n  d_modle: 64\n")
    msg = load_error([], path)
    assert msg == f"unknown config key 'model.d_modle' in {path}; did you mean 'model.d_model'?"


def test_unknown_section_suggests_the_closest_section():
    msg = load_error(["modle.n_layers=2"])
    assert msg == "unknown config key 'modle' in override 'modle.n_layers=2'; did you mean 'model'?"


def test_unknown_top_level_key_lists_the_valid_keys():
    msg = load_error(["zzz=1"])
    assert msg.startswith("unknown config key 'zzz'")
    assert "valid keys: model, attention, moe, data, train, mesh, checkpoint, sample" in msg


def test_a_key_without_its_section_or_in_the_wrong_one_is_named_in_full():
    """The hint is a key one can paste: `stpes=3` and `model.lr=1` both point at their key."""
    assert load_error(["stpes=3"]).endswith("did you mean 'train.steps'?")
    assert load_error(["model.warmup_step=3"]).endswith("did you mean 'train.warmup_steps'?")
    # a long section's keys are one command away rather than a 30-key line
    assert load_error(["train.zzzq=1"]).endswith(
        "its section's keys: moe-jax train --help-config train"
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.n_layers=abc", "'abc' of type 'str' could not be converted to Integer"),
        ("model.n_layers=2.5", "could not be converted to Integer"),
        ("model.n_layers=null", "Incompatible value 'None'"),
        ("train.lr=fast", "could not be converted to Float"),
        ("model.tie_embeddings=maybe", "'maybe' is not a valid bool"),
    ],
)
def test_wrong_type_names_the_key_and_the_value(override, expected):
    key = override.partition("=")[0]
    msg = load_error([override])
    assert msg.startswith(f"bad config value for '{key}' in override '{override}'")
    assert expected in msg


@pytest.mark.parametrize("override", ["model.n_layers", "=3", "model"])
def test_malformed_override(override):
    msg = load_error([override])
    assert msg == f"override '{override}' is not of the form section.key=value"


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = load_error([], path)
    assert msg == f"config file '{path}' does not exist; pass a YAML file from configs/"


def test_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: [1\n")
    msg = load_error([], path)
    assert msg.startswith(f"config file '{path}' is not valid YAML")


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- moe\n")
    msg = load_error([], path)
    assert msg == f"config file '{path}' must hold a mapping of sections"


# ----------------------------------------------------------------------------- validation errors

# (overrides on configs/tiny.yaml, exact fragment of the message). tiny.yaml: d_model 128,
# 4 layers, 4 heads / 2 kv, 4 experts top-2, interleave_step 2 (layers 1 and 3 dense),
# max_seq_len 512, batch 16, seq_len 128.
VALIDATION_CASES = {
    # positivity of sizes
    "vocab_size": (["model.vocab_size=0"], "model.vocab_size must be positive, got 0"),
    "d_model": (["model.d_model=0"], "model.d_model must be positive, got 0"),
    "n_layers": (["model.n_layers=0"], "model.n_layers must be positive, got 0"),
    "max_seq_len": (["model.max_seq_len=0"], "model.max_seq_len must be positive, got 0"),
    "norm_eps": (["model.norm_eps=0"], "model.norm_eps must be positive, got 0.0"),
    "n_heads": (["attention.n_heads=0"], "attention.n_heads must be positive, got 0"),
    "n_kv_heads": (["attention.n_kv_heads=0"], "attention.n_kv_heads must be positive, got 0"),
    "rope_theta": (["attention.rope_theta=-1"], "attention.rope_theta must be positive, got -1.0"),
    # enums
    "dtype": (
        ["model.dtype=float16"],
        "model.dtype='float16' is not supported; use one of auto, float32, bfloat16",
    ),
    "rope_style": (
        ["attention.rope_style=neox"],
        "attention.rope_style='neox' is not supported; use one of half, interleaved",
    ),
    "qk_norm": (
        ["attention.qk_norm=layer"],
        "attention.qk_norm='layer' is not supported; use one of none, rms, l2",
    ),
    "rope_scaling_type": (
        ["attention.rope_scaling.type=ntk"],
        "attention.rope_scaling.type='ntk' is not supported; use one of none, linear, llama3, yarn",
    ),
    "score": (["moe.score=relu"], "moe.score='relu' is not supported; use one of softmax, sigmoid"),
    "route_scale": (
        ["moe.route_scale=both"],
        "moe.route_scale='both' is not supported; use one of output, input",
    ),
    "tokenizer": (
        ['data.tokenizer=" "'],
        "data.tokenizer is empty; use byte, char, or the path of a tokenizer.json",
    ),
    # attention shapes
    "gqa_divisible": (
        ["attention.n_kv_heads=3"],
        "attention.n_heads (4) must be divisible by attention.n_kv_heads (3) for grouped-query",
    ),
    "d_model_heads": (
        ["model.d_model=130"],
        "model.d_model (130) must be divisible by attention.n_heads (4), or set attention.head_dim",
    ),
    "head_dim_positive": (
        ["attention.head_dim=-2"],
        "attention.head_dim must be positive, got -2",
    ),
    "odd_head_dim_rope": (
        ["attention.head_dim=33"],
        "head_dim (33) must be even for RoPE; change attention.head_dim",
    ),
    "nope_interval": (
        ["attention.nope_interval=-1"],
        "attention.nope_interval must be >= 0, got -1",
    ),
    "chunk_size": (
        ["attention.chunk_size=-8"],
        "attention.chunk_size must be >= 0 (0 = off), got -8",
    ),
    "sliding_window": (
        ["attention.sliding_window=-1"],
        "attention.sliding_window must be >= 0 (0 = off), got -1",
    ),
    "floor_scale": (
        ["attention.temperature_tuning=true", "attention.floor_scale=0"],
        "attention.floor_scale must be positive, got 0.0",
    ),
    "rope_factor": (
        ["attention.rope_scaling.type=linear", "attention.rope_scaling.factor=0"],
        "attention.rope_scaling.factor must be positive, got 0.0",
    ),
    "llama3_bands": (
        [
            "attention.rope_scaling.type=llama3",
            "attention.rope_scaling.low_freq_factor=4",
            "attention.rope_scaling.high_freq_factor=1",
        ],
        "attention.rope_scaling.high_freq_factor must be >= low_freq_factor",
    ),
    # MoE
    "n_experts": (["moe.n_experts=-1"], "moe.n_experts must be >= 0 (0 = dense model), got -1"),
    "interleave_step": (["moe.interleave_step=0"], "moe.interleave_step must be >= 1, got 0"),
    "top_k_too_big": (
        ["moe.top_k=5"],
        "moe.top_k (5) must be between 1 and moe.n_experts (4)",
    ),
    "top_k_zero": (["moe.top_k=0"], "moe.top_k (0) must be between 1 and moe.n_experts (4)"),
    "expert_hidden": (["moe.expert_hidden=0"], "moe.expert_hidden must be positive, got 0"),
    "shared_expert_hidden": (
        ["moe.shared_expert_hidden=-1"],
        "moe.shared_expert_hidden must be >= 0, got -1",
    ),
    "ffn_hidden_dense_layers": (
        ["model.ffn_hidden=0"],
        "model.ffn_hidden must be positive, got 0",
    ),
    # mesh
    "mesh_axis": (["mesh.data=0"], "mesh.data must be >= 1 or -1 (the rest), got 0"),
    "mesh_two_rest": (["mesh.data=-1", "mesh.fsdp=-1"], "at most one mesh axis may be -1"),
    "experts_per_shard": (
        ["mesh.expert=3"],
        "moe.n_experts (4) must be divisible by mesh.expert (3)",
    ),
    # training
    "steps": (["train.steps=0"], "train.steps must be positive, got 0"),
    "batch_size": (["train.batch_size=0"], "train.batch_size must be positive, got 0"),
    "seq_len": (["train.seq_len=0"], "train.seq_len must be positive, got 0"),
    "grad_accum": (["train.grad_accum=0"], "train.grad_accum must be positive, got 0"),
    "lr": (["train.lr=0"], "train.lr must be positive, got 0.0"),
    "log_every": (["train.log_every=0"], "train.log_every must be positive, got 0"),
    "eval_every": (["train.eval_every=0"], "train.eval_every must be positive, got 0"),
    "eval_batches": (["train.eval_batches=0"], "train.eval_batches must be positive, got 0"),
    "batch_grad_accum": (
        ["train.grad_accum=3"],
        "train.batch_size (16) must be divisible by train.grad_accum (3)",
    ),
    "seq_len_max": (
        ["train.seq_len=1024"],
        "train.seq_len (1024) exceeds model.max_seq_len (512)",
    ),
    "warmup": (
        ["train.steps=10", "train.warmup_steps=50"],
        "train.warmup_steps (50) exceeds train.steps (10); set it to at most 10, or to null for "
        "the default, min(50, train.steps // 10)",
    ),
    "negative_warmup": (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0, got -1"),
    "min_lr_ratio": (["train.min_lr_ratio=1.5"], "train.min_lr_ratio must be within [0, 1]"),
    "schedule": (
        ["train.schedule=step"],
        "train.schedule='step' is not supported; use one of cosine, linear, wsd",
    ),
    "decay_fraction": (
        ["train.decay_fraction=0"],
        "train.decay_fraction must be within (0, 1], got 0.0",
    ),
    "wsd_too_long": (
        [
            "train.schedule=wsd",
            "train.steps=100",
            "train.warmup_steps=50",
            "train.decay_fraction=0.6",
        ],
        "train.schedule=wsd: warmup (50) and decay (60 = decay_fraction 0.6 x 100 steps) exceed "
        "train.steps; lower train.decay_fraction or train.warmup_steps",
    ),
    "val_fraction": (["data.val_fraction=1.0"], "data.val_fraction must be within (0, 1), got 1.0"),
    # checkpoint, sampling
    "checkpoint_every": (["checkpoint.every=0"], "checkpoint.every must be positive, got 0"),
    "checkpoint_keep": (["checkpoint.keep=0"], "checkpoint.keep must be positive, got 0"),
    "temperature": (
        ["sample.temperature=-1"],
        "sample.temperature must be 0 (greedy) or within [1e-06, 1e+06], got -1.0",
    ),
    "sample_top_k": (["sample.top_k=-1"], "sample.top_k must be >= 0 (0 = off), got -1"),
    "top_p": (["sample.top_p=0"], "sample.top_p must be within (0, 1] (1 = off), got 0.0"),
    "max_new_tokens": (
        ["sample.max_new_tokens=0"],
        "sample.max_new_tokens must be positive, got 0",
    ),
    "sample_batch": (["sample.batch_size=0"], "sample.batch_size must be positive, got 0"),
    "prompt_len": (["sample.prompt_len=-2"], "sample.prompt_len must be positive, got -2"),
    "slices": (["mesh.slices=0"], "mesh.slices must be >= 1, got 0"),
    "row_chunks": (["moe.row_chunks=0"], "moe.row_chunks must be >= 1, got 0"),
    "row_chunks_impl": (
        ["moe.row_chunks=2", "moe.impl=buckets"],
        "moe.row_chunks=2 chunks the grouped experts' rows; moe.impl=buckets has none",
    ),
    "row_chunks_remat": (
        [
            "moe.row_chunks=2",
            "model.scan_layers=true",
            "model.remat=full",
            "model.remat_save=expert_gate_up",
        ],
        "so model.remat_save / remat_offload cannot keep expert_gate_up or expert_out",
    ),
    # numbers out of range anywhere: NaN and infinities, ints beyond int32, seeds beyond 32 bits
    "nan_capacity": (["moe.capacity_factor=nan"], "moe.capacity_factor must be a finite number"),
    "inf_temperature": (["sample.temperature=inf"], "sample.temperature must be a finite number"),
    "huge_vocab": (["model.vocab_size=99999999999"], "model.vocab_size must be within +-2,147,"),
    "huge_seed": (["seed=4294967296"], "seed must be within [0, 2^32), got 4294967296"),
    "negative_seed": (["sample.seed=-1"], "sample.seed must be within [0, 2^32), got -1"),
    # multi-process
    "num_processes": (["mesh.num_processes=-3"], "mesh.num_processes must be >= 0"),
    "process_id": (
        ["mesh.num_processes=2", "mesh.process_id=5"],
        "mesh.process_id (5) must be within [0, mesh.num_processes) (num_processes 2)",
    ),
}


@pytest.mark.parametrize("overrides, expected", VALIDATION_CASES.values(), ids=VALIDATION_CASES)
def test_validation_error_message(overrides, expected):
    assert expected in load_error(overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        # odd head_dim is fine when no layer uses RoPE (every layer NoPE)
        ["attention.head_dim=33", "attention.nope_interval=1"],
        # ffn_hidden is unused (and may be 0) when every layer is MoE
        ["model.ffn_hidden=0", "moe.interleave_step=1"],
        # MoE checks do not apply to a dense model
        ["moe.n_experts=0", "moe.top_k=9", "mesh.expert=3"],
        # one mesh axis may take the rest of the devices
        ["mesh.data=-1"],
        # head_dim set explicitly need not divide d_model
        ["model.d_model=130", "attention.head_dim=32"],
    ],
)
def test_valid_edge_cases_load(overrides):
    load_config(TINY, overrides)


@pytest.mark.parametrize(
    "overrides, warmup",
    [
        (["train.steps=10"], 1),  # a short run: a tenth of it
        (["train.steps=3"], 0),
        (["train.steps=5000"], 50),  # a long one: the default's 50 steps
        (["train.steps=10", "train.warmup_steps=10"], 10),  # set: as given
    ],
)
def test_default_warmup_scales_with_a_short_run(overrides, warmup):
    assert load_config(TINY, overrides).train.warmup == warmup


# ----------------------------------------------------------------------------- loading


def test_precedence_schema_then_yaml_then_overrides():
    schema = Config()
    base = load_config(TINY)
    assert schema.model.ffn_hidden == 512 and base.model.ffn_hidden == 384  # YAML beats schema
    assert base.model.init_std == schema.model.init_std  # absent from the YAML: schema default
    cfg = load_config(
        TINY,
        [
            "model.ffn_hidden=256",  # override beats YAML
            "train.steps=500",
            "train.steps=700",  # later override beats earlier
            "attention.rope_scaling.factor=4",  # nested section
            "attention.head_dim=16",  # Optional field
        ],
    )
    assert cfg.model.ffn_hidden == 256
    assert cfg.train.steps == 700
    assert cfg.attention.rope_scaling.factor == 4.0
    assert cfg.head_dim == 16
    assert cfg.model.d_model == base.model.d_model == 128  # untouched YAML value stays


def test_no_path_gives_schema_defaults():
    assert load_config(None) == Config()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load_and_round_trip(path):
    cfg = load_config(path)
    assert isinstance(hash(cfg), int)  # usable as a static jit argument
    assert config_from_yaml(config_to_yaml(cfg)) == cfg


def test_round_trip_keeps_overridden_and_optional_values():
    cfg = load_config(
        TINY,
        ["attention.head_dim=16", "data.path=/x/a.txt,/x/b*.txt", "train.lr=1.5e-4", "seed=3"],
    )
    back = config_from_yaml(config_to_yaml(cfg))
    assert back == cfg
    assert back.attention.head_dim == 16 and back.data.path == "/x/a.txt,/x/b*.txt"
    assert config_from_yaml(config_to_yaml(load_config(TINY))).attention.head_dim is None


def test_config_is_frozen():
    cfg = load_config(TINY)
    with pytest.raises(AttributeError):
        cfg.model.d_model = 3  # type: ignore[misc]


# ----------------------------------------------------------------------------- CLI


def run_importing(*argv: str) -> tuple[int, list[str], set[str]]:
    """`python -X importtime ARGV` from the repository root: (exit status, stderr lines other
    than the import times, top-level packages the process imported)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.splitlines()
    imported = [line.split("|")[-1].strip() for line in lines if line.startswith("import time:")]
    err = [line for line in lines if not line.startswith("import time:")]
    return proc.returncode, err, {name.split(".")[0] for name in imported}


def test_train_cli_bad_config_fails_before_importing_jax():
    """A mistake costs a fraction of a second, not jax's import (seconds)."""
    code, err, modules = run_importing("train.py", "train.steps=10", "train.warmup_steps=20")
    assert code == 2 and err == [
        "error: train.warmup_steps (20) exceeds train.steps (10); set it to at most 10, or to "
        "null for the default, min(50, train.steps // 10)"
    ]
    assert "omegaconf" in modules and not {"jax", "flax", "orbax"} & modules


def run_summary(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_jax.summary", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["configs/tiny.yaml", "model.n_layrs=2"],
            "error: unknown config key 'model.n_layrs' in override 'model.n_layrs=2'; "
            "did you mean 'model.n_layers'?",
        ),
        (  # summary takes a shipped config's name as train does: neither is named
            ["configs/no_such.yaml"],
            "error: config 'configs/no_such.yaml' is neither a file nor a shipped config; "
            f"shipped: {', '.join(shipped_names())}",
        ),
        (
            ["configs/tiny.yaml", "data.path=,,"],
            "error: override 'data.path=,,' has a value that is not valid YAML (while parsing a "
            'block node did not find expected node content in "<unicode string>", line 1, '
            "column 1); put the value in double quotes inside the argument: 'data.path=\"...\"'",
        ),
    ],
    ids=["bad_key", "bad_path", "bad_yaml_value"],
)
def test_cli_bad_config_exits_2_with_one_line(args, expected):
    proc = run_summary(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [expected]
    assert proc.stdout == ""


def test_cli_invalid_yaml_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: [1\n")
    proc = run_summary(str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    assert re.match(rf"error: config file '{re.escape(str(path))}' is not valid YAML", lines[0])


@pytest.mark.parametrize(
    "target, model, have",
    [("shared", [], "attention, mlp, experts"),  # tiny: no shared expert
     ("mlp", ["moe.interleave_step=1"], "attention, shared, experts"),  # every layer MoE
     ("experts", ["moe.n_experts=0"], "attention, mlp")],
)  # fmt: skip
def test_lora_targets_without_weights_in_the_model_are_refused_by_name(target, model, have):
    """A lora.targets group the model has no weight of once trained nothing, silently."""
    shared = [] if target == "shared" else ["moe.shared_expert_hidden=16"]
    lora = ["lora.rank=4", f"lora.targets=[attention,{target}]", *shared, *model]
    msg = load_error(lora)
    assert f"lora.targets has '{target}'" in msg and f"(its targets: {have})" in msg, msg
    load_config(TINY, ["lora.rank=4", "lora.targets=[attention,mlp,shared,experts]",
                       "moe.shared_expert_hidden=16"])  # fmt: skip


def test_lora_targets_of_an_architecture_from_elsewhere_are_refused_at_the_build():
    """init_from=HF_DIR brings its architecture after the config check: the model's build
    refuses the target (before any weight is made)."""
    from flax import nnx

    from moe_jax.model import Transformer

    cfg = load_config(TINY, ["lora.rank=4", "lora.targets=[shared]", "init_from=/an/hf/dir"])
    with pytest.raises(ConfigError, match="lora.targets has 'shared'"):
        Transformer(cfg, rngs=nnx.Rngs(0))
