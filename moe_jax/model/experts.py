"""The experts: the dense SwiGLU MLP, `Experts` (n_experts of them, stacked), and the ways
their SwiGLU runs on routed tokens: on capacity buffers (`expert_swiglu`: the CPU's filled rows,
the GPU's batched matmul, the grouped matmul), or on a few tokens' picked experts' gathered
weights (`picked_swiglu`, decoding). The down projection's bias is added in one place
(`down_bias`), once even where tensor-parallel partial sums are still to be summed.

The gated activation (`glu.Activation`: SwiGLU, or gpt-oss's clamped form) is a static
argument of every one of these paths; its hand-written backward lives in `glu` beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.kernels import picked_matmul
from moe_jax.model import in_turn, lora, weight_gather
from moe_jax.model.glu import SWIGLU, Activation, glu
from moe_jax.model.grouped import grouped_buffers
from moe_jax.model.routing import scale_inputs, sum_choices
from moe_jax.model.row_buckets import swiglu_filled
from moe_jax.named_scopes import EXPERTS, scoped
from moe_jax.sharding import param, seq_axis

EXPERT_PARAMS = ("w_gate", "w_up", "w_down", "gate_bias", "up_bias", "down_bias")
MAP_MIN_CAPACITY = 128  # expert buffers of at least this many slots run one expert at a time
# ... and are unrolled in the trace (else a lax.map) up to this many (local) experts, if each
# expert's matmuls are at least this big (rows x d_model x hidden multiply-adds).
UNROLL_MAX_EXPERTS = 32
UNROLL_MIN_MACS = 1 << 27
GROUPED_IMPLS = ("ragged", "megablox", "mosaic")  # moe.impl values that run a grouped matmul


class SwiGLU(nnx.Module):
    """Dense SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, d_model: int, hidden: int, cfg: Config, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        self.w_gate = param(rngs, init, (d_model, hidden), ("embed", "mlp"))
        self.w_up = param(rngs, init, (d_model, hidden), ("embed", "mlp"))
        self.w_down = param(rngs, init, (hidden, d_model), ("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        # As rows [B*T, D]: on [B, T, D] XLA:CPU fused the SwiGLU backward's elementwise ops
        # into slow transposing copies for the weight gradients (contracted over both B and T),
        # and the layer's forward + backward took twice as long. Not under a context axis:
        # rows over the batch axes and a sequence split over `context` do not merge into
        # one split dim, and the partitioner gathered the whole sequence to merge them.
        split_seq = x_BTD.ndim == 3 and seq_axis(None, x_BTD.shape[1]) is not None
        rows = "bt" if split_seq else "n"
        x_ND = x_BTD if split_seq else x_BTD.reshape(-1, x_BTD.shape[-1])
        # (each matmul's weight gathered by mesh.weight_gather, see weight_gather.einsum)
        gate_NF = self._matmul("w_gate", x_ND, f"{rows}d,df->{rows}f")
        up_NF = self._matmul("w_up", x_ND, f"{rows}d,df->{rows}f")
        y_ND = self._matmul("w_down", jax.nn.silu(gate_NF) * up_NF, f"{rows}f,fd->{rows}d")
        return y_ND.reshape(*x_BTD.shape[:-1], -1)

    def _matmul(self, name: str, x, subscripts: str) -> jax.Array:
        """x times weight `name`, plus its LoRA adapter's term where it has one."""
        y = weight_gather.einsum(subscripts, x, getattr(self, name), self.dtype)
        return y + lora.delta(self, name, x, subscripts, self.dtype)


class Experts(nnx.Module):
    """n_experts SwiGLU MLPs, applied to their capacity buffers by `expert_swiglu`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        E, D, F = cfg.moe.n_experts, cfg.model.d_model, cfg.moe.expert_hidden
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        # fsdp splits each weight's minor dim (see sharding.LOGICAL_RULES)
        self.w_gate = param(rngs, init, (E, D, F), ("expert", None, "expert_mlp_fsdp"))
        self.w_up = param(rngs, init, (E, D, F), ("expert", None, "expert_mlp_fsdp"))
        self.w_down = param(rngs, init, (E, F, D), ("expert", "expert_mlp", "expert_embed"))
        if cfg.moe.expert_bias:
            zeros = nnx.initializers.zeros
            self.gate_bias = param(rngs, zeros, (E, F), ("expert", "expert_mlp"))
            self.up_bias = param(rngs, zeros, (E, F), ("expert", "expert_mlp"))
            self.down_bias = param(rngs, zeros, (E, D), ("expert", "expert_embed"))

    def weights(self) -> dict[str, jax.Array]:
        """The expert weights by name, each with its LoRA adapter merged in where it has one
        (`lora.merged`: one code path for every expert implementation)."""
        w = {n: getattr(self, n)[...] for n in EXPERT_PARAMS if hasattr(self, n)}
        return lora.merged(self, w)

    def has_adapters(self) -> bool:
        return any(lora.has_adapter(self, n) for n in EXPERT_PARAMS)


def swiglu_rows(x_CD, w: dict, dtype, act: Activation = SWIGLU) -> jax.Array:
    """SwiGLU of rows [..., C, D] with weights [..., D, F] (a leading expert axis on both, or
    none), without the down-projection bias (added after any tensor-parallel sum). 16-bit
    expert stacks for a wider `dtype` (bf16 weights on CPU) run a group of experts at a time,
    so that only that group's weights are ever converted (`in_turn.by_expert_groups`)."""
    if x_CD.ndim == 3:
        one = lambda x_ECD, w_E: _swiglu_rows(x_ECD, w_E, dtype, act)
        return in_turn.by_expert_groups(one, x_CD, w, dtype)
    return _swiglu_rows(x_CD, w, dtype, act)


def _swiglu_rows(x_CD, w: dict, dtype, act: Activation) -> jax.Array:
    bias = lambda n: jnp.expand_dims(w[n].astype(dtype), -2) if n in w else 0
    gate_CF = jnp.matmul(x_CD, w["w_gate"].astype(dtype)) + bias("gate_bias")
    up_CF = jnp.matmul(x_CD, w["w_up"].astype(dtype)) + bias("up_bias")
    return jnp.matmul(glu(gate_CF, up_CF, act), w["w_down"].astype(dtype))


def down_bias(bias_nD: jax.Array, dtype, reduce_axis: str | None = None, summed=True):
    """The down projection's bias rows, to add once: where the partial sums over
    `reduce_axis` (tensor parallelism) are still to be summed (`summed` False), from the
    axis' first shard only."""
    bias_nD = bias_nD.astype(dtype)
    if reduce_axis is not None and not summed:
        bias_nD = bias_nD * (jax.lax.axis_index(reduce_axis) == 0).astype(dtype)
    return bias_nD


@scoped(EXPERTS)
def expert_swiglu(
    x_ESCD,
    w: dict,
    dtype,
    *,
    filled_ES=None,
    reduce_axis: str | None = None,
    sum_partials=True,
    impl: str = "buckets",
    row_chunks: int = 1,
    act: Activation = SWIGLU,
):
    """Each expert's SwiGLU on its buffer: E experts x S segments (routing groups) x C slots.
    A segment is filled from the front, `filled_ES` rows (None: any may be full); outputs of
    empty slots are never read. With `reduce_axis`, `w` holds a shard of the hidden dim
    (tensor parallelism) and the partial down-projections are summed over that axis, or, with
    `sum_partials=False`, returned unsummed for the caller to sum later on fewer rows (the
    down-projection bias then comes from the axis' first shard only).

    Big buffers (training) run one expert at a time on the filled rows of each segment only
    (`buckets`): an expert's [C, F] intermediates then stay in the CPU cache instead of
    [E, C, F] arrays going through memory (the medium training step used ~15% less CPU), and
    the capacity padding costs nothing. Big enough experts, up to UNROLL_MAX_EXPERTS of
    them, are unrolled in the trace; others run in a `lax.map`, whose compile time does not
    grow with E. Small buffers (decoding) run as batched matmuls over every slot, which
    stream the weights in one pass (the per-expert map made batch-8 decoding ~25% slower).
    `impl` (moe.impl, resolved): "ragged" / "megablox" run big buffers' filled rows as one
    grouped matmul (`grouped.grouped_buffers`, in `row_chunks` windows); "batched" every slot
    of any buffer as one batched matmul, padding included (the GPU's, see `backends.py`)."""
    E, S, C, D = x_ESCD.shape
    w_in = {n: a for n, a in w.items() if n != "down_bias"}
    grouped = S * C >= MAP_MIN_CAPACITY and impl in GROUPED_IMPLS
    if not grouped:  # the grouped matmul names its own rows (`grouped_swiglu`)
        x_ESCD = checkpoint_name(x_ESCD, "expert_in")
    if impl == "batched":  # every slot, one batched matmul: no conditionals
        y_ESCD = swiglu_rows(x_ESCD.reshape(E, S * C, D), w_in, dtype, act).reshape(E, S, C, D)
    elif grouped:
        if reduce_axis is not None:  # a hand-written backward again: see below
            x_ESCD = jax.lax.pcast(x_ESCD, reduce_axis, to="varying")
        if filled_ES is None:
            filled_ES = jnp.full((E, S), C, jnp.int32)
        y_ESCD = grouped_buffers(x_ESCD, w_in, dtype, filled_ES, impl, row_chunks, act)
    elif S * C >= MAP_MIN_CAPACITY:
        if reduce_axis is not None:
            # Each tensor shard's input cotangent is a partial sum. `buckets`' hand-written
            # backward must return it typed like its input, so the input is made varying here
            # and the sum of the partials (this cast's transpose) is one all-reduce for all
            # experts, after the per-expert loop.
            x_ESCD = jax.lax.pcast(x_ESCD, reduce_axis, to="varying")
        if filled_ES is None:
            filled_ES = jnp.full((E, S), C, jnp.int32)

        # Rows [S * C, D] per expert: with S = 1, XLA:CPU gave a [E, 1, C, D] operand a
        # layout with the size-1 axis first and copied it into the map's default layout.
        def one_expert(a):
            y_SCD = swiglu_filled(a[0].reshape(S, C, D), a[1], a[2], dtype, act)
            return y_SCD.reshape(S * C, D)

        per_expert = (x_ESCD.reshape(E, S * C, D), w_in, filled_ES)
        F = w["w_gate"].shape[-1]
        if E <= UNROLL_MAX_EXPERTS and S * C * D * F >= UNROLL_MIN_MACS:
            # Inside the layer scan, each unrolled expert's weights are one slice of the
            # stacked [L, E, D, F] parameters and its gradients go into their stack once. The
            # map copied the layer's [E, D, F] weights out first, per expert again, and stacked
            # the gradients and saved products twice. Medium benchmark, in turns: 13% faster
            # (Mixtral-like), 5% (Llama-4-like), 6% with 32 experts. Smaller experts ran
            # slower unrolled (small benchmark: 5-15% with 8 experts, 60% with 32; why is not
            # known), and compile time grows with E (+12 s at medium with 32 experts).
            y_ESCD = jnp.stack([one_expert(a) for a in unstack(per_expert, E)])
        else:
            y_ESCD = jax.lax.map(one_expert, per_expert)
        y_ESCD = y_ESCD.reshape(E, S, C, D)
    else:
        y_ESCD = swiglu_rows(x_ESCD.reshape(E, S * C, D), w_in, dtype, act).reshape(E, S, C, D)
    if reduce_axis is not None and sum_partials:
        y_ESCD = jax.lax.psum(y_ESCD, reduce_axis)
    if "down_bias" in w:
        bias_ED = down_bias(w["down_bias"], dtype, reduce_axis, summed=sum_partials)
        y_ESCD = y_ESCD + bias_ED[:, None, None, :]
    return y_ESCD


@scoped(EXPERTS)
def picked_swiglu(
    x_BTD,
    experts_BTK,
    w_BTK,
    keep_BTK,
    weights,
    dtype,
    *,
    route_scale: str,
    reduce_axis=None,
    act: Activation = SWIGLU,
    impl: str = "auto",
) -> jax.Array:
    """Few tokens (decoding): every assignment through its own expert's weights, reading only
    the picked experts. `weights`: the `Experts` module (whose int8 weights gather and
    dequantize only the picked rows) or a dict of expert weight arrays; `reduce_axis`: they
    hold a shard of the hidden dim (tensor parallelism), and the partial down projections
    are summed over it; `impl` (moe.decode_impl): `gather` copies the picked weights out and
    multiplies (`rows_matmul`), `triton` reads them in place (`picked_matmul.picked_matmul`; 16-bit
    or float weights at dims its blocks divide, else the gather).
    -> y_BTD, summed over the choices."""
    source = weights.get if isinstance(weights, dict) else lambda n: getattr(weights, n, None)
    D, F = x_BTD.shape[-1], source("w_gate").shape[-1]
    # int8 / MXFP4 weights are stored as dicts of arrays (`int8.QuantizedParam`, which
    # imports this module): the gather dequantises their picked rows
    stored = lambda v: v.get_raw_value() if isinstance(v, nnx.Variable) else v
    in_place = not any(isinstance(stored(source(n)), dict) for n in EXPERT_PARAMS)
    in_place &= backends.choose("decode", impl, shape={"dims": (D, F)}) == "triton"
    in_place &= picked_matmul.fits(D, F)  # else the gather, whatever was named

    def pick(n):  # [B, T, K, ...] of each assignment's expert, or 0 without that weight
        a = source(n)
        return 0 if a is None else a[experts_BTK].astype(dtype)

    def product(x_BTKD, n):  # each assignment's row times its expert's weight n
        if not in_place:
            return rows_matmul(x_BTKD, pick(n))
        w_EKN = source(n)
        w_EKN = w_EKN if isinstance(w_EKN, jax.Array) else w_EKN[...]
        y_JN = picked_matmul.picked_matmul(
            x_BTKD.reshape(-1, x_BTKD.shape[-1]).astype(dtype), w_EKN,
            experts_BTK.reshape(-1), interpret=backends.interpret(),
        )  # fmt: skip
        return y_JN.reshape(*experts_BTK.shape, w_EKN.shape[-1])

    x_BTKD = jnp.broadcast_to(x_BTD[:, :, None, :], (*experts_BTK.shape, D))
    x_BTKD = scale_inputs(x_BTKD, w_BTK, route_scale)
    gate = product(x_BTKD, "w_gate") + pick("gate_bias")
    up = product(x_BTKD, "w_up") + pick("up_bias")
    y_BTKD = product(glu(gate, up, act), "w_down")
    if reduce_axis is not None:
        y_BTKD = jax.lax.psum(y_BTKD, reduce_axis)
    if source("down_bias") is not None:
        y_BTKD = y_BTKD + down_bias(pick("down_bias"), dtype)
    return sum_choices(y_BTKD, w_BTK, keep_BTK, route_scale)


def rows_matmul(x_JD: jax.Array, w_JDF: jax.Array) -> jax.Array:
    """Each row times its own matrix: [..., D] x [..., D, F] -> [..., F], as a batched matmul
    of two-row operands (the second row zero). XLA:GPU turns a batched vector-matrix product
    into a reduction that read the gathered expert weights at ~0.4 TB/s (H200, 2026-11-26:
    116 us for one layer's gate and up at batch 1, a third of the decode step); with two rows
    it is a GEMM fusion. The extra row's FLOPs are nothing beside the weights' bytes."""
    lead, D = x_JD.shape[:-1], x_JD.shape[-1]
    x_J2D = jnp.stack([x_JD, jnp.zeros_like(x_JD)], axis=-2).reshape(-1, 2, D)
    w_JDF = w_JDF.reshape(-1, *w_JDF.shape[-2:])
    y_J2F = jnp.einsum("jmd,jdf->jmf", x_J2D, w_JDF)
    return y_J2F[:, 0].reshape(*lead, w_JDF.shape[-1])


def unstack(tree, n: int) -> list:
    """A tree of [n, ...] arrays -> n trees of [...] arrays, by `lax.split`: its transpose
    concatenates the n cotangents once. Taken as n slices `a[i]` instead, each slice's
    cotangent is a zero-padded full-size array and the n of them are summed (unrolled experts
    were 2.5x slower than the map at 32 experts that way)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [jax.lax.split(a, [1] * n) for a in leaves]
    return [treedef.unflatten([p[i].reshape(p[i].shape[1:]) for p in parts]) for i in range(n)]


def filled_slots(slot_bTK: jax.Array, n_experts: int, cap: int) -> jax.Array:
    """[E] slots each expert's buffer has filled (dropped assignments point past the end)."""
    return jnp.bincount(slot_bTK.reshape(-1) // cap, length=n_experts)
