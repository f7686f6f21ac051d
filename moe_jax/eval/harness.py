"""lm-evaluation-harness's own command line with the moe_jax backend registered.

    python -m moe_jax.eval.harness run --model moe_jax \\
        --model_args run=runs/tiny,step=600,mesh.expert=2 --tasks hellaswag --batch_size 8

lm-eval 0.4.13 finds backends only in its own fixed table or among modules already
imported (it has no plugin entry point), so a bare `lm_eval --model moe_jax` cannot see this
package's backend: this module imports it, then hands the arguments to the harness's CLI
(every flag of `lm_eval`'s works). `run --tasks` names the harness's index lacks are refused
first (lm-eval's own refusal is a traceback); those and the moe_jax backend's errors (a bad run
directory, mesh or override) print one `error: ...` line and exit 2 (moe_jax.run.door).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lm_eval.__main__ import cli_evaluate

import moe_jax.eval.backend  # noqa: F401 (registers "moe_jax" with the harness)
from moe_jax.eval.tasks import check_known, task_names
from moe_jax.run.door import command


def check_tasks(argv: Sequence[str]) -> None:
    """`run --tasks ...`: every name the harness's index (with --include_path) knows, or
    EvalError in one line before the model loads (lm-eval's own refusal is a traceback).
    Task YAML files given by path are the harness's to read."""
    if not argv or argv[0] != "run":
        return
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tasks", nargs="+", default=[])
    p.add_argument("--include_path", "--include-path", default=None)
    known, _ = p.parse_known_args(argv[1:])
    names = [n for given in known.tasks for n in task_names(given)]
    check_known([n for n in names if not Path(n).exists()], known.include_path, "--include_path")


@command
def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    check_tasks(argv)
    own, sys.argv = sys.argv, [sys.argv[0], *argv]  # the harness's CLI reads sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = own
    return 0


if __name__ == "__main__":
    sys.exit(main())
