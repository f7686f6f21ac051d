"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

import importlib.util
import re
import sys

from moe_jax.runtime import held_stderr

__version__ = "0.1.0"

# What jax's CUDA plugin logs from each of its extension modules as jax is imported on a
# machine without an NVIDIA driver (the `aot` extra compiles for GPUs without one).
_NO_DRIVER_NOISE = re.compile(r"cudart_stub\.cc|All log messages before absl::InitializeLog")


def _import_jax_without_driver_noise() -> None:
    """Import jax with fd 2 held, then pass on everything but the no-driver lines: every CLI
    and test would otherwise open with six lines saying that this machine has no GPU."""
    if "jax" in sys.modules or importlib.util.find_spec("jax_cuda12_plugin") is None:
        return
    with held_stderr(lambda line: not _NO_DRIVER_NOISE.search(line)):
        import jax  # noqa: F401


_import_jax_without_driver_noise()
