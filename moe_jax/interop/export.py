"""Streaming export: a run's checkpoint -> a Hugging Face directory, one tensor at a time.

    arch, cfg = export_run(run_dir, out, step=None, architecture=None, dtype=None)

Nothing is restored whole: each parameter is a `lazy.Deferred` over the checkpoint's files
(`run.stream_save.CheckpointArrays`, one layer of a stacked parameter), the family rules
slice and transpose it into the HF tensors, and `ShardWriter` reads each tensor's region,
writes it to its shard and drops it. Host memory: about the largest tensor (or one layer of
a parameter whose rule merges axes), whatever the model's size.

A LoRA run (lora.rank > 0) is written merged: each adapted weight W + (alpha / r) A B, in
float32 before the cast to `dtype` (`lora.peft.merged_reader`); its adapters alone go out
in PEFT's format with `lora.peft.export_adapter`.

dtype: the parameters' own (the dtype holding most of their bytes: float32 for a trained
run, bf16 for a bf16 import) unless asked for, written as config.json's `torch_dtype`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from moe_jax.config import Config
from moe_jax.interop.convert import pick_family, write_hf
from moe_jax.interop.lazy import Deferred
from moe_jax.interop.safetensors_io import InteropError
from moe_jax.model import Transformer
from moe_jax.run.layout import CHECKPOINT_DIR
from moe_jax.run.store import open_checkpoints, read_meta
from moe_jax.run.stream_save import CheckpointArrays

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def export_run(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    architecture: str | None = None,
    dtype: str | None = None,
    progress=None,
) -> tuple[str, Config]:
    """Write checkpoint `step` (default: the latest) of `run_dir` as the HF directory `out`
    (module doc). -> (the architecture written, the run's config). `progress(total)`: a
    `Progress` for the bytes to write, or None."""
    run_dir, out = Path(run_dir), Path(out)
    manager, step = open_checkpoints(run_dir, step)
    try:
        meta = read_meta(manager, step, run_dir)
    finally:
        manager.close()
    if meta.get("quantization"):
        raise InteropError(
            f"'{run_dir}' holds an {meta['quantization']} copy of a run; export the float run "
            f"it came from ({meta.get('source')})"
        )
    cfg, tokenizer = meta["config"], meta["tokenizer"]
    if cfg.lora.rank and cfg.lora.base_dtype in ("int8", "mxfp4"):
        raise InteropError(
            f"'{run_dir}' trained LoRA adapters on an {cfg.lora.base_dtype} base; export the "
            "adapters (python -m moe_jax.interop export-adapter) and merge them into the float "
            "base the run started from"
        )
    family, hf_config = pick_family(cfg, architecture)
    if tokenizer.files:
        hf_config |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    arrays = CheckpointArrays(run_dir / CHECKPOINT_DIR / str(step), abstract)
    for path, shape in arrays.shapes.items():
        if tuple(arrays.array(path).shape) != shape:
            where = ".".join(map(str, path))
            raise InteropError(
                f"checkpoint {step} in '{run_dir}' does not match its config at {where}"
            )
    out_dtype = DTYPES[dtype] if dtype else _params_dtype(arrays)
    total = sum(math.prod(s) for s in arrays.shapes.values()) * out_dtype.itemsize
    tracker = progress(total) if progress is not None else None
    read = lambda path, block: _deferred(arrays, path, block)
    if cfg.lora.rank:  # a LoRA run: each adapted weight written merged, W + (alpha / r) A B
        from moe_jax.lora.peft import merged_reader

        read = merged_reader(read, arrays.shapes, cfg.lora.alpha / cfg.lora.rank)
    write_hf(
        cfg, family, hf_config, read, out, tokenizer=tokenizer, dtype=out_dtype, progress=tracker
    )
    return family.architecture, cfg


def _params_dtype(arrays: CheckpointArrays) -> np.dtype:
    """The dtype holding most of the params' bytes."""
    weight = Counter()
    for path, shape in arrays.shapes.items():
        weight[arrays.dtype(path)] += math.prod(shape)
    return weight.most_common(1)[0][0]


def _deferred(arrays: CheckpointArrays, path: tuple, block: int | None) -> Deferred:
    """Param `path` (layer `block` of a stacked one), read only where it is used."""
    shape = arrays.shapes[path]
    lead = () if block is None else (block,)
    shape = shape if block is None else shape[1:]
    return Deferred(shape, lambda index: arrays.read(path, lead + tuple(index)), arrays.dtype(path))
