"""The grouped matmul on Hopper GPUs: jax's Pallas Mosaic GPU kernels, with a VJP of ours.

jax ships the two kernels a grouped SwiGLU needs (`jax.experimental.pallas.ops.gpu`):
`ragged_dot_mgpu.ragged_dot`, rows in groups times their group's [K, N] weight (or, with
`transpose_rhs`, its transpose), and `transposed_ragged_dot_mgpu.transposed_ragged_dot`,
each group's x_e^T dy_e: the weight gradient. Both run wgmma with float32 accumulators.
Differentiating the first is not possible (its `mpmd_map` has no rule), so this module joins
them by hand:

    y_nN  = gmm(x_nK, w_EKN)             ragged_dot(x, w)
    dx_nK = gmm(dy_nN, w_EKN^T)          ragged_dot(dy, w, transpose_rhs=True): no copy of w^T
    dw_EKN[e] = x_e^T dy_e               transposed_ragged_dot(x, dy)

Semantics are `grouped.grouped_matmul`'s: rows past the groups (dropped assignments,
padding) give zeros, in the output and in the input's gradient. The kernels leave those rows
unwritten, so they are masked here; an empty group's weight gradient is zeroed as well
rather than trusted to the kernel's accumulator.

The kernels take 16-bit operands of one dtype, contracted and output dims that their tiles
divide (`takes`); `grouped.grouped_matmul` runs XLA's ragged_dot for anything else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Tiles: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n), timed by the GPU
# kit's sweep on an H200 (benchmarks/gpu `kernel_tiles`: 65k rows, E 32, D 2048, F 768,
# 2026-11-27). The forward's three products: 1.457 ms with the output tiles walked in bands
# of 8 (grid_block_n; 425 TFLOP/s), 1.821 ms in bands of 1, 1.604 with block_n 192. The
# input gradient's and the weight gradient's tiles are the ones the train step ran with; the
# sweep had not reached them when the stage's time ran out.
FWD_TILE = (128, 128, 64, 4, 8)
DX_TILE = (128, 128, 64, 4, 1)
WGRAD_TILE = (128, 128, 64, 4, 1)
DTYPES = (jnp.bfloat16, jnp.float16)


def _tile(tile: tuple) -> dict:
    names = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
    return dict(zip(names, tile, strict=True))


def fitted(tile: tuple, K: int, N: int) -> tuple | None:
    """`tile` with its blocks halved (down to 64) until they divide the contracted dim K and
    the output dim N of both products (the forward's and the gradients'), or None."""
    bm, bn, bk, steps, grid_n = tile
    fits = lambda c, dims: c >= 64 and all(d % c == 0 for d in dims)
    block = lambda b, *dims: next((c for c in (b, b // 2, 64) if fits(c, dims)), 0)
    bk, bn = block(bk, K, N), block(bn, K, N)
    bm = block(bm, K) if bm >= 64 else bm
    return (bm, bn, bk, steps, grid_n) if bk and bn and bm else None


def dims_fit(K: int, N: int) -> bool:
    """Whether every product's tiles divide a [K, N] expert weight's dims."""
    return all(fitted(t, K, N) is not None for t in (FWD_TILE, DX_TILE, WGRAD_TILE))


def takes(x_nK, w_EKN) -> bool:
    """Whether the kernels run these operands: 16-bit, one dtype, dims their tiles divide."""
    dtypes_ok = x_nK.dtype == w_EKN.dtype and any(x_nK.dtype == d for d in DTYPES)
    return dtypes_ok and dims_fit(*w_EKN.shape[-2:])


def _kernels():
    """(ragged_dot, transposed_ragged_dot): imported when first traced, on a GPU host."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _in_groups(n: int, sizes_E) -> jax.Array:
    return jnp.arange(n) < jnp.sum(sizes_E)


def _rows(y_nN, sizes_E):
    """y with the rows past the groups (unwritten by the kernel) zeroed."""
    return jnp.where(_in_groups(y_nN.shape[0], sizes_E)[:, None], y_nN, 0)


def _typed(out, *operands):
    """The kernel's output typed as varying over the mesh axes its operands vary over: a
    Pallas kernel's result carries no such axes, which a custom VJP inside `shard_map` (the
    expert-parallel layer, a one-device mesh too) must return for its inputs' cotangents."""
    axes = set().union(*(jax.typeof(a).mat.varying for a in operands)) - jax.typeof(out).mat.varying
    return jax.lax.pcast(out, tuple(sorted(axes)), to="varying") if axes else out


def _forward(x_nK, w_EKN, sizes_E, transpose: bool):
    ragged_dot, _ = _kernels()
    K = w_EKN.shape[-1] if transpose else w_EKN.shape[-2]
    N = w_EKN.shape[-2] if transpose else w_EKN.shape[-1]
    tile = _tile(fitted(DX_TILE if transpose else FWD_TILE, K, N))
    y = ragged_dot(x_nK, w_EKN, group_sizes=sizes_E, transpose_rhs=transpose, **tile)
    return _rows(_typed(y, x_nK, w_EKN, sizes_E), sizes_E)


def _weight_grad(x_nK, dy_nN, sizes_E):
    _, transposed_ragged_dot = _kernels()
    tile = _tile(fitted(WGRAD_TILE, x_nK.shape[1], dy_nN.shape[1]))
    # rows past the groups hold the forward's dropped rows: finite, and outside every group
    dw_EKN = transposed_ragged_dot(x_nK, dy_nN, group_sizes=sizes_E, **tile)
    dw_EKN = _typed(dw_EKN, x_nK, dy_nN, sizes_E)
    return jnp.where(sizes_E[:, None, None] > 0, dw_EKN, 0)


@jax.custom_vjp
def grouped_matmul(x_nK, w_EKN, sizes_E) -> jax.Array:
    """Rows in groups of sizes_E (in expert order) times their expert's [K, N] weight; rows
    past the groups give zeros. Operands as `takes` says; the output in their dtype."""
    return _forward(x_nK, w_EKN, sizes_E, transpose=False)


def _fwd(x_nK, w_EKN, sizes_E):
    return _forward(x_nK, w_EKN, sizes_E, transpose=False), (x_nK, w_EKN, sizes_E)


def _bwd(residuals, dy_nN):
    x_nK, w_EKN, sizes_E = residuals
    dy_nN = dy_nN.astype(x_nK.dtype)
    dx_nK = _forward(dy_nN, w_EKN, sizes_E, transpose=True)
    dw_EKN = _weight_grad(x_nK, dy_nN, sizes_E).astype(w_EKN.dtype)
    return _like(dx_nK, x_nK), _like(dw_EKN, w_EKN), None


def _like(ct, primal):
    """A cotangent summed over the mesh axes it varies over and its primal does not (a
    weight the same on every shard, used with rows that differ), as autodiff's transpose of
    the implicit cast would."""
    extra = jax.typeof(ct).mat.varying - jax.typeof(primal).mat.varying
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


grouped_matmul.defvjp(_fwd, _bwd)


@functools.cache
def available() -> bool:
    """Whether the kernels can be built here: this jax ships them (0.10.2 does) and JAX runs
    on a GPU (they read the device's multiprocessor count when traced, so a CPU host
    compiling for GPUs, `moe_jax.aot.command`, cannot build them)."""
    try:
        _kernels()
    except ImportError:
        return False
    return jax.default_backend() == "gpu"
