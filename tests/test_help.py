"""Every command's --help says what it accepts, as its parser accepts it.

For each argparse command (sample.py and the `python -m moe_jax.X` ones) the parser is taken
from the command itself (its main, stopped where it parses) and its texts are checked: every
choice an option takes is in the help; a text that names one of an option's choices names
them all (quantize's said "an int8 copy" when --mode also writes MXFP4); a list of values
written `a | b | c` is exactly one set the config or the parser accepts (sample.py's omitted
mxfp4 from sample.weights'); a description or epilog ends its sentence (eval's stopped at the
first line of its docstring). Commands without argparse answer --help with their usage.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moe_jax.config.model
import moe_jax.config.run

ROOT = Path(__file__).resolve().parents[1]
# command -> the module whose main(argv) it runs
ARGPARSE_COMMANDS = {
    "sample.py": "moe_jax.cli.sample",
    "moe-jax aot": "moe_jax.aot.command",
    "moe-jax plot": "moe_jax.observe.plot",
    "moe-jax prepare": "moe_jax.prepare",
    "moe-jax quantize": "moe_jax.quantize",
    "moe-jax eval": "moe_jax.eval.__main__",
    "moe-jax interop": "moe_jax.interop.__main__",
    "moe-jax serve": "moe_jax.serve.__main__",
}
PIPE_LIST = re.compile(r"[\w.-]+(?:[ \t]*\|[ \t]*[\w.-]+)+")


def config_value_sets() -> list[frozenset[str]]:
    """The value sets the config's keys accept (its module-level tuples of names)."""
    found = []
    for module in (moe_jax.config.model, moe_jax.config.run):
        for value in vars(module).values():
            if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
                found.append(frozenset(value))
    return found


# What the optional extras bring (pyproject.toml): serve, trackers, interop, eval
OPTIONAL_PACKAGES = {"fastapi", "uvicorn", "openai", "wandb", "mlflow", "torch", "transformers",
                     "lm_eval"}  # fmt: skip


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `module.main(["--help"])` builds, taken where it starts to parse."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # only an optional extra's package missing is a reason to skip; any other failure to
        # import is the command's bug and fails here
        if (e.name or "").split(".")[0] not in OPTIONAL_PACKAGES:
            raise
        pytest.skip(f"{module_name} needs {e.name}, an optional extra's package: {e}")

    def capture(self, *args, **kwargs):
        raise Captured(self)

    for method in ("parse_args", "parse_known_args", "parse_intermixed_args"):
        monkeypatch.setattr(argparse.ArgumentParser, method, capture)
    with pytest.raises(Captured) as caught:
        module.main(["--help"])
    return caught.value.parser


def parsers(parser: argparse.ArgumentParser):
    """The parser and its sub-commands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def texts(parser: argparse.ArgumentParser) -> dict[str, str]:
    """What the help prints as prose: description, epilog, each option's help."""
    found = {"description": parser.description or "", "epilog": parser.epilog or ""}
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            found[action.dest] = action.help
    return found


def names(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w-])", text, re.I) is not None


def problems(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """What the help texts of `parser` and its sub-commands get wrong (see the docstring)."""
    found, value_sets = [], config_value_sets()
    for p in parsers(parser):
        where = f"{command} ({p.prog})"
        help_text, prose = p.format_help(), texts(p)
        option_choices = [
            [str(c) for c in a.choices]
            for a in p._actions
            if a.choices and not isinstance(a, argparse._SubParsersAction)
        ]
        for choices in option_choices:
            found += [
                f"{where}: --help omits the choice {c!r}" for c in choices if c not in help_text
            ]
            for name, text in prose.items():
                named = [c for c in choices if names(text, c)]
                if named and len(named) < len(choices):
                    found.append(f"{where}: the {name} text names {named}, not all of {choices}")
        accepted = value_sets + [frozenset(c) for c in option_choices]
        for name, text in prose.items():
            for listed in PIPE_LIST.findall(text):
                items = frozenset(x.strip() for x in listed.split("|"))
                overlapping = [s for s in accepted if len(items & s) >= 2]
                if overlapping and items not in overlapping:
                    found.append(f"{where}: the {name} text lists {listed!r}, no whole value set")
        for name in ("description", "epilog"):
            text = prose[name].rstrip()
            if text and text[-1] not in ".)!?:":
                found.append(f"{where}: the {name} stops mid-sentence: {text[-40:]!r}")
    return found


@pytest.mark.parametrize("command", sorted(ARGPARSE_COMMANDS))
def test_help_names_every_choice_and_lists_whole_value_sets(command, monkeypatch):
    assert problems(parser_of(ARGPARSE_COMMANDS[command], monkeypatch), command) == []


def test_the_check_finds_the_help_texts_issue_51_named():
    """The three texts as they were: each is caught."""
    quantize = argparse.ArgumentParser(
        description="Write an int8 weight-only copy of a run's checkpoint as a new run directory."
    )
    quantize.add_argument("--mode", choices=("int8", "mxfp4"))
    sample = argparse.ArgumentParser(description="Generate text from a trained run.")
    sample.add_argument(
        "overrides", help="e.g. sample.weights=int8 (auto | float32 | bfloat16 | int8)"
    )
    evaluate = argparse.ArgumentParser(
        description="Evaluate a run's checkpoint on lm-evaluation-harness tasks; the results "
        "JSON goes into the"
    )
    for parser, expected in [
        (quantize, "the description text names ['int8'], not all of ['int8', 'mxfp4']"),
        (sample, "the overrides text lists 'auto | float32 | bfloat16 | int8', no whole value set"),
        (evaluate, "the description stops mid-sentence"),
    ]:
        (problem,) = problems(parser, "old")
        assert expected in problem


@pytest.mark.parametrize(
    "argv, first_line",
    [
        (["train.py", "--help"], "Train a Mixture-of-Experts language model."),
        (["-m", "moe_jax.summary", "--help"], "usage: moe-jax summary"),
        (["-m", "moe_jax.cli.shared_storage", "--help"], "usage: python -m moe_jax.cli"),
    ],
)
def test_commands_without_argparse_answer_help_with_their_usage(argv, first_line):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert out.startswith(first_line), out[:500]
