"""Generate text from a trained run: `moe-jax-sample` as a script of the clone.

    python sample.py --run runs/tiny                              # latest checkpoint
    python sample.py --run runs/tiny --prompt "def " --max-new-tokens 300 --temperature 0.7

`python sample.py --help` says the rest; the command itself is moe_jax/cli/sample.py.
"""

import sys

DEFER_JAX_IMPORT = True  # see moe_jax/__init__.py: jax only once the input is checked

from moe_jax.process_setup import reexec_with_hugepages  # noqa: E402

if __name__ == "__main__":  # first: a glibc tunable is read only when a process starts
    reexec_with_hugepages()

# Streamer and continuation too: tests read them from this script's namespace.
from moe_jax.cli.sample import Streamer, continuation, main  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
