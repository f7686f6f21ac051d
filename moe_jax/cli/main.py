"""`moe-jax SUBCOMMAND ...`: the one command in front of every job of moe_jax.

    moe-jax train                          # the tiny default on the embedded corpus
    moe-jax train finetune/dpo init_from=runs/tiny run_dir=runs/dpo
    moe-jax sample runs/tiny --prompt "ROMEO:"
    moe-jax train --help-config train      # the config keys, their types and defaults

Each subcommand is the command of the same name it always was (`moe-jax-train`,
`python -m moe_jax.eval`, ...: those spellings stay) and takes the same arguments. `moe-jax`,
`moe-jax --help` and `moe-jax train --help` print before jax is imported (well under a second);
a subcommand imports what it needs once its arguments are read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Subcommand(NamedTuple):
    module: str  # holds `main(argv) -> int`
    summary: str
    defers_jax: bool = False  # checks its arguments before importing jax itself


SUBCOMMANDS = {
    "train": Subcommand(
        "moe_jax.cli.train", "train or fine-tune a model from a config", defers_jax=True
    ),
    "sample": Subcommand(
        "moe_jax.cli.sample", "generate text from a run or an HF directory", defers_jax=True
    ),
    "serve": Subcommand("moe_jax.serve.__main__", "an OpenAI-compatible HTTP server on a run"),
    "eval": Subcommand("moe_jax.eval.__main__", "lm-evaluation-harness tasks on a run"),
    "interop": Subcommand(
        "moe_jax.interop.__main__", "import / export Hugging Face checkpoints and PEFT adapters"
    ),
    "quantize": Subcommand("moe_jax.quantize", "an int8 or MXFP4 copy of a run"),
    "prepare": Subcommand("moe_jax.prepare", "text, JSONL or Parquet into a token store"),
    "plot": Subcommand("moe_jax.observe.plot", "PNG plots of a run's metrics"),
    "profile": Subcommand("moe_jax.observe.profile", "read a run's profiler trace"),
    "summary": Subcommand("moe_jax.summary.counts", "parameters, FLOPs and memory of a config"),
    "aot": Subcommand("moe_jax.aot.command", "compile for a TPU slice or GPU cluster on this CPU"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {s.summary}" for name, s in SUBCOMMANDS.items()]
    return (
        "usage: moe-jax SUBCOMMAND [ARGS ...]   (moe-jax SUBCOMMAND --help: its arguments)\n\n"
        "subcommands:\n" + "\n".join(lines) + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0] + "\n\n" + usage(), end="")
        return 0
    name, rest = argv[0], argv[1:]
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        import difflib

        close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(
            f"error: no subcommand '{name}'{hint} (moe-jax --help lists them: "
            f"{', '.join(SUBCOMMANDS)})",
            file=sys.stderr,
        )
        return 2
    if not sub.defers_jax:
        from moe_jax.process_setup import import_jax

        import_jax()  # quietly, as `python -m moe_jax.X` does (moe_jax/__init__.py)
    # argparse's usage lines name the subcommand as the user typed it
    sys.argv = [f"moe-jax {name}", *rest]
    return importlib.import_module(sub.module).main(rest)


def script() -> None:
    """The `moe-jax` console script: huge-page malloc first for the jobs that run models (a
    glibc tunable is read only when a process starts, moe_jax/process_setup.py), then main."""
    from moe_jax.process_setup import reexec_with_hugepages

    if sys.argv[1:2] and sys.argv[1] in ("train", "sample", "serve", "eval"):
        reexec_with_hugepages()
    sys.exit(main())
