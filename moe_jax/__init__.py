"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

import os
import sys

from moe_jax.runtime import import_jax

__version__ = "0.1.0"

# jax is imported here, without the CUDA plugin's no-driver lines, for every entry point
# (`python -m moe_jax.X`, the benchmarks, notebooks, the tests) but train.py and sample.py and
# their console scripts: they check their input before the import, which takes seconds, and
# then call import_jax() themselves; `DEFER_JAX_IMPORT = True` above the scripts' first
# moe_jax import says so, and a console script is known by its name (its wrapper is pip's).
DEFERRING_SCRIPTS = ("moe-jax-train", "moe-jax-sample")
_script = os.path.basename((getattr(sys, "argv", None) or [""])[0])
if not (
    getattr(sys.modules.get("__main__"), "DEFER_JAX_IMPORT", False) or _script in DEFERRING_SCRIPTS
):
    import_jax()
