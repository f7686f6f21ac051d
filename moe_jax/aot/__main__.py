"""`python -m moe_jax.aot`: the command's door; the command is `moe_jax.aot.command`."""

import sys

from moe_jax.aot.command import main

if __name__ == "__main__":
    sys.exit(main())
