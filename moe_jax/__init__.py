"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

import os
import sys

from moe_jax.process_setup import import_jax

__version__ = "0.1.0"

# jax is imported here, without the CUDA plugin's no-driver lines, for every entry point
# (`python -m moe_jax.X`, the benchmarks, notebooks, the tests) but the commands that check
# their input first, the import taking seconds, and then call import_jax() themselves when
# they need jax: train.py and sample.py (`DEFER_JAX_IMPORT = True` above their first moe_jax
# import says so), their console scripts (known by name: the wrapper is pip's) and the
# modules of moe_jax.cli run with `python -m` (known by the interpreter's own arguments).
DEFERRING_SCRIPTS = ("moe-jax-train", "moe-jax-sample")


def _run_module() -> str:
    """The module of `python [options] -m MODULE ...`, else ''."""
    args = iter(getattr(sys, "orig_argv", [])[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if arg in ("-X", "-W"):  # the interpreter's options that take a value
            next(args, None)
        elif not arg.startswith("-"):  # the script: what follows is its own arguments
            break
    return ""


def _defers_jax() -> bool:
    script = os.path.basename((getattr(sys, "argv", None) or [""])[0])
    return (
        getattr(sys.modules.get("__main__"), "DEFER_JAX_IMPORT", False)
        or script in DEFERRING_SCRIPTS
        or _run_module().startswith("moe_jax.cli.")
    )


if not _defers_jax():
    import_jax()
