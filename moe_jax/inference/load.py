"""Loading a run for inference: its checkpoint's meta, and the model built from it.

cfg, model, tokenizer = load_run("runs/tiny")            # latest checkpoint, params on host
cfg, model, tokenizer = load_run("runs/tiny", step=200)  # a given step
    # cfg: the resolved Config saved with the checkpoint; model: a `Transformer` with the
    # checkpoint's params; tokenizer: the run's tokenizer (`.encode(text)`, `.decode(ids)`).
    # A Hugging Face model directory (config.json + safetensors) loads too, as a run at step 0
    # whose weights stream onto the devices (moe_jax.interop.as_run): nothing is written.
RunError(ValueError)   # missing run dir, no checkpoint, unknown step, incompatible config;
                       # CLIs print `error: <message>` and exit 2.
meta = read_run_meta("runs/tiny")    # {"step", "config", "tokenizer", "fingerprint", ...}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from moe_jax.config import MESH_AXES, Config, sampling_config
from moe_jax.config.checks import check_inference
from moe_jax.inference.sampling import Sampler
from moe_jax.inference.speculative import SpeculativeSampler
from moe_jax.inference.weights import (
    WeightsDoNotFit,
    abstract_model,
    check_fits,
    to_kind,
    weights_kind,
)
from moe_jax.interop.as_run import hf_meta, hf_params, is_hf_dir, packs_mxfp4
from moe_jax.interop.stream import to_devices
from moe_jax.model.int8 import QUANTIZATIONS, QuantizedParam
from moe_jax.run.checkpoints import (
    CheckpointRemoved,
    open_checkpoints,
    read_failed,
    read_meta,
    restore,
)
from moe_jax.run.layout import CHECKPOINT_DIR, RunError
from moe_jax.run.policy import check_compatible
from moe_jax.run.stream_save import CheckpointArrays
from moe_jax.sharding import INFERENCE_RULES, make_mesh, state_shardings
from moe_jax.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class OpenRun:
    """A run's checkpoint opened for reading: its meta read once. A Hugging Face directory
    (`interop.as_run`) opens as one at step 0 without a manager."""

    run_dir: Path
    manager: ocp.CheckpointManager | None
    step: int
    meta: dict  # as `read_run_meta` returns it


def open_run(run_dir: str | Path, step: int | None = None) -> OpenRun:
    """The run's checkpoint (latest or `step`) and its meta; RunError names what is missing."""
    run_dir = Path(run_dir)
    if is_hf_dir(run_dir):  # a Hugging Face directory reads as a run at step 0
        if step not in (None, 0):
            raise RunError(f"'{run_dir}' is a Hugging Face directory: it has step 0 only")
        return OpenRun(run_dir, None, 0, hf_meta(run_dir))

    def read(step):
        manager, step = open_checkpoints(run_dir, step)
        return OpenRun(run_dir, manager, step, read_meta(manager, step, run_dir) | {"step": step})

    return newest_again(read, step)


# Each retry means that training saved a newer checkpoint while one was read: after this many,
# the reader is slower than the run's checkpoint interval and is told so.
READ_TRIES = 5


def newest_again(read: Callable[[int | None], T], step: int | None) -> T:
    """`read(step)`; where no step was asked for and the checkpoint read, the newest then, was
    removed meanwhile (a run training there keeps only its newest `checkpoint.keep`),
    `read(None)` again: the newest now. A step asked for stays asked for."""
    for _ in range(READ_TRIES - 1 if step is None else 0):
        try:
            return read(None)
        except CheckpointRemoved:
            pass
    return read(step)


def read_run_meta(run_dir: str | Path, step: int | None = None) -> dict:
    """The checkpoint's meta (latest or `step`): "step", "config" (a Config), "tokenizer",
    "fingerprint", and "quantization" / "source" for an inference-only copy."""
    return open_run(run_dir, step).meta


def load_run(
    run_dir: str | Path,
    step: int | None = None,
    *,
    cfg: Config | None = None,
    mesh: jax.sharding.Mesh | None = None,
    weights: str = "float32",
) -> tuple[Config, nnx.Module, Tokenizer]:
    """(config, Transformer with the checkpoint's params, tokenizer): `load_model` of
    `open_run(run_dir, step)`."""
    read = lambda step: load_model(open_run(run_dir, step), cfg=cfg, mesh=mesh, weights=weights)
    return newest_again(read, step)


def load_model(
    run: OpenRun,
    *,
    cfg: Config | None = None,
    mesh: jax.sharding.Mesh | None = None,
    weights: str = "float32",
) -> tuple[Config, nnx.Module, Tokenizer]:
    """(config, Transformer with the opened checkpoint's params, tokenizer).

    `cfg`: the run's config with inference-time changes (mesh, model.dtype, sample.*; see
    `config.sampling_config`), else the saved one. `mesh`: restore each weight straight onto it,
    sharded by `sharding.INFERENCE_RULES` (no device or host ever holds a whole copy),
    else onto the first device. `weights`: the form to restore the weights in
    (`moe_jax.inference.weights`: float32, bfloat16, int8, mxfp4, auto); a run written by
    `moe_jax.quantize` keeps its quantisation whatever it says. Float weights are cast as they
    are read; int8 or mxfp4 of a float run is quantised after a float restore (bf16 where the
    compute is), which holds both forms for a moment. RunError before anything is read if the
    weights would not fit the devices."""
    run_dir, manager, step, meta = run.run_dir, run.manager, run.step, run.meta
    if cfg is None:
        cfg = meta["config"]
    else:
        check_compatible(meta, cfg, "load", run_dir)
    quantized = meta.get("quantization")
    if not quantized and cfg.lora.rank and cfg.lora.base_dtype in QUANTIZATIONS:
        quantized = cfg.lora.base_dtype  # a LoRA run's frozen base, stored quantised
    if quantized and quantized not in QUANTIZATIONS:
        raise RunError(
            f"checkpoint {step} in '{run_dir}' is quantised as '{quantized}', which this "
            "version of moe_jax does not know"
        )
    kind = weights_kind(cfg, weights)
    if manager is None and kind == "mxfp4" and packs_mxfp4(run_dir):
        quantized = "mxfp4"  # gpt-oss's experts taken packed as they are stored
    # What is restored: int8 runs as int8; a float run as `auto` floats, quantised afterwards.
    quantize_after = kind in QUANTIZATIONS and not quantized
    restore_kind = weights_kind(cfg, "auto") if kind in QUANTIZATIONS else kind
    graphdef, abstract_params = nnx.split(abstract_model(cfg, restore_kind, quantized), nnx.Param)
    if mesh is None:
        target = on_device(abstract_params, jax.devices()[0])
    else:
        shardings = state_shardings(abstract_params, mesh, INFERENCE_RULES)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_params,
            shardings,
        )
    try:
        check_fits(target, also=kind if quantize_after else None)
    except WeightsDoNotFit as e:
        raise RunError(f"run '{run_dir}': {e}") from None
    if manager is None:  # a Hugging Face directory: streamed onto the target
        params = hf_params(run_dir, target, cfg)
    elif in_turn(target):
        params = restore_in_turn(manager, step, run_dir, target)
    else:
        params = restore(manager, step, run_dir, params=ocp.args.StandardRestore(target)).params
    model = nnx.merge(graphdef, params)
    if quantize_after:
        model = to_kind(model, kind)
    return cfg, model, meta["tokenizer"]


def restore_params(run_dir: str | Path, step: int | None, target, or_newest: bool = False):
    """-> (the params of a checkpoint, latest or `step`, restored into `target`: abstract
    arrays with the shardings and dtypes to restore onto; its step). Read-only, like
    `load_run`, float params in turn as it reads them (`restore_in_turn`). `or_newest`: if
    `step` was removed while reading, the newest instead."""
    run_dir = Path(run_dir)
    if is_hf_dir(run_dir):  # a Hugging Face directory: streamed onto the target
        return hf_params(run_dir, target), 0

    def read(step):
        manager, step = open_checkpoints(run_dir, step)
        try:
            if in_turn(target):  # float params (init_from=RUN): as load_model reads them
                return restore_in_turn(manager, step, run_dir, target), step
            args = ocp.args.StandardRestore(target)
            return restore(manager, step, run_dir, params=args).params, step
        finally:
            manager.close()

    try:
        return read(step)
    except CheckpointRemoved:
        if not or_newest:
            raise
        return read(None)


def in_turn(target) -> bool:
    """Whether `restore_in_turn` reads `target`: float params only (a quantised weight is a
    dict of arrays, which Orbax restores)."""
    flat = nnx.to_flat_state(target)
    return all(not isinstance(v, QuantizedParam) for _, v in flat) and all(
        jnp.issubdtype(v.get_raw_value().dtype, jnp.floating) for _, v in flat
    )


def restore_in_turn(manager: ocp.CheckpointManager, step: int, run_dir: Path, target):
    """The params of checkpoint `step` laid out like `target` (float params: their shardings
    and dtypes), read as an HF directory's are (`interop.stream.to_devices`): one parameter
    (a large stacked one, one layer) at a time from its zarr array, cast on the host to the
    target's dtype and placed before the next is read. Orbax's restore reads every array at
    once, each through a host buffer that lives until its device copy has run: the imported
    Qwen3-30B-A3B-width run of 4 layers peaked at 2.2x its bf16 weights where its HF
    directory peaked at 1.18x (benchmarks/hf_import_memory.py --sample). A failed read is
    told as `restore` tells it: a stop, a checkpoint removed meanwhile, or damage."""
    flat = dict(nnx.to_flat_state(target))
    raw = {p: v.get_raw_value() for p, v in flat.items()}
    dtypes = {p: np.dtype(a.dtype) for p, a in raw.items()}
    try:
        arrays = CheckpointArrays(run_dir / CHECKPOINT_DIR / str(step), target)
        placed = to_devices(
            {p: a.sharding for p, a in raw.items()},
            {p: tuple(a.shape) for p, a in raw.items()},
            dtypes,
            lambda p: p[0] == "blocks",  # a block's layers stacked on the leading axis
            lambda p, index: arrays.read(p, index).astype(dtypes[p], copy=False),
        )
    except Exception as e:
        read_failed(manager, step, run_dir, "params", e)
    return nnx.from_flat_state([(p, v.copy(placed[p])) for p, v in flat.items()])


def on_device(abstract_tree, device: jax.Device):
    """Restore target: each leaf's shape and dtype, placed whole on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_tree
    )


def load_sampler(run_dir, overrides: Sequence[str] = (), step: int | None = None):
    """-> (config, Sampler, tokenizer) of a run's checkpoint (default: the latest), restored
    onto the mesh its config names after `overrides` (mesh.*, model.dtype, sample.*, as
    sample.py takes them): sharded, in the `sample.weights` form, held once. ConfigError /
    RunError (a mesh that does not divide the model, weights that do not fit) name the fix.
    With sample.speculative, a `SpeculativeSampler` (drafts from the model's MTP module)."""

    def read(step):
        run = open_run(run_dir, step)  # its meta read once, for the config and the weights
        cfg = sampling_config(run.meta["config"], overrides)
        check_inference(cfg)  # before any weight is read
        one_device = all(getattr(cfg.mesh, ax) == 1 for ax in MESH_AXES)
        mesh = None if one_device else make_mesh(cfg, inference=True)
        cfg, model, tokenizer = load_model(run, cfg=cfg, mesh=mesh, weights=cfg.sample.weights)
        kind = SpeculativeSampler if cfg.sample.speculative else Sampler
        return cfg, kind(model, mesh=mesh, consume=True), tokenizer

    return newest_again(read, step)
