"""LoRA in the train state: which params train, the frozen base, merging.

    trained, frozen = split(params)               # the adapters' A and B / everything else
    params = join(trained, frozen)
    tx = adapters_only(tx)                        # optimizer state for the adapters alone
    model = quantized_base(model, base_dtype)     # int8 / mxfp4: the base's matmuls quantised
    params = with_base_dtype(params, base_dtype)  # the other frozen weights in base_dtype
    read_into = float_target(target)              # init_from into a quantised base: read
    params = quantize_restored(params, target)    # the source in bf16, then quantise it
    params = fresh_adapters(params, seed)         # new adapters (A random, B 0) on a base
    params = merge_into_base(params)              # W + (alpha / r) A B, the adapters gone

A params tree without adapters (lora.rank 0) goes through all of these unchanged: `split`
gives it whole as the trained part, so full fine-tuning's step is the step it always was.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe_jax.model import fp4
from moe_jax.model.int8 import (
    CONTRACTED_AXES,
    QUANTIZATIONS,
    Int8Param,
    QuantizedParam,
    quantize_model,
    quantize_tensor,
)
from moe_jax.model.lora import PREFIX, SEEDS, product

TRAINED = ("a", "b")  # an adapter's leaves that train (its `seed` does not)


def _key_name(k) -> str:
    """A path element's name (flat nnx paths hold plain keys, jax tree paths wrap them)."""
    return str(getattr(k, "key", getattr(k, "name", k)))


def is_trained(path, _=None) -> bool:
    """An adapter's A or B (path ... lora_<weight>/a|b)."""
    names = [_key_name(k) for k in path]
    return len(names) >= 2 and names[-2].startswith(PREFIX) and names[-1] in TRAINED


def is_adapter(path, _=None) -> bool:
    return any(_key_name(k).startswith(PREFIX) for k in path)


def has_adapters(params) -> bool:
    """Whether a params tree (an nnx State or any pytree of them) holds adapters."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return any(is_adapter(p) for p, _ in paths)


def split(params) -> tuple:
    """(the adapters' A and B, the rest) of an nnx params State; (params, None) without
    adapters (then everything trains)."""
    if not has_adapters(params):
        return params, None
    return nnx.split_state(params, is_trained, ...)


def join(trained, frozen):
    return trained if frozen is None else nnx.merge_state(trained, frozen)


def adapters_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` over the trained part of the params (`split`): `init(params)` makes state for
    the adapters alone where there are any (all params otherwise), and `update` takes
    gradients of that part (the train step differentiates nothing else)."""

    def init(params):
        return tx.init(split(params)[0])

    def update(grads, state, params=None):
        trained = None if params is None else split(params)[0]
        return tx.update(grads, state, trained)

    return optax.GradientTransformation(init, update)


def quantized_base(model: nnx.Module, base_dtype: str) -> nnx.Module:
    """`model` with its frozen base's matmul weights quantised where `base_dtype`
    (lora.base_dtype) is int8 (every matmul weight but the router's, one scale per output
    channel) or mxfp4 (the routed experts' weights): `model.int8.quantize_model`, whose
    weights dequantise as each layer reads them. The adapters stay float32 (their names are
    no weight's); `model` itself for a float base."""
    return quantize_model(model, base_dtype) if base_dtype in QUANTIZATIONS else model


def with_base_dtype(params, dtype: str):
    """The params with the frozen base's matmul weights (floating, 2 dims or more, not an
    adapter's, not quantised) cast to `dtype` (bfloat16 beside an int8 or mxfp4 base: the
    embedding, the router, what mxfp4 leaves); vectors (norm scales, biases, the router's
    correction bias updated outside the gradient) stay as they are."""
    dtype = "bfloat16" if dtype in QUANTIZATIONS else dtype

    def cast(path, v):
        if isinstance(v, QuantizedParam) or is_adapter(path):
            return v
        a = v[...]
        if a.ndim < 2 or not jnp.issubdtype(a.dtype, jnp.floating):
            return v
        return v.replace(a.astype(dtype))

    flat = [(p, cast(p, v)) for p, v in nnx.to_flat_state(params)]
    return nnx.from_flat_state(flat)


def float_target(target):
    """The restore target of a quantised base's float source (`init_from`): each quantised
    weight of `target` (abstract, laid out) as a plain bfloat16 Param of the weight's shape,
    laid out as the weight is (its logical axes); the rest of `target` as it is."""
    from moe_jax.sharding import logical_to_spec

    def one(v):
        if not isinstance(v, QuantizedParam):
            return v
        shape = v.get_value().shape  # the dequantised weight's (abstract)
        sharding = getattr(next(iter(v.get_raw_value().values())), "sharding", None)
        if sharding is not None:
            spec = logical_to_spec(tuple(v.get_metadata()["out_sharding"]))
            sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
        value = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
        return nnx.Param(value, **v.get_metadata())

    return jax.tree.map(one, target, is_leaf=lambda x: isinstance(x, nnx.Variable))


def quantize_restored(params, target):
    """`params` (restored into `float_target(target)`) with each weight that `target` holds
    quantised quantised onto its layout: weight by weight, each float array freed once its
    quantised form exists, and a stacked weight one layer at a time, so that the peak is the
    bfloat16 base and one layer's float32 temporaries, not a float32 copy of a weight."""
    flat_target = dict(nnx.to_flat_state(target))
    out = []
    for p, v in nnx.to_flat_state(params):
        t = flat_target[p]
        if isinstance(t, QuantizedParam):
            w = v[...]
            raw = _quantized(w, p[-1], isinstance(t, Int8Param))
            shardings = {k: a.sharding for k, a in t.get_raw_value().items()}
            if all(s is not None for s in shardings.values()):
                raw = {k: jax.device_put(a, shardings[k]) for k, a in raw.items()}
            w.delete()
            v = type(t)(raw, **t.get_metadata())
        out.append((p, v))
    return nnx.from_flat_state(out)


def _quantized(w: jax.Array, name: str, int8: bool) -> dict:
    """Weight `name`'s stored arrays (int8's or mxfp4's), a leading axis at a time where it
    is not contracted (a layer stack's, the experts')."""
    axes = CONTRACTED_AXES[name]
    one = (lambda x: quantize_tensor(x, axes)) if int8 else fp4.quantize
    if -w.ndim in axes or w.ndim < 3:  # axis 0 contracted (or no stack): whole
        return one(w)
    return jax.jit(lambda w: jax.lax.map(one, w))(w)


def fresh_adapters(params, key: jax.Array):
    """The params with every adapter new: A normal with std 1/sqrt(fan in), B zero, seeds
    random (the model's own initialisation, `adapters.attach`), each leaf from `key` folded
    with its index. For a run started from a base (`init_from`), whose checkpoint holds
    none: `params` is the restored base joined with the abstract adapters."""
    flat = list(nnx.to_flat_state(params))
    adapters = {p: v for p, v in flat if is_adapter(p)}
    lead = _lead_dims(adapters)
    out = []
    for i, (p, v) in enumerate(flat):
        if p in adapters:
            k = jax.random.fold_in(key, i)
            name, shape = p[-1], v.shape
            sharding = getattr(v.get_raw_value(), "sharding", None)
            if name == "a":
                fan_in = math.prod(shape[lead[p[:-1]] : -1])  # A [lead..., in..., r]
                value = jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5
            elif name == "b":
                value = jnp.zeros(shape, jnp.float32)
            else:
                value = jax.random.randint(k, shape, 0, SEEDS).astype(jnp.float32)
            value = jax.device_put(value, sharding) if sharding is not None else value
            v = v.replace(value)
        out.append((p, v))
    return nnx.from_flat_state(out)


def _lead_dims(adapters: dict) -> dict:
    """Each adapter's (its path) leading dims of A before its input dims: the layer stack's
    (where its seed has one) and the routed experts' axis."""
    return {
        p[:-1]: v.ndim + (p[-3] == "experts" if len(p) >= 3 else 0)
        for p, v in adapters.items()
        if p[-1] == "seed"
    }


def merge_into_base(params, scale: float):
    """The params of the base model alone: each adapted weight W + `scale` A B (scale =
    lora.alpha / lora.rank), in W's dtype, the adapters dropped."""
    flat = dict(nnx.to_flat_state(params))
    lead = _lead_dims({p: v for p, v in flat.items() if is_adapter(p)})
    out = []
    for p, v in flat.items():
        if is_adapter(p):
            continue
        ad = p[:-1] + (PREFIX + p[-1],)
        if ad in lead:
            w = v[...]
            ab = product(flat[ad + ("a",)][...], flat[ad + ("b",)][...], lead[ad])
            v = v.replace((w.astype(jnp.float32) + scale * ab).astype(w.dtype))
        out.append((p, v))
    return nnx.from_flat_state(out)


def start_adapters(base, adapters_abstract, cfg):
    """A run's params from a restored base (`init_from`) and its abstract adapters: new
    ones (`fresh_adapters`, from cfg.seed), or with lora.init_adapter a PEFT adapter's,
    each placed on its abstract sharding (seeds fresh either way)."""
    params = fresh_adapters(nnx.merge_state(base, adapters_abstract), jax.random.key(cfg.seed))
    if not cfg.lora.init_adapter:
        return params
    from pathlib import Path

    from moe_jax.interop.peft import adapters_from_peft

    read = adapters_from_peft(cfg, Path(cfg.lora.init_adapter))
    flat = []
    for p, v in nnx.to_flat_state(params):
        if p in read:
            sharding = getattr(v.get_raw_value(), "sharding", None)
            value = jnp.asarray(read[p], v.get_raw_value().dtype)
            v = v.replace(jax.device_put(value, sharding) if sharding is not None else value)
        flat.append((p, v))
    return nnx.from_flat_state(flat)
