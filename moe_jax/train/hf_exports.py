"""Hugging Face copies of a run while it trains: `checkpoint.export_hf=N` writes the checkpoint
of every N-th save, and of the last step, as `RUN_DIR/hf/step_S/` (config.json, safetensors,
the run's tokenizer files), which transformers, vLLM and SGLang load as they are.

Each copy is the streaming export (`interop.export.export_run`: one tensor in host memory at a
time) of a save already on disk, written by process 0 into a temporary sibling renamed into
place when whole, so a copy is complete or absent. The weights are in the compute dtype of
the run (bf16 for a bf16 run), as `torch_dtype` says. That the architecture has a Hugging
Face form is checked before training starts, so a run does not fail at its first export.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax

from moe_jax import backends
from moe_jax.config import Config, ConfigError

HF_DIR = "hf"


def check(cfg: Config) -> None:
    """ConfigError (one line) if `checkpoint.export_hf` is on and no Hugging Face architecture
    represents the model."""
    if cfg.checkpoint.export_hf <= 0:
        return
    from moe_jax.interop.convert import pick_family
    from moe_jax.interop.safetensors_io import InteropError

    try:
        pick_family(cfg)
    except InteropError as e:
        raise ConfigError(f"checkpoint.export_hf: {e}; or set checkpoint.export_hf=0") from None


def due(cfg: Config, saves: int, final: bool) -> bool:
    """Whether the save just made (the `saves`-th of this invocation) gets a copy."""
    n = cfg.checkpoint.export_hf
    return n > 0 and (final or saves % n == 0)


def export(cfg: Config, step: int) -> Path | None:
    """Checkpoint `step` of the run (saved and finished) as `RUN_DIR/hf/step_<step>`, written
    on process 0 (None elsewhere). -> the directory."""
    if jax.process_index() != 0:
        return None
    from moe_jax.interop.export import export_run

    out = Path(cfg.run_dir) / HF_DIR / f"step_{step}"
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # a copy an earlier invocation left unfinished
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if backends.compute_dtype(cfg.model.dtype) == "bfloat16" else "float32"
    try:
        export_run(cfg.run_dir, tmp, step=step, dtype=dtype)
        shutil.rmtree(out, ignore_errors=True)  # the same step exported by an earlier run
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
