"""`python -m moe_jax.quantize RUN_DIR --out RUN_DIR_INT8 [--mode int8|mxfp4]`: the command's door;
the quantisation of a run is `moe_jax.inference.quantize`."""

import sys

from moe_jax.inference.quantize import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
