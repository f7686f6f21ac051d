"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

import importlib.util
import os
import re
import sys
import tempfile

__version__ = "0.1.0"

# What jax's CUDA plugin logs from each of its extension modules as jax is imported on a
# machine without an NVIDIA driver (the `aot` extra compiles for GPUs without one).
_NO_DRIVER_NOISE = re.compile(r"cudart_stub\.cc|All log messages before absl::InitializeLog")


def _import_jax_without_driver_noise() -> None:
    """Import jax with fd 2 held, then pass on everything but the no-driver lines: every CLI
    and test would otherwise open with six lines saying that this machine has no GPU."""
    if "jax" in sys.modules or importlib.util.find_spec("jax_cuda12_plugin") is None:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            import jax  # noqa: F401
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
    sys.stderr.write("".join(s for s in text.splitlines(True) if not _NO_DRIVER_NOISE.search(s)))


_import_jax_without_driver_noise()
