"""Decoding's expert products, read in place: each assignment's row times its own expert's
weight, straight out of the [E, K, N] stack (a Pallas Triton kernel on NVIDIA GPUs).

With few tokens in flight (B * T * top_k < n_experts) a step needs only the picked experts'
weights. XLA can only get there by gathering them first: a copy of every picked matrix
(written, then read again by the product), 35 of a layer's ~170 us on an H200 at batch 1
(2026-11-26, `benchmarks/gpu`). This kernel reads each picked [K, N] block once: a program
per (assignment, band of `block_n` output columns) loads its expert's id, walks the
contracted dim in `block_k` steps and accumulates the products in float32.

    y_JN = picked_matmul(x_JK, w_EKN, e_J)    # y[j] = x[j] @ w[e[j]]

Elsewhere (CPU, TPU; dims the blocks do not divide) `experts.picked_swiglu` keeps the gather
(`rows_matmul`); `backends.choose("picked", ...)` decides. The CPU tests run the kernel in
Pallas' interpreter against that path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# (block_k, block_n, num_warps, num_stages): a [block_k, block_n] tile of the weight a
# loop step, bands of block_n output columns a program. Timed on an H200 (2026-11-28, the GPU
# kit's `picked` records: one token's 8 rows against a [32, 2048, 768] stack, 40 calls in one
# program over 4 stacks): (128, 32, 4, 3) 23.4 us, (64, 32, 4, 4) 43-46, (64, 64) and
# (32, 64) ~71; XLA's gather + two-row GEMM 19.8-21.6 us. So the kernel reads less but is
# not yet faster, and `auto` keeps the gather (backends.AUTO).
BLOCKS = (128, 32, 4, 3)


def fits(D: int, F: int, blocks: tuple = BLOCKS) -> bool:
    """Whether the blocks divide an expert's [D, F] and [F, D] weights' dims."""
    return all(n % b == 0 for n in (D, F) for b in blocks[:2])


def available() -> bool:
    """jax's Pallas Triton lowering is importable (it needs no GPU to import)."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def picked_matmul(
    x_JK: jax.Array, w_EKN: jax.Array, e_J: jax.Array, *, blocks: tuple = BLOCKS,
    interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """y[j] = x[j] @ w[e[j]] in float32, returned in x's dtype; w is read where it lies."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    J, K = x_JK.shape
    E, K_, N = w_EKN.shape
    assert K == K_, (x_JK.shape, w_EKN.shape)
    block_k, block_n, warps, stages = blocks
    assert K % block_k == 0 and N % block_n == 0, f"blocks {blocks[:2]} do not divide [{K}, {N}]"

    def kernel(e_ref, x_ref, w_ref, y_ref):
        j, band = pl.program_id(0), pl.program_id(1)
        e = e_ref[j]
        cols = pl.ds(pl.multiple_of(band * block_n, block_n), block_n)

        def step(i, acc_kn):
            rows = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            x_k = x_ref[j, rows].astype(jnp.float32)
            w_kn = w_ref[e, rows, cols].astype(jnp.float32)
            return acc_kn + x_k[:, None] * w_kn

        acc_kn = jax.lax.fori_loop(
            0, K // block_k, step, jnp.zeros((block_k, block_n), jnp.float32)
        )
        y_ref[j, cols] = jnp.sum(acc_kn, axis=0).astype(y_ref.dtype)

    # Inside `shard_map` (the expert-parallel layer, a one-device mesh too) the kernel's
    # output must say which mesh axes it varies over: those of its operands, all cast alike.
    e_J, x_JK, w_EKN = _varying_alike(e_J.astype(jnp.int32), x_JK, w_EKN)
    out = jax.ShapeDtypeStruct((J, N), x_JK.dtype, manual_axis_type=jax.typeof(x_JK).mat)
    whole = lambda shape: pl.BlockSpec(shape, lambda j, n: (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        out_shape=out,
        grid=(J, N // block_n),
        in_specs=[whole((J,)), whole((J, K)), whole((E, K, N))],
        out_specs=whole((J, N)),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="picked_matmul",
    )(e_J, x_JK, w_EKN)


def _varying_alike(*arrays) -> list[jax.Array]:
    """`arrays`, each cast to vary over every mesh axis any of them varies over."""
    axes = set().union(*(jax.typeof(a).mat.varying for a in arrays))
    cast = lambda a, more: jax.lax.pcast(a, tuple(sorted(more)), to="varying") if more else a
    return [cast(a, axes - jax.typeof(a).mat.varying) for a in arrays]
