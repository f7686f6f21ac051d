"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

import sys

from moe_jax.runtime import import_jax

__version__ = "0.1.0"

# jax is imported here, without the CUDA plugin's no-driver lines, for every entry point
# (`python -m moe_jax.X`, the benchmarks, notebooks, the tests) but train.py and sample.py:
# they check their input before the import, which takes seconds, and then call import_jax()
# themselves; `DEFER_JAX_IMPORT = True` above their first moe_jax import says so.
if not getattr(sys.modules.get("__main__"), "DEFER_JAX_IMPORT", False):
    import_jax()
