"""The form a model's weights take for inference: float32, bfloat16, int8 or mxfp4
(`sample.weights`).

    kind = weights_kind(cfg)                          # "auto" resolved: bfloat16 for a bf16 model
    model = abstract_model(cfg, kind)                 # shapes and dtypes, nothing allocated
    model = to_kind(model, kind)                      # a float model's weights in that form

Training keeps float32 master weights; sampling them at full size in float32 needs twice the
memory of bf16 (Mixtral-8x7B: 187 GB, where one H100 has 80). So a run is restored straight
into the form sampling uses:
- `bfloat16`: the matmul weights (attention, dense and expert SwiGLUs, head, token embedding,
  vision projection) stored in bf16. The model casts each of them to its compute dtype before
  use, so with `model.dtype=bfloat16` this changes no result at all. Norm scales, biases and
  the router stay float32: they are tiny, and the router's logits pick the experts.
- `int8`: per-channel int8 (`moe_jax.model.int8`), the quantised weights' float reads in the
  compute dtype's hands as before.
- `mxfp4`: the routed experts in MXFP4 (`moe_jax.model.fp4`: 4.25 bits a weight, gpt-oss's
  released form), every other matmul weight bfloat16.
- `float32`: as trained.
- `auto` (the default): bfloat16 when the compute dtype is bfloat16, else float32, i.e. the
  cheapest form that changes nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.errors import MoeJaxError
from moe_jax.model import Transformer
from moe_jax.model.int8 import CONTRACTED_AXES, QUANTIZATIONS, QuantizedParam, quantize_model

# Weights the model casts to its compute dtype before use (see the module doc).
MATMUL_WEIGHTS = (*CONTRACTED_AXES, "embedding", "vision_proj")


def weights_kind(cfg: Config, kind: str | None = None) -> str:
    """`kind` (default: cfg.sample.weights) with "auto" resolved."""
    kind = kind or cfg.sample.weights
    if kind == "auto":
        return "bfloat16" if backends.compute_dtype(cfg.model.dtype) == "bfloat16" else "float32"
    return kind


def _cast_matmul_weights(model: nnx.Module, dtype) -> nnx.Module:
    """`model` with its float matmul weights cast to `dtype` in place (abstract or concrete)."""
    for _, module in nnx.iter_modules(model):
        for name in MATMUL_WEIGHTS:
            w = getattr(module, name, None)
            if isinstance(w, nnx.Param) and not isinstance(w, QuantizedParam):
                value = w.get_value()
                if isinstance(value, jax.ShapeDtypeStruct):
                    cast = jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding)
                else:
                    cast = value.astype(dtype)
                w.set_value(cast)
    return model


def abstract_model(cfg: Config, kind: str, quantized: str | None = None) -> nnx.Module:
    """The abstract Transformer whose params have `kind`'s dtypes (`quantized`: the run's own
    quantisation, e.g. an int8 run written by `moe_jax.quantize`, which wins)."""
    build = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    mode = quantized or (kind if kind in QUANTIZATIONS else None)
    if mode:
        model = nnx.eval_shape(lambda: quantize_model(build(), mode))
        return _cast_matmul_weights(model, jnp.bfloat16) if mode == "mxfp4" else model
    model = nnx.eval_shape(build)
    return _cast_matmul_weights(model, jnp.bfloat16) if kind == "bfloat16" else model


def to_kind(model: nnx.Module, kind: str) -> nnx.Module:
    """A float model's weights in `kind`'s form (int8, mxfp4: a new model; bfloat16: cast in
    place)."""
    if kind == "int8":
        return quantize_model(model)
    if kind == "mxfp4":
        return _cast_matmul_weights(quantize_model(model, "mxfp4"), jnp.bfloat16)
    if kind == "bfloat16":
        return _cast_matmul_weights(model, jnp.bfloat16)
    return model


# ----------------------------------------------------------------------------- fitting


def device_memory(device: jax.Device) -> int | None:
    """Bytes an accelerator can allocate (None where the runtime does not say, as on CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # some runtimes raise instead of returning None
        return None
    return (stats or {}).get("bytes_limit")


def host_memory() -> int:
    """Bytes the host can still allocate (MemAvailable), which CPU devices share."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def _per_device(tree, extra=lambda path: 0) -> dict:
    """device -> bytes of `tree`'s leaves (abstract arrays with shardings) it holds, plus
    `extra(path)` bytes an element."""
    need: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shard = math.prod(leaf.sharding.shard_shape(leaf.shape))
        per = jnp.dtype(leaf.dtype).itemsize + extra(path)
        for device in leaf.sharding.device_set:
            need[device] = need.get(device, 0) + shard * per
    return need


def _shortfall(need: dict) -> str | None:
    """The shortfall, 'X GiB per device where Y has Z GiB', if `need` (device -> bytes)
    exceeds the memory: each accelerator's, or on a CPU host what its devices of this process
    need in all (they share the host's memory); None if it fits or no one can tell."""
    # one of this process's devices: another host's cannot report its memory
    device = next((d for d in need if d.process_index == jax.process_index()), next(iter(need)))
    if device.platform == "cpu":
        mine = [n for d, n in need.items() if d.process_index == device.process_index]
        needed, have, where = sum(mine), host_memory(), "this host has available"
    else:
        have = device_memory(device)
        if have is None:
            return None
        needed, where = max(need.values()), f"one {device.device_kind} has"
    if needed <= have:
        return None
    return f"{needed / 2**30:.1f} GiB per device where {where} {have / 2**30:.1f} GiB"


def check_fits(target, also: str | None = None) -> None:
    """Raise WeightsDoNotFit if restoring `target` (abstract params with their shardings)
    needs more than a device has: per accelerator, or in all on a CPU host, whose devices
    share its memory. `also="int8"` (or "mxfp4"): the quantised copy made after a float
    restore counts too (a byte an element: mxfp4's 0.53 rounded up)."""

    def int8_copy(path):  # a byte per element besides the float one, until it is freed
        return also in QUANTIZATIONS and any(
            getattr(k, "key", None) in CONTRACTED_AXES for k in path
        )

    if short := _shortfall(_per_device(target, int8_copy)):
        raise WeightsDoNotFit(
            f"the weights need {short}; shard them over more devices (mesh.expert, "
            "mesh.tensor, mesh.fsdp) or store them smaller (sample.weights=bfloat16 or int8)"
        )


def check_train_fits(abstract_state: dict) -> None:
    """Raise WeightsDoNotFit if the train state (abstract, with its shardings: params and
    optimizer state) and the gradients, as large as the params, exceed the devices' memory.
    The activations come on top: this is the floor, checked before anything is allocated."""
    need = _per_device(abstract_state)
    for device, n in _per_device(abstract_state["params"]).items():
        need[device] += n
    if short := _shortfall(need):
        raise WeightsDoNotFit(
            f"training needs at least {short} (the params, their gradients and the optimizer "
            "state; the activations come on top); shard it over more devices (mesh.fsdp, "
            "mesh.expert, mesh.tensor) or train a smaller model"
        )


class WeightsDoNotFit(MoeJaxError, ValueError):
    """The weights, in their form and sharding, need more memory than the devices have."""
