"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models.

The package in layers, lowest first. A module imports only from its own unit or from a unit
before it in `LAYERS` (tests/test_imports.py checks every import, at a module's top or in a
function), so any layer can be read and tested without those above it:

    base    errors, process_setup (jax's import and the host), kernels/ (fused kernels that
            stand alone), backends (the kernel choice), named_scopes, config/, tokenizer/
    core    sharding (the mesh and its rules), model/ (the decoder, its layers and loss),
            data/ (corpora, token stores, SFT / preference / prompt rows)
    runs    run/ (a run directory: layout, lock, outputs, Orbax checkpoints, the policy of a
            resume, the command door)
    rooms   interop/ (Hugging Face and PEFT formats), summary/ (parameter and FLOP accounting),
            observe/ (metric writers, trackers, plots, profiles), inference/ (sampling, the
            engine, loading a run for inference)
    jobs    posttrain/ (LoRA, DPO, RL), eval/, train/ (the loop and its step), serve/
    tools   aot/, prepare, quantize, plot, profile (the last two: doors of observe/'s
            commands) and cli/ (the `moe-jax` command, train.py and sample.py); __main__
            (`python -m moe_jax`, the same command)
"""

import os
import sys

from moe_jax.process_setup import import_jax

__version__ = "0.1.0"

# The units of the layering above, lowest first (a unit: a top-level module or package).
LAYERS = (
    ("errors", "process_setup", "kernels", "backends", "named_scopes", "config", "tokenizer"),
    ("sharding", "model", "data"),
    ("run",),
    ("interop", "summary", "observe", "inference"),
    ("posttrain", "eval", "train", "serve"),
    ("aot", "prepare", "quantize", "plot", "profile", "cli", "__main__"),
)

# jax is imported here, without the CUDA plugin's no-driver lines, for every entry point
# (`python -m moe_jax.X`, the benchmarks, notebooks, the tests) but the commands that check
# their input first, the import taking seconds, and then call import_jax() themselves when
# they need jax: train.py and sample.py (`DEFER_JAX_IMPORT = True` above their first moe_jax
# import says so), the console scripts (known by name: the wrapper is pip's) and the modules of
# moe_jax.cli run with `python -m`, or moe_jax itself (known by the interpreter's arguments).
# `moe-jax` imports jax for the subcommands that do not defer it (moe_jax/cli/main.py).
DEFERRING_SCRIPTS = ("moe-jax", "moe-jax-train", "moe-jax-sample")


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
        or _run_module() == "moe_jax"  # `python -m moe_jax`: the `moe-jax` command
    )


if not _defers_jax():
    import_jax()
