"""Decoding's picked-experts kernel (moe.decode_impl=triton, `kernels/picked_matmul.py`) against
float64 and against the gather path, run here in Pallas' interpreter (the GPU kit times
it on the device); and the two-row projections the GPU programs use at batch 1.

Tolerances: float32 operands summed in another order than numpy's float64: 1e-6 relative.
The kernel and the gather path compute the same float32 products in another order: the
model's logits agree to 1e-5, and greedy tokens are equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import backends
from moe_jax.config import ConfigError
from moe_jax.kernels import picked_matmul as picked
from moe_jax.model import Transformer, weight_gather
from tests.helpers import forward, tiny_config

# dims the kernel's blocks divide; 8 experts of top-2, so up to 3 tokens take the picked path
PICKED = ("model.d_model=128", "moe.expert_hidden=128", "moe.n_experts=8", "moe.top_k=2",
          "model.n_layers=2", "model.init_std=0.05")  # fmt: skip


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("blocks", [picked.BLOCKS, (32, 64, 4, 4)])
def test_picked_matmul_equals_float64(blocks):
    ks = jax.random.split(jax.random.key(0), 2)
    J, E, K, N = 6, 5, 128, 192
    x = jax.random.normal(ks[0], (J, K), jnp.float32)
    w = jax.random.normal(ks[1], (E, K, N), jnp.float32)
    e = jnp.array([3, 0, 4, 3, 1, 0])  # repeats, and expert 2 unpicked
    got = jax.jit(lambda x, w, e: picked.picked_matmul(x, w, e, blocks=blocks, interpret=True))(
        x, w, e
    )
    want = np.einsum("jk,jkn->jn", np.asarray(x, np.float64), np.asarray(w, np.float64)[e])
    assert got.shape == (J, N) and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-6
    # each row its own expert's: a wrong expert id or column band is off by O(1)
    wrong = np.einsum("jk,jkn->jn", np.asarray(x, np.float64), np.asarray(w, np.float64)[e[::-1]])
    assert rel_err(got, wrong) > 0.5


def _models(*overrides):
    """The same initialisation with the gather and with the kernel."""
    make = lambda impl: Transformer(
        tiny_config(*PICKED, f"moe.decode_impl={impl}", *overrides), rngs=nnx.Rngs(0)
    )
    return make("gather"), make("triton")


@pytest.mark.parametrize("rows, dims", [(1, ()), (3, ()), (1, ("moe.expert_hidden=40",))],
                         ids=["1 row", "3 rows", "odd dims"])  # fmt: skip
def test_decode_step_with_the_kernel_equals_the_gather(rows, dims):
    """The whole model on `rows` one-token rows (batch x top_k < n_experts: the picked path),
    the kernel in the interpreter against XLA's gather; at dims its blocks do not divide,
    the gather runs under either name."""
    gather, kernel = _models(*dims)
    tokens = jax.random.randint(jax.random.key(1), (rows, 1), 0, 256)
    want, _ = forward(gather, tokens)
    got, _ = forward(kernel, tokens)
    assert rel_err(got, want) < 1e-5


def test_greedy_decoding_with_the_kernel_equals_the_gather():
    from moe_jax.inference.sampling import Sampler

    gather, kernel = _models()
    prompts = [[5, 17, 99, 3, 41], [250, 7]]
    tokens = [np.asarray(Sampler(m).generate(prompts, 8, temperature=0).tokens)
              for m in (gather, kernel)]  # fmt: skip
    np.testing.assert_array_equal(tokens[1], tokens[0])


def test_quantised_experts_keep_the_gather():
    """int8 experts go through the gather (which dequantises only the picked rows) under
    moe.decode_impl=triton too: the same logits bit for bit."""
    from moe_jax.model.int8 import quantize_model

    gather, kernel = (quantize_model(m) for m in _models())
    tokens = jnp.array([[9]])
    np.testing.assert_array_equal(forward(kernel, tokens)[0], forward(gather, tokens)[0])


def test_the_kernel_is_named_for_gpus_and_auto_keeps_the_gather():
    """auto gathers on every backend (on the H200 the gather + GEMM was the faster,
    backends.AUTO); triton runs where named on a GPU, refused elsewhere in one line; dims
    the blocks do not divide fall back to the gather (`test_decode_step_...[odd dims]`)."""
    dims = lambda d, f: {"dims": (d, f)}
    for platform in ("cpu", "gpu", "tpu"):
        with backends.targeting(platform):
            assert backends.choose("decode", "auto", shape=dims(2048, 768)) == "gather"
    with backends.targeting("gpu"):
        assert backends.choose("decode", "triton", shape=dims(2048, 768)) == "triton"
        assert not backends.takes("triton", shape=dims(128, 40))
    with backends.targeting("tpu"), pytest.raises(backends.KernelError, match="gpu only"):
        backends.choose("decode", "triton", shape=dims(2048, 768))
    with pytest.raises(ConfigError, match="moe.decode_impl"):
        tiny_config("moe.decode_impl=fast")


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_one_row_projections_take_a_zero_row_on_gpus(platform):
    """On a GPU a single row's projection runs as two rows (XLA:GPU makes one row a multiply
    and a reduction); the first row's values are the plain einsum's either way."""
    x = jax.random.normal(jax.random.key(3), (1, 1, 16))
    w = jax.random.normal(jax.random.key(4), (16, 4, 8))
    with backends.targeting(platform):
        f = lambda x, w: weight_gather.rows_einsum("btd,dhk->bthk", x, w)
        jaxpr = str(jax.make_jaxpr(f)(x, w))
        got = jax.jit(f)(x, w)
    assert rel_err(got, jnp.einsum("btd,dhk->bthk", x, w)) < 1e-6  # another summation order
    assert ("concatenate" in jaxpr) == (platform == "gpu")
    # more than one row: the einsum as written
    with backends.targeting("gpu"):
        x2 = jnp.concatenate([x, x])
        assert "concatenate" not in str(jax.make_jaxpr(f)(x2, w))
