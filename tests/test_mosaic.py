"""`mosaic`'s own code on the CPU: the VJP that joins jax's two Mosaic GPU kernels, the
masking of what they leave unwritten, the types inside `shard_map`, and the tile fitting.

Mosaic GPU kernels run on Hopper GPUs only (tests/test_gpu.py runs the real ones there), so
here each kernel is replaced by a float32 stand-in written from its contract in jax's
source (`ragged_dot_mgpu.ragged_dot`: each group's rows times its weight, `transpose_rhs`
contracting with the weight's last dim; `transposed_ragged_dot`: each group's x_e^T dy_e), and
the stand-ins leave exactly what the kernels leave unwritten as NaN: rows past the groups,
and an empty group's weight gradient. Autodiff of XLA's ragged_dot is the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.kernels import mosaic_gmm as mosaic


def _group_of_rows(n, sizes):
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(n), side="right")


def fake_ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs=False, **tile):
    assert set(tile) == {"block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"}
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    assert lhs.shape[1] % tile["block_k"] == 0 and rhs.shape[2] % tile["block_n"] == 0
    y = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    past = _group_of_rows(lhs.shape[0], group_sizes) >= group_sizes.shape[0]
    return jnp.where(past[:, None], jnp.nan, y).astype(lhs.dtype)  # unwritten by the kernel


def fake_transposed_ragged_dot(lhs, rhs, *, group_sizes, **tile):
    assert lhs.shape[1] % tile["block_m"] == 0 and rhs.shape[1] % tile["block_n"] == 0
    group = _group_of_rows(lhs.shape[0], group_sizes)
    one_hot = (group[:, None] == jnp.arange(group_sizes.shape[0])[None, :]).astype(lhs.dtype)
    out = jnp.einsum("ne,nk,nm->ekm", one_hot, lhs, rhs)
    return jnp.where(group_sizes[:, None, None] > 0, out, jnp.nan).astype(lhs.dtype)


@pytest.fixture
def fake_kernels(monkeypatch):
    monkeypatch.setattr(mosaic, "_kernels", lambda: (fake_ragged_dot, fake_transposed_ragged_dot))


SIZES = jnp.array([5, 0, 9, 3], jnp.int32)  # 17 rows in groups, 3 past them (dropped)
N_ROWS, K, N = 20, 128, 64


def _operands(dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (N_ROWS, K), dtype)
    w = jax.random.normal(ks[1], (4, K, N), dtype)
    dy = jax.random.normal(ks[2], (N_ROWS, N), dtype)
    return x, w, dy


def _reference(x, w):
    y = jax.lax.ragged_dot(x, w, SIZES)
    past = _group_of_rows(N_ROWS, SIZES) >= 4
    return jnp.where(past[:, None], 0, y)


def test_values_and_gradients_equal_ragged_dot_with_nothing_unwritten_read(fake_kernels):
    x, w, dy = _operands()
    y, vjp = jax.vjp(lambda x, w: mosaic.grouped_matmul(x, w, SIZES), x, w)
    dx, dw = vjp(dy)
    want, want_vjp = jax.vjp(_reference, x, w)
    want_dx, want_dw = want_vjp(dy)
    # float32 stand-ins: the same products in another order
    for got, ref in ((y, want), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert not np.any(y[17:]) and not np.any(dx[17:]), "rows past the groups are zeros"
    assert not np.any(dw[1]), "the empty group's weight gradient is zero"


def test_inside_a_shard_map_the_gradients_carry_their_inputs_types(fake_kernels):
    """Rows split over a mesh axis, the weight the same on every shard: the rows' gradient
    varies like them, the weight's is summed over the shards (a custom VJP must return each
    cotangent typed like its input)."""
    x, w, dy = _operands()
    x2, dy2 = jnp.concatenate([x, x[::-1]]), jnp.concatenate([dy, dy])
    mesh = jax.make_mesh((2,), ("data",))

    def shard(x, w, dy):
        sizes = SIZES  # each shard's rows hold the same groups
        _, vjp = jax.vjp(lambda x, w: mosaic.grouped_matmul(x, w, sizes), x, w)
        return vjp(dy)

    f = jax.shard_map(
        shard, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P("data"), P())
    )
    with jax.set_mesh(mesh):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
        dx, dw = (np.asarray(a) for a in jax.jit(f)(put(x2), w, put(dy2)))
    _, vjp_a = jax.vjp(_reference, x, w)
    _, vjp_b = jax.vjp(_reference, x[::-1], w)
    want_dw = vjp_a(dy)[1] + vjp_b(dy)[1]
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx[:N_ROWS], vjp_a(dy)[0], rtol=1e-5, atol=1e-5)


def test_tiles_fit_the_dims_or_the_operands_are_refused():
    assert mosaic.fitted((128, 128, 64, 4, 1), 2048, 768) == (128, 128, 64, 4, 1)
    # 2880 (gpt-oss's hidden) is a multiple of 64, not of 128
    assert mosaic.fitted((128, 128, 64, 4, 1), 2880, 2048) == (64, 64, 64, 4, 1)
    assert mosaic.fitted((128, 128, 64, 4, 1), 40, 128) is None
    bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
    assert mosaic.takes(bf(8, 256), bf(4, 256, 128))
    assert not mosaic.takes(bf(8, 40), bf(4, 40, 128))  # tiny configs: XLA's ragged_dot
    assert not mosaic.takes(jnp.zeros((8, 256)), jnp.zeros((4, 256, 128)))  # float32
    assert not mosaic.takes(bf(8, 256), jnp.zeros((4, 256, 128)))  # mixed dtypes


def test_the_grouped_matmul_sends_only_operands_the_kernels_take(fake_kernels, monkeypatch):
    """grouped.grouped_matmul with impl mosaic: the kernels where they take the operands,
    XLA's ragged_dot (with its hand-written weight gradient) otherwise."""
    from moe_jax.model import grouped

    calls = []
    monkeypatch.setattr(mosaic, "grouped_matmul", lambda *a: calls.append(a) or _reference(*a[:2]))
    x, w, _ = _operands(jnp.bfloat16)
    grouped.grouped_matmul(x, w, SIZES, "mosaic")
    assert len(calls) == 1
    grouped.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), SIZES, "mosaic")
    assert len(calls) == 1  # float32: not the kernels'


def test_the_mosaic_impl_is_refused_off_a_gpu_in_one_line():
    from moe_jax import backends

    with pytest.raises(backends.KernelError, match="runs on gpu only"):
        backends.choose("moe", "mosaic")
    with backends.targeting("gpu"):
        assert backends.choose("moe", "mosaic") == "mosaic"
        assert backends.exchange("mosaic") == "ragged"
