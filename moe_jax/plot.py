"""`python -m moe_jax.plot`: the command's door; the command is `moe_jax.observe.plot`."""

import sys

from moe_jax.observe.plot import main

if __name__ == "__main__":
    sys.exit(main())
