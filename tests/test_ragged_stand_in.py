"""The ragged-all-to-all stand-in (`tests/ragged_stand_in.py`) against a plain-Python
reference written from the operation's documentation (jax's docstring, XLA's
RaggedAllToAll), and mutations: a wrong send size, offset or receive size changes the result."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.ragged_stand_in import ragged_all_to_all

FIELDS = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """Each argument a list over shards, as jax's docstring writes the operation: sender src
    sends its slice i to shard i // per, which writes it at output_offsets[src][i], recv_sizes
    of its own rows; other rows keep `output`. -> the shards' results, or None where the
    documentation leaves the result undefined (a receive size that is not the send size,
    negative, past an end, two slices on one row)."""
    ep, K = len(operand), len(input_offsets[0])
    per = K // ep
    result = [np.array(o, copy=True) for o in output]
    written = [np.zeros(len(o), bool) for o in output]
    for src in range(ep):
        for i in range(K):
            dst, j = divmod(i, per)
            lo, n, at = input_offsets[src][i], send_sizes[src][i], output_offsets[src][i]
            if recv_sizes[dst][src * per + j] != n or min(lo, n, at) < 0:
                return None
            if lo + n > len(operand[src]) or at + n > len(output[dst]):
                return None
            if written[dst][at : at + n].any():
                return None
            written[dst][at : at + n] = True
            result[dst][at : at + n] = operand[src][lo : lo + n]
    return result


def reference_operand_grad(args, cotangent):
    """d sum(result * cotangent) / d operand: each sent row's cotangent where it landed. The
    real collective's gradient writes it back over the sender's rows (jax's transpose: a second
    exchange), so None where a sender's slices overlap (or the forward is undefined)."""
    if reference(*args) is None:
        return None
    operand, _, input_offsets, send_sizes, output_offsets, _ = args
    ep, K = len(operand), len(input_offsets[0])
    grad = [np.zeros_like(o) for o in operand]
    read = [np.zeros(len(o), bool) for o in operand]
    for src in range(ep):
        for i in range(K):
            lo, n, at = input_offsets[src][i], send_sizes[src][i], output_offsets[src][i]
            if read[src][lo : lo + n].any():
                return None
            read[src][lo : lo + n] = True
            grad[src][lo : lo + n] = cotangent[i // (K // ep)][at : at + n]
    return grad


def random_exchange(seed, ep=4, per=2, rows=26, D=3):
    """A valid exchange: 0-2 rows a slice, each side's slices in a random order with random
    gaps (padding), distinct operand values, a random `output`."""
    rng = np.random.default_rng(seed)
    K = ep * per
    sizes = rng.integers(0, 3, (ep, K))  # [sender, slice]
    input_offsets, output_offsets = np.zeros((ep, K), int), np.zeros((ep, K), int)
    recv_sizes = np.zeros((ep, K), int)
    for src in range(ep):  # the sender's layout
        pos = 0
        for i in rng.permutation(K):
            pos += rng.integers(0, 2)
            input_offsets[src, i], pos = pos, pos + sizes[src, i]
    for dst in range(ep):  # the receiver's layout of what arrives
        pos = 0
        for k in rng.permutation(K):
            src, j = divmod(k, per)
            pos += rng.integers(0, 2)
            output_offsets[src, dst * per + j], recv_sizes[dst, k] = pos, sizes[src, dst * per + j]
            pos += recv_sizes[dst, k]
    operand = 1000.0 * np.arange(ep)[:, None, None] + np.arange(rows * D).reshape(1, rows, D)
    output = -rng.uniform(1, 2, (ep, rows, D))
    values = [operand.astype(np.float32), output.astype(np.float32)]
    return [*values, input_offsets, sizes, output_offsets, recv_sizes]


@functools.cache
def _stand_in(ep):
    mesh = jax.make_mesh((ep,), ("x",), devices=jax.devices()[:ep])
    f = jax.shard_map(
        functools.partial(ragged_all_to_all, axis_name="x"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )

    def loss(operand, output, cotangent, *offsets):
        return jnp.sum(f(operand, output, *offsets) * cotangent)

    def run(args, cotangent=None):
        """The stand-in's result [ep, rows, ...] (and its gradients given a cotangent)."""
        dtype = jnp.float32 if cotangent is not None else None
        flat = [
            jax.device_put(
                jnp.asarray(a, jnp.int32 if n >= 2 else dtype).reshape(-1, *np.shape(a)[2:]),
                NamedSharding(mesh, P("x")),
            )
            for n, a in enumerate(args)
        ]
        y = jax.jit(f)(*flat)
        if cotangent is None:
            return np.asarray(y).reshape(ep, -1, *np.shape(args[1])[2:])
        c = jnp.asarray(cotangent, jnp.float32).reshape(y.shape)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(flat[0], flat[1], c, *flat[2:])
        shape = lambda a: (ep, -1, *np.shape(a)[2:])
        return [np.asarray(g).reshape(shape(a)) for g, a in zip(grads, args[:2], strict=True)]

    return run


def test_the_docstring_example():
    """jax's own example: axis of size 2, shard 0 sends [1] to itself and [2, 2] to shard 1
    (at its offset 0), shard 1 sends [3] to shard 0 (at 1) and [4] to itself (at 2)."""
    args = [
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0, 0, 0, 0]] * 2,  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    ]
    expected = [[1, 3, 0, 0], [2, 2, 4, 0]]
    np.testing.assert_array_equal(reference(*map(np.array, args)), expected)
    np.testing.assert_array_equal(_stand_in(2)(args), expected)
    # gradients: each sent element gets its landing row's cotangent; the output's written
    # rows get none (they were overwritten), its others pass theirs through
    cot = np.arange(1.0, 9.0).reshape(2, 4)
    d_operand, d_output = _stand_in(2)(args, cot)
    np.testing.assert_array_equal(d_operand, [[1, 5, 6], [2, 7, 0]])
    np.testing.assert_array_equal(d_output, [[0, 0, 3, 4], [0, 0, 0, 8]])


@pytest.mark.parametrize("seed", range(4))
def test_random_exchanges_equal_the_reference(seed):
    """Several slices a peer, empty ones, padding on both sides, untouched output rows:
    values and the operand's gradient."""
    args = random_exchange(seed)
    expected = reference(*args)
    assert expected is not None
    np.testing.assert_array_equal(_stand_in(4)(args), expected)
    cot = np.random.default_rng(seed).normal(size=np.shape(args[1]))
    grad = reference_operand_grad(args, cot)
    np.testing.assert_allclose(_stand_in(4)(args, cot)[0], grad, rtol=1e-6)


def _mutations(args):
    """(field, shard, slice, delta) for one non-empty slice of each shard, every field."""
    sizes = args[3]
    for shard in range(len(sizes)):
        i = int(np.flatnonzero(sizes[shard])[0])
        for field in FIELDS:
            for delta in (-1, 1):
                yield field, shard, i, delta


@pytest.mark.parametrize("seed", range(2))
def test_a_wrong_size_or_offset_changes_the_result(seed):
    """Each mutation gives the reference's result where that is defined, poison (NaN
    everywhere) where it is not, and never the unmutated result."""
    args = random_exchange(seed)
    valid = _stand_in(4)(args)
    for field, shard, i, delta in _mutations(args):
        bad = [np.array(a, copy=True) for a in args]
        n = 2 + FIELDS.index(field)
        bad[n][shard, i] += delta
        want, got = reference(*bad), _stand_in(4)(bad)
        what = f"{field}[{shard}, {i}] {delta:+d}"
        if want is None:
            assert np.isnan(got).all(), what
        else:
            np.testing.assert_array_equal(got, want, err_msg=what)
        assert not np.array_equal(got, valid), what


def test_overlapping_input_slices_have_no_gradient():
    """Reading a row twice is defined; its gradient by the real collective is not (the
    transpose writes both slices' cotangents over the same rows): poisoned."""
    args = random_exchange(0)
    i, j = np.flatnonzero(args[3][0])[:2]
    args[2][0, j] = args[2][0, i]  # shard 0's slice j reads from where its slice i does
    assert reference(*args) is not None
    cot = np.ones(np.shape(args[1]))
    assert reference_operand_grad(args, cot) is None
    assert np.isnan(_stand_in(4)(args, cot)[0]).all()
