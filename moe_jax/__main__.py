"""`python -m moe_jax SUBCOMMAND ...`: the `moe-jax` command (moe_jax/cli/main.py) without an
installed console script."""

import sys

from moe_jax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
