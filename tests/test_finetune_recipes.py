"""Fine-tunes that start right (issue 68): a run's length in epochs over its rows
(moe_jax/config/epochs.py), refused beside an explicit train.steps; the shipped fine-tune
configs (configs/finetune/) found by name and holding a recipe, no architecture; init_from=RUN
taking the source's architecture (moe_jax/train/init_from.py); a source's saved config
bringing none of its per-run keys (moe_jax/config/loading.py); the shipped reward functions.
Config-level only: no model is built, nothing compiles."""

from __future__ import annotations

import re

import pytest
import yaml

from moe_jax.config import Config, ConfigError, config_to_yaml, load_config
from moe_jax.config.epochs import epoch_steps, with_epochs
from moe_jax.config.loading import PER_RUN_KEYS
from moe_jax.config.shipped import config_path, configs_dir, names
from moe_jax.posttrain.rl import rewards
from moe_jax.run.policy import RESUMABLE_CHANGES, incompatible_keys
from moe_jax.train.init_from import with_run_architecture

DPO = ["train.objective=dpo", "data.sft=preference", "data.path=pairs.jsonl"]
SFT = ["data.sft=prompt_completion", "data.path=sft.jsonl"]


def schema_config(*overrides: str) -> Config:
    """The schema's defaults and `overrides` (configs/tiny.yaml names train.steps)."""
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    "epochs, rows, batch, steps",
    [(3, 10, 8, 4), (3, 8, 8, 3), (1, 1, 16, 1), (0.1, 30, 3, 1), (0.5, 100, 8, 7),
     (2.5, 12, 4, 8)],
)  # fmt: skip
def test_epochs_are_the_steps_that_cover_them(epochs, rows, batch, steps):
    """ceil(epochs x rows / batch): 3 x 10 / 8 = 3.75 -> 4; an exact 3 stays 3 (and 0.1 x 30
    / 3, 1.0000000000000002 in floats, stays 1); at least one step."""
    assert epoch_steps(epochs, rows, batch) == steps


def test_a_resolved_config_holds_the_steps_and_is_checked_against_them():
    """with_epochs: train.steps from the rows (grad_accum splits a step's rows, it adds
    none), train.epochs null; the checks that read train.steps run again on the count, the
    message naming the epochs it came from."""
    cfg = schema_config(*SFT, "train.epochs=3", "train.batch_size=8", "train.grad_accum=2")
    resolved = with_epochs(cfg, rows=10, unit="windows")
    assert (resolved.train.steps, resolved.train.epochs) == (4, None)
    assert with_epochs(resolved, rows=99, unit="windows") is resolved  # no epochs: as it is
    late = schema_config(*DPO, "train.epochs=3", "train.batch_size=8", "train.warmup_steps=10")
    with pytest.raises(ConfigError) as e:
        with_epochs(late, rows=10, unit="pairs")
    assert str(e.value) == (
        "train.epochs=3 over 10 pairs at train.batch_size=8 is 4 steps, and then "
        "train.warmup_steps (10) exceeds train.steps (4); set it to at most 4, or to null for "
        "the default, min(50, train.steps // 10)"
    )


def test_steps_and_epochs_are_refused_together_by_name(tmp_path):
    """Where the file named or the overrides set both; the unnamed default config's steps
    (tiny's 600, the CLI's `default_file`) give way; train.epochs=null counts steps again;
    epochs over a text corpus, which has no rows to count, are refused."""
    both = "are both set; a run's length is one of them: drop train.steps, or set train.epochs=null"
    with pytest.raises(ConfigError, match=re.escape(f"train.steps (5 on the command line) and "
                                                    f"train.epochs (2) {both}")):  # fmt: skip
        load_config(None, [*DPO, "train.epochs=2", "train.steps=5"])
    dpo = config_path("finetune/dpo")
    with pytest.raises(ConfigError, match=re.escape("train.steps (50 on the command line) and "
                                                    "train.epochs (3)")):  # fmt: skip
        load_config(dpo, ["data.path=p.jsonl", "train.steps=50"])
    tiny = config_path("tiny")
    with pytest.raises(ConfigError, match=re.escape(f"train.steps (600 in {tiny}) and")):
        load_config(tiny, [*DPO, "train.epochs=2"])
    assert load_config(tiny, [*DPO, "train.epochs=2"], default_file=True).train.epochs == 2
    counted = load_config(dpo, ["data.path=p.jsonl", "train.epochs=null", "train.steps=50"])
    assert (counted.train.epochs, counted.train.steps) == (None, 50)
    with pytest.raises(ConfigError, match="a text corpus or token store trains for train.steps"):
        load_config(None, ["train.epochs=2"])
    with pytest.raises(ConfigError, match="train.epochs must be positive"):
        load_config(None, [*DPO, "train.epochs=0"])


def test_the_finetune_configs_ship_by_name_with_a_recipe_and_no_architecture():
    """finetune/{sft,lora,dpo,grpo}: found by name where the wheel's configs are looked up
    (setup.py copies every YAML file of configs/), each sized in epochs with a fine-tune's LR
    (at most a third of pretraining's), no warmup to spend its few steps on, its own run_dir
    and an eval cadence; no architecture key but a run-time one (GRPO's dropless MoE)."""
    pretraining = Config().train.lr
    run_dirs = set()
    for name in ("sft", "lora", "dpo", "grpo"):
        path = config_path(f"finetune/{name}")
        assert path == configs_dir() / "finetune" / f"{name}.yaml" and f"finetune/{name}" in names()
        cfg = load_config(path, ["data.path=x.jsonl"])
        t = cfg.train
        assert t.epochs and t.lr <= pretraining / 3 and t.warmup_steps == 0, name
        assert t.eval_every >= 1 and cfg.data.sft != "none"
        run_dirs.add(cfg.run_dir)
        text = yaml.safe_load(path.read_text())
        arch = {f"{s}.{k}" for s in ("model", "attention", "moe") for k in text.get(s, {})}
        assert arch <= RESUMABLE_CHANGES, (name, arch)
        assert (cfg.lora.rank > 0) == (name != "sft")
    assert run_dirs == {"runs/sft", "runs/lora", "runs/dpo", "runs/grpo"}


def test_init_from_a_run_takes_its_architecture_but_what_the_user_set():
    """with_run_architecture: the source's model / attention / moe and data.tokenizer; a key
    the user gave stays theirs: a run-time one applies (capacity factor), an architecture one
    differs and is refused by name when the source is checked. given=None (the Python API):
    the config's run-time keys, the source's architecture."""
    saved = schema_config("model.n_layers=2", "moe.capacity_factor=0", "model.vocab_size=300",
                        "data.tokenizer=/runs/src/tokenizer")  # fmt: skip
    cfg = schema_config(*SFT, "moe.capacity_factor=1.5", "model.n_layers=4", "init_from=/runs/src")
    took = with_run_architecture(saved, cfg, given=set())
    assert (took.model, took.attention, took.moe) == (saved.model, saved.attention, saved.moe)
    assert took.data.tokenizer == "/runs/src/tokenizer" and took.data.sft == "prompt_completion"
    assert not incompatible_keys(saved, took)
    mine = with_run_architecture(saved, cfg, given={"moe.capacity_factor", "model.n_layers"})
    assert mine.moe.capacity_factor == 1.5
    assert incompatible_keys(saved, mine) == ["model.n_layers: 2 -> 4"]
    api = with_run_architecture(saved, cfg, given=None)
    assert (api.model.n_layers, api.model.vocab_size, api.moe.capacity_factor) == (2, 300, 1.5)


def test_a_sources_saved_config_brings_none_of_its_per_run_keys(tmp_path):
    """`train.py SRC/config.yaml init_from=SRC ...` (the old docs' way): the source's
    profiler window, trackers, resume and init steps (its own source's!) are the defaults
    again, unless the command line sets them; its run_dir must be replaced by name."""
    src = tmp_path / "src"
    src.mkdir()
    saved = schema_config(f"run_dir={src}", "init_from=/runs/older", "init_step=7",
                        "train.profile_start=3", "train.profile_steps=2",
                        "train.trackers=[tensorboard,wandb]", "train.tracker_project=pretrain",
                        "train.resume_step=400", "checkpoint.export_hf=2")  # fmt: skip
    (src / "config.yaml").write_text(config_to_yaml(saved))
    new = [f"init_from={src}", f"run_dir={tmp_path / 'new'}"]
    cfg = load_config(src / "config.yaml", [*new, "train.tracker_project=ft"])
    default = Config()
    for key in PER_RUN_KEYS:
        section, _, name = key.rpartition(".")
        got, want = (getattr(getattr(c, section) if section else c, name) for c in (cfg, default))
        if key not in ("run_dir", "train.tracker_project"):
            assert got == want, key
    assert (cfg.run_dir, cfg.train.tracker_project) == (str(tmp_path / "new"), "ft")
    assert cfg.model == saved.model  # the recipe and the shape are the file's
    with pytest.raises(ConfigError, match="name the new run's directory with run_dir=NEW"):
        load_config(src / "config.yaml", [f"init_from={src}"])
    # the same file without init_from naming its run: a config like any other
    assert load_config(src / "config.yaml").train.profile_steps == 2


def test_the_shipped_rewards_score_as_trl_calls_them():
    done = ["x * x", "  a + b\n", "items[0] + 1", None]
    answers = ["x * x", "a + b", "items[0]", "2"]
    kw = {"prompts": ["p"] * 4, "completions": [c or "" for c in done], "answer": answers}
    assert rewards.exact(**kw) == [1.0, 1.0, 0.0, 0.0]
    assert rewards.prefix(**kw) == [1.0, 1.0, 1.0, 0.0]
