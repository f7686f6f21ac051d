"""lm-evaluation-harness's own command line with the moe_jax backend registered.

    python -m moe_jax.eval.harness run --model moe_jax \\
        --model_args run=runs/tiny,step=600,mesh.expert=2 --tasks hellaswag --batch_size 8

lm-eval 0.4.13 finds backends only in its own fixed table or among modules already
imported (it has no plugin entry point), so a bare `lm_eval --model moe_jax` cannot see this
package's backend: this module imports it, then hands the arguments to the harness's CLI
(every flag of `lm_eval`'s works). Errors of the moe_jax backend (a bad run directory, mesh or
override) print one `error: ...` line and exit 2.
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

import moe_jax.eval.backend  # noqa: F401 (registers "moe_jax" with the harness)
from moe_jax.backends import KernelError
from moe_jax.config import ConfigError
from moe_jax.eval import EvalError
from moe_jax.run.layout import RunError
from moe_jax.tokenizer import DataError


def main() -> int:
    try:
        cli_evaluate()
    except (EvalError, RunError, ConfigError, DataError, KernelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
