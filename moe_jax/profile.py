"""`python -m moe_jax.profile`: the command's door; the command is `moe_jax.observe.profile`."""

import sys

from moe_jax.observe.profile import main

if __name__ == "__main__":
    sys.exit(main())
