"""Weight-only int8 (and MXFP4) parameters for inference: the quantised model itself.

    qmodel = quantize_model(model)            # a new Transformer; `model` is left as it was
    qmodel = quantize_model(model, "mxfp4")   # the routed experts MXFP4 (`fp4.py`), the rest as is

This is the model's half of int8 inference, imported by the model (`after`), the sampler and
the checkpoint reader (which rebuilds int8 runs); int8 run directories are written by
`python -m moe_jax.quantize` (moe_jax/quantize.py), which builds on it.

What is quantised: every matmul weight of attention (wq, wk, wv, wo), of the dense and shared
SwiGLU MLPs and of the routed experts (w_gate, w_up, w_down), and the output head. What stays
float32: the token embedding (a lookup, not a matmul), norms, biases, the router (its logits
pick the experts, and a flipped top-k choice costs far more than the int8 error elsewhere; it
is E columns wide, so tiny) and the vision projection. Tied embeddings keep their head float.

Scheme: symmetric, one scale per output channel: `w ~= scale * q` with q = round(w / scale) in
[-127, 127] and scale = max |w| over the contracted axes / 127 (so |w - scale * q| <= scale / 2).
A weight [D, H, hd] (wq, contracted over D) gets scales [1, H, hd]; an expert's [E, D, F] gets
[E, 1, F]; a stacked layer axis in front gets its own scales like any other output axis.

How it runs: each such weight becomes an `Int8Param`, an `nnx.Param` whose stored value is
{"q": int8, "scale": float32} and whose read (`w[...]`, as all model code reads weights)
returns the dequantised float32 array, so attention.py and moe.py run unchanged; Orbax
checkpoints, `nnx.split` / `merge`, `jit` and the layer `lax.scan` see two ordinary leaves per
weight. Memory holds the int8 values. The dequantisation is an elementwise op at the point of
use: the model passes each layer through `after(x, layer)`, which makes it wait for the
layer's input, so XLA neither hoists it out of the sampler's decode loop nor does all layers'
at once (see `after`); the decode path's gather of the picked experts fuses with it and reads
only those experts' int8 rows. XLA:CPU's matmuls take float operands, so on CPU one layer's
dequantised weights are a temporary buffer while that layer runs.

Why not qwix (google/qwix 0.1.8, evaluated): its NNX PTQ path finds a weight by walking the
Python call stack for `self` and matching the matmul's operand to one of that module's own
`nnx.Param` attributes, then swaps in the quantised value with `setattr` during a first call.
Our models defeat all three steps: the expert matmuls run in free functions (under
`jax.vmap`, `lax.map`, `shard_map`) on weights owned by the child `Experts` module, the decode
path gathers the picked experts' rows first (the operand is a gather, not the param), the
stacked layers run on `nnx.merge`d copies inside `lax.scan`, and `jnp.matmul` traces the dot
inside its own jit, so the `setattr` fails with "Cannot mutate ... from different trace
level" (tried on the tiny model, dense and MoE, scanned or not). Using its explicit
`qwix.einsum` with QArrays instead would mean rewriting every call site of attention.py and
moe.py for one scheme this file implements in a few lines.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import reprlib

from moe_jax.errors import MoeJaxError
from moe_jax.model import fp4

QUANTIZATIONS = ("int8", "mxfp4")
# Weights to quantise, by attribute name, and the axes each contracts over (all others are
# output channels with a scale each). Negative: a stacked layer axis in front changes nothing.
CONTRACTED_AXES = {
    "wq": (-3,),
    "wk": (-3,),
    "wv": (-3,),
    "wo": (-3, -2),
    "w_gate": (-2,),
    "w_up": (-2,),
    "w_down": (-2,),
    "head": (-2,),
}
QMAX = 127  # symmetric: -128 is never used


class QuantizeError(MoeJaxError, ValueError):
    """A quantisation request that cannot be done; the message names the fix."""


def _dequantize(raw: dict, index):
    q, scale = raw["q"], raw["scale"]
    if index is ...:
        return q.astype(jnp.float32) * scale
    # Index the int8 values before converting, so a gather reads only the picked rows.
    return q[index].astype(jnp.float32) * jnp.broadcast_to(scale, q.shape)[index]


class QuantizedParam(nnx.Param):
    """A weight stored quantised (a dict of arrays); reads dequantise (`dequantize`)."""

    dequantize = staticmethod(_dequantize)

    def get_value(self, *, index=...):
        raw = self.get_raw_value()
        if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(raw)):
            return jax.eval_shape(partial(self.dequantize, index=index), raw)  # abstract model
        return self.dequantize(raw, index)

    def tied(self, k) -> QuantizedParam:
        """A copy whose stored integers have k (an int8 zero that depends on a layer's input,
        see `after`) added."""
        raw = self.get_raw_value()
        return self.copy({n: a + k.astype(a.dtype) if n in ("q", "blocks") else a
                          for n, a in raw.items()})  # fmt: skip

    def __nnx_repr__(self):
        # Show what is stored (the integers and scales), not the dequantised weight.
        for item in super().__nnx_repr__():
            if isinstance(item, reprlib.Attr) and item.key == "value":
                item = reprlib.Attr("value", self.get_raw_value())
            yield item


class Int8Param(QuantizedParam):
    """A weight stored as {"q": int8 [...], "scale": float32 [...]}."""

    @staticmethod
    def raw_specs(spec, raw: dict) -> dict:
        """The stored arrays' PartitionSpecs, from the weight's: scales keep size-1
        contracted axes, which split over nothing."""
        unsplit = lambda a: type(spec)(
            *(ax if n > 1 else None for ax, n in zip(spec, a.shape, strict=True))
        )
        return {k: unsplit(a) for k, a in raw.items()}


class Mxfp4Param(QuantizedParam):
    """An expert weight stored as MXFP4 {"blocks", "scales"} (`moe_jax.model.fp4`)."""

    dequantize = staticmethod(fp4.dequantize)

    @staticmethod
    def raw_specs(spec, raw: dict) -> dict:
        """blocks [..., G, 16, F] split like the weight [..., D, F] (its blocks of 32 rows
        where D is), the 16 bytes of a block never; scales [..., G, F] like the weight."""
        return {"blocks": type(spec)(*spec[:-1], None, spec[-1]), "scales": spec}


@partial(jax.jit, static_argnames="axes")
def quantize_tensor(w: jax.Array, axes: tuple[int, ...]) -> dict:
    """Symmetric int8 with one scale per output channel (`axes`: the contracted axes)."""
    amax = jnp.max(jnp.abs(w), axis=axes, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)  # an all-zero channel stays exactly zero
    q = jnp.clip(jnp.round(w / scale), -QMAX, QMAX).astype(jnp.int8)
    return {"q": q, "scale": scale}


def is_quantized(model: nnx.Module) -> bool:
    return bool(jax.tree.leaves(nnx.state(model, QuantizedParam)))


def check_quantization(mode: str) -> None:
    if mode not in QUANTIZATIONS:
        raise QuantizeError(
            f"unknown quantization '{mode}'; use one of: {', '.join(QUANTIZATIONS)}"
        )


def quantize_model(model: nnx.Module, mode: str = "int8") -> nnx.Module:
    """A copy of `model` with its matmul weights int8 (see the module doc), or with mode
    "mxfp4" its routed experts' weights MXFP4 (`fp4`) and every other weight as it was; the
    float arrays of everything not quantised are shared with `model`."""
    from moe_jax.model.experts import Experts  # the model imports this module

    check_quantization(mode)
    if is_quantized(model):
        raise QuantizeError(
            "the model is already quantised; use it as it is, or quantise the float model it "
            "came from"
        )
    m = model.cfg
    if mode == "mxfp4" and (m.model.d_model % fp4.BLOCK or m.moe.expert_hidden % fp4.BLOCK):
        raise QuantizeError(
            f"mxfp4 packs the experts' inputs in blocks of {fp4.BLOCK}; model.d_model "
            f"({m.model.d_model}) and moe.expert_hidden ({m.moe.expert_hidden}) must be "
            "multiples of it"
        )
    model = nnx.clone(model)
    for _, module in nnx.iter_modules(model):
        for name, axes in CONTRACTED_AXES.items():
            w = getattr(module, name, None)
            if not isinstance(w, nnx.Param):
                continue
            if mode == "int8":
                quantized = Int8Param(quantize_tensor(w[...], axes), **w.get_metadata())
            elif isinstance(module, Experts):
                quantized = Mxfp4Param(fp4.quantize(w[...]), **w.get_metadata())
            else:
                continue
            setattr(module, name, quantized)
    return model


def after(x: jax.Array, node):
    """`node` (a module or a Variable) whose int8 weights are dequantised only once `x` exists.

    The model calls this with each layer's input (and the head's). A weight's dequantisation
    depends on nothing but the weight, so XLA is otherwise free to do it anywhere: it hoists
    it out of the sampler's decode loop (a float copy of every weight, alive for the whole
    loop: the float model's memory, and float reads each step), and XLA:CPU schedules every
    layer's at the start of a step (all float copies alive at once). So the int8 values get
    `k = int8(x[0] * 0.0)` added: always 0 (a float `0 * x` is 0 or NaN, and XLA converts NaN
    to integer 0), yet XLA cannot fold it (it never folds a float `0 * x`), so the values
    depend on `x`: each layer's weights are dequantised from int8 in that layer's turn, and
    at most about one layer's float copy exists at a time. (Tying the scales instead lets XLA
    hoist the int8 -> float conversion alone; an optimization barrier is removed by XLA:CPU
    before it hoists.) A node without int8 weights comes back as it is.
    """
    is_int8 = lambda v: isinstance(v, QuantizedParam)
    if isinstance(node, nnx.Variable):
        if not is_int8(node):
            return node
    else:
        graphdef, state = nnx.split(node)
        if not any(map(is_int8, jax.tree.leaves(state, is_leaf=is_int8))):
            return node
    k = (x.reshape(-1)[0] * 0.0).astype(jnp.int8)

    def tie(v):
        return v.tied(k) if is_int8(v) else v

    if isinstance(node, nnx.Variable):
        return tie(node)
    return nnx.merge(graphdef, jax.tree.map(tie, state, is_leaf=is_int8))


def param_bytes(model: nnx.Module) -> int:
    """Bytes of the model's parameters as stored (int8 values and scales included); works on
    abstract models (`nnx.eval_shape`) too."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves)
