"""`python -m moe_jax.summary`: the command's door; the command is `moe_jax.summary.counts`."""

import sys

from moe_jax.summary.counts import main

if __name__ == "__main__":
    sys.exit(main())
