"""Streaming export: a run's checkpoint -> a Hugging Face directory, one tensor at a time.

    arch, cfg = export_run(run_dir, out, step=None, architecture=None, dtype=None)

Nothing is restored whole: each parameter is a `lazy.Deferred` over the checkpoint's files
(`run.stream_save.CheckpointArrays`, one layer of a stacked parameter), the family tensor maps
slice and transpose it into the HF tensors, and `ShardWriter` reads each tensor's region,
writes it to its shard and drops it. Host memory: about the largest tensor (or one layer of
a parameter whose tensor map merges axes), whatever the model's size.

A LoRA run (lora.rank > 0) is written merged: each adapted weight W + (alpha / r) A B, in
float32 before the cast to `dtype` (`interop.peft.merged_reader`); its adapters alone go out
in PEFT's format with `interop.peft.export_adapter`. On a quantised base (lora.base_dtype int8
or mxfp4) each quantised weight is dequantised as it is read, region by region (int8: its
values and the scales of their channels; MXFP4: the 32-row blocks that cover the rows
asked for), by the model's own dequantisation (`QuantizedParam.dequantize`), so W is the
float32 weight the run trained against; the merge follows as for any LoRA run.

dtype: the parameters' own (the dtype holding most of their bytes: float32 for a trained
run, bf16 for a bf16 import) unless asked for, written as config.json's `torch_dtype`; on
a quantised base the run's compute dtype (model.dtype; auto: bfloat16, the accelerators'),
as no float dtype holds its weights. Each tensor is written in its params' stored dtype where
that is known to be its own: unasked, outside a LoRA run (whose adapters and quantised base
store dtypes of their own), every tensor in its stored dtype (a bf16 import keeps the float32
tensors of its source, as DeepSeek-V3's e_score_correction_bias); asked for, or in a LoRA
run, every tensor in `dtype` but the params the model keeps float32 (`moe.FLOAT32_PARAMS`),
never narrowed below their stored dtype.
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
from moe_jax.model import Transformer, fp4
from moe_jax.model.int8 import QUANTIZATIONS, QuantizedParam, quantize_model
from moe_jax.model.moe import FLOAT32_PARAMS
from moe_jax.run.checkpoints import open_checkpoints, read_failed, read_meta
from moe_jax.run.layout import CHECKPOINT_DIR
from moe_jax.run.stream_save import CheckpointArrays, unreadable

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
    family, hf_config = pick_family(cfg, architecture)
    if tokenizer.files:
        hf_config |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    quantised_base = cfg.lora.rank > 0 and cfg.lora.base_dtype in QUANTIZATIONS
    build = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    if quantised_base:  # the stored tree: the run's quantised base (`model.int8.quantize_model`)
        build = lambda: quantize_model(Transformer(cfg, rngs=nnx.Rngs(0)), cfg.lora.base_dtype)
    abstract = nnx.state(nnx.eval_shape(build), nnx.Param)
    try:  # a missing or truncated array: one line naming it, not a traceback
        arrays = CheckpointArrays(run_dir / CHECKPOINT_DIR / str(step), abstract)
        quantised = {p: v for p, v in nnx.to_flat_state(abstract) if isinstance(v, QuantizedParam)}
        for path, shape in _stored_shapes(arrays, quantised).items():
            if tuple(arrays.array(path).shape) != shape:
                where = ".".join(map(str, path))
                raise InteropError(
                    f"checkpoint {step} in '{run_dir}' does not match its config at {where}"
                )
        if dtype:
            out_dtype = DTYPES[dtype]
        elif quantised_base:
            out_dtype = DTYPES["float32" if cfg.model.dtype == "float32" else "bfloat16"]
        else:
            out_dtype = _params_dtype(arrays)
        tensor_dtype = _tensor_dtypes(arrays, out_dtype, own=not dtype and not cfg.lora.rank)
        total = sum(math.prod(s) * tensor_dtype((p,)).itemsize for p, s in arrays.shapes.items())
        tracker = progress(total) if progress is not None else None

        def read(path, block):
            if path in quantised:
                return _dequantised(arrays, path, block, quantised[path])
            return _deferred(arrays, path, block)

        if cfg.lora.rank:  # a LoRA run: each adapted weight written merged, W + (alpha / r) A B
            from moe_jax.interop.peft import merged_reader

            read = merged_reader(read, arrays.shapes, cfg.lora.alpha / cfg.lora.rank)
        write_hf(cfg, family, hf_config, read, out, tokenizer=tokenizer, dtype=out_dtype,
                 progress=tracker, tensor_dtype=tensor_dtype)  # fmt: skip
    except ValueError as e:
        if not unreadable(e):
            raise
        read_failed(manager, step, run_dir, "params", e)
    return family.architecture, cfg


def _tensor_dtypes(arrays: CheckpointArrays, dtype: np.dtype, own: bool):
    """-> the dtype of a tensor made of params `paths` (the module doc): with `own`, the
    widest they are stored in; else `dtype`, or the widest stored dtype of those the model
    keeps float32 where that is wider."""

    def of(paths: tuple) -> np.dtype:
        if own and paths:
            return max((arrays.dtype(p) for p in paths), key=lambda d: d.itemsize)
        kept = [arrays.dtype(p) for p in paths if p[-1] in FLOAT32_PARAMS]
        return max([dtype, *kept], key=lambda d: d.itemsize)

    return of


def _params_dtype(arrays: CheckpointArrays) -> np.dtype:
    """The dtype holding most of the params' bytes."""
    weight = Counter()
    for path, shape in arrays.shapes.items():
        weight[arrays.dtype(path)] += math.prod(shape)
    return weight.most_common(1)[0][0]


def _stored_shapes(arrays: CheckpointArrays, quantised: dict) -> dict:
    """The shape of every array the checkpoint must hold: a quantised weight's stored arrays
    (each under the weight's name and its key, as Orbax names a dict's leaves), the rest's
    own. Registers the stored arrays' names with `arrays`."""
    shapes = {p: s for p, s in arrays.shapes.items() if p not in quantised}
    for path, v in quantised.items():
        for key, a in v.get_raw_value().items():
            arrays.names[path + (key,)] = f"{arrays.names[path]}.{key}"
            shapes[path + (key,)] = tuple(a.shape)
    return shapes


def _dequantised(arrays: CheckpointArrays, path: tuple, block, param) -> Deferred:
    """Quantised weight `path` (layer `block` of a stacked one) as float32, each region
    dequantised from the stored arrays that cover it (the module doc)."""
    shape = arrays.shapes[path][0 if block is None else 1 :]
    lead = () if block is None else (block,)
    is_int8 = "q" in param.get_raw_value()
    read = lambda key, index: arrays.read(path + (key,), index)

    def int8(index):  # the values' region; the scales' size-1 (contracted) axes whole
        q = read("q", lead + index)
        scale_shape = arrays.array(path + ("scale",)).shape[len(lead) :]
        at = tuple(i if n > 1 else slice(0, 1) for i, n in zip(index, scale_shape, strict=True))
        return {"q": q, "scale": read("scale", lead + at)}

    def mxfp4(index):  # the 32-row blocks covering rows d of [..., D, F]
        *rest, d, f = index
        g = slice(d.start // fp4.BLOCK, -(-d.stop // fp4.BLOCK))
        return {"blocks": read("blocks", (*lead, *rest, g, slice(None), f)),
                "scales": read("scales", (*lead, *rest, g, f))}  # fmt: skip

    def compute(index):
        stored = int8(index) if is_int8 else mxfp4(index)
        w = np.asarray(param.dequantize(stored, ...), np.float32)
        if is_int8:
            return w
        d = index[-2]
        first = d.start - (d.start // fp4.BLOCK) * fp4.BLOCK
        return w[..., first : first + d.stop - d.start, :]

    return Deferred(shape, compute, np.float32)


def _deferred(arrays: CheckpointArrays, path: tuple, block: int | None) -> Deferred:
    """Param `path` (layer `block` of a stacked one), read only where it is used."""
    shape = arrays.shapes[path]
    lead = () if block is None else (block,)
    shape = shape if block is None else shape[1:]
    return Deferred(shape, lambda index: arrays.read(path, lead + tuple(index)), arrays.dtype(path))
