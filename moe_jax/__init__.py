"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

import sys

from moe_jax.runtime import import_jax

__version__ = "0.1.0"

# Importing the package does not import jax: train.py and sample.py check their input first
# and then call import_jax(). `python -m moe_jax.X` modules import jax at their top, so for
# them (sys.argv[0] is "-m" while Python finds X) it is done here, without the no-driver lines.
if sys.argv[:1] == ["-m"]:
    import_jax()
