"""`moe-jax SUBCOMMAND` (moe_jax/cli/main.py), the config reference (moe_jax/config/reference.py,
docs/reference/config.md) and shipped config names in every command that takes a config.
No model is compiled here: ~10 s, mostly the subprocesses that prove help needs no jax."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_jax.cli import main as cli
from moe_jax.config import Config, load_config
from moe_jax.config import reference as ref
from moe_jax.config.shipped import config_path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference" / "config.md"


def _imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m moe_jax ARGS` -> (the result, the modules it imported)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "moe_jax", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("import time:")]
    return done, {ln.rsplit("|", 1)[1].strip() for ln in lines}


@pytest.mark.parametrize(
    "args",
    [(), ("--help",), ("train", "--help"), ("train", "--help-config", "moe"), ("sample", "-h")],
)
def test_help_prints_without_importing_jax(args):
    """The command list and train's and sample's help (and the config reference) come before
    jax's import, which takes seconds: the issue's < 1 s."""
    done, modules = _imported_modules(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "jax" not in modules and "flax" not in modules
    if not args or args == ("--help",):
        for name in cli.SUBCOMMANDS:
            assert f"\n  {name} " in done.stdout
    if args[:2] == ("train", "--help-config"):
        assert "moe.n_experts (int) = 4" in done.stdout and "[train]" not in done.stdout


def test_an_unknown_subcommand_is_one_line_naming_the_closest(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no subcommand 'trian'")
    assert "did you mean 'train'?" in err


def test_each_subcommand_runs_its_command_with_the_arguments(capsys):
    """`moe-jax summary NAME` is `python -m moe_jax.summary NAME`: the same main, the same
    output; a shipped config's name works where a YAML path does."""
    assert cli.main(["summary", "mixtral_8x7b"]) == 0
    via_moe_jax = capsys.readouterr().out
    from moe_jax.summary.counts import main as summary

    assert summary([str(config_path("mixtral_8x7b"))]) == 0
    assert capsys.readouterr().out == via_moe_jax
    assert via_moe_jax.startswith("32 layers, d_model 4096")


def test_aot_takes_a_shipped_config_by_name():
    from moe_jax.aot.command import main as aot
    from moe_jax.aot.command import parse_args

    _, path, overrides = parse_args(["mixtral_8x7b", "train.batch_size=8", "--topology", "v5p-8"])
    assert Path(path) == config_path("mixtral_8x7b") and overrides == ["train.batch_size=8"]
    assert Path(parse_args(["--topology", "v5p-8"])[1]) == config_path("tiny")
    # a name that is neither a file nor shipped: refused before anything compiles
    assert aot(["no_such_config", "--topology", "v5p-8"]) == 2


def test_sample_takes_the_run_positionally_or_by_flag():
    from moe_jax.cli.sample import parse_args

    positional = parse_args(["runs/x", "mesh.expert=2", "--seed", "3"])
    flag = parse_args(["--run", "runs/x", "--seed", "3", "mesh.expert=2"])
    assert (positional.run, positional.overrides) == ("runs/x", ["mesh.expert=2"])
    assert (flag.run, flag.overrides, flag.seed) == ("runs/x", ["mesh.expert=2"], 3)
    with pytest.raises(SystemExit):  # argparse's usage error: exit 2, no traceback
        parse_args(["mesh.expert=2"])


def test_the_config_reference_is_generated_and_current():
    """docs/reference/config.md is the schema's: regenerate it with the command it names when
    a key changes. Every key is listed once, with the default Config() has, and a meaning."""
    assert REFERENCE.read_text(encoding="utf-8") == ref.markdown(), (
        "docs/reference/config.md is stale: moe-jax train --help-config --markdown > "
        "docs/reference/config.md"
    )
    keys = ref.keys()
    assert len({k.name for k in keys}) == len(keys)
    assert [k.name for k in keys if not k.doc] == []
    defaults = Config()
    for k in keys:
        value = defaults
        for part in k.name.split("."):
            value = getattr(value, part)
        assert ref._shown(value) == k.default, k.name
        # the name is one an override takes
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert load_config(None, [f"{k.name}={value}"]) == defaults, k.name


def test_the_comments_are_the_fields():
    """A field's meaning is the comment above it and the one at its end, nothing else: the next
    field's comment never leaks upward."""
    docs = {k.name: k.doc for k in ref.keys()}  # noqa: SIM118 (a function, not a dict)
    assert docs["moe.interleave_step"] == (
        "MoE on every interleave_step-th layer, dense SwiGLU elsewhere"
    )
    assert docs["moe.score"].startswith("The three routing switches are independent")
    assert "softmax | sigmoid | sqrtsoftplus" in docs["moe.score"]
    assert docs["moe.score"].endswith("times routed_scaling_factor)")  # the next field's not
    assert docs["model.ffn_hidden"] == "hidden width of the dense SwiGLU layers"


def test_help_config_refuses_an_unknown_section(capsys):
    from moe_jax.cli.train import main as train

    assert train(["--help-config", "trian"]) == 2
    err = capsys.readouterr().err
    assert "no config section 'trian'" in err and "train" in err


def test_the_serve_extra_hint_is_the_clone_s_own_pip_command():
    """Run from a clone (or its editable install) the hint installs into the clone."""
    from moe_jax.serve.__main__ import install_hint

    assert install_hint("serve") == f"pip install -e '{ROOT}[serve]'"
