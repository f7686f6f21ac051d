"""Expert SwiGLU on the filled rows of its buffers only (`moe_jax.model.row_buckets`).

Reference: `moe.swiglu_rows` (the plain SwiGLU) on the rows of the segment's bucket, zeros
past them, differentiated by JAX. Same float32 matmuls on the same rows, so only the
matmuls' blocking can differ: values to 1e-5 relative (1e-6 absolute near zero); gradients,
whose weight parts are sums over up to 164 rows of O(1) terms, to 1e-4 (1e-5 absolute). A
skipped or misplaced row is off by the activations themselves (~1).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.model import routing
from moe_jax.model.experts import expert_swiglu, swiglu_rows
from moe_jax.model.remat import remat
from moe_jax.model.row_buckets import bucket_index, row_buckets, swiglu_filled
from tests.conftest import DEFAULT_EMITTERS
from tests.helpers import one_expert_at_a_time, tiny_config

S, C, D, F = 3, 100, 16, 24
FILLED = [0, 33, 100]  # nothing, just past the first bucket (32), everything


def test_row_buckets_and_bucket_index():
    assert row_buckets(1280) == (0, 160, 320, 480, 640, 800, 960, 1120, 1280)
    assert row_buckets(100) == (0, 32, 64, 96, 100)  # at least MIN_BUCKET_ROWS per step
    assert row_buckets(20) == (0, 20)
    b = row_buckets(100)
    index = bucket_index(jnp.array([0, 1, 32, 33, 96, 97, 100]), b)
    np.testing.assert_array_equal(index, [0, 1, 1, 2, 3, 4, 4])


def weights(with_bias: bool) -> dict:
    keys = jax.random.split(jax.random.key(0), 5)
    w = {
        "w_gate": jax.random.normal(keys[0], (D, F)) * 0.3,
        "w_up": jax.random.normal(keys[1], (D, F)) * 0.3,
        "w_down": jax.random.normal(keys[2], (F, D)) * 0.3,
    }
    if with_bias:
        w["gate_bias"] = jax.random.normal(keys[3], (F,)) * 0.3
        w["up_bias"] = jax.random.normal(keys[4], (F,)) * 0.3
    return w


def reference(x_SCD, w, rows_S):
    """swiglu_rows on every row, then zeros from each segment's bucket end (rows_S) on."""
    keep_SC1 = jnp.arange(C)[None, :, None] < jnp.asarray(rows_S)[:, None, None]
    return jnp.where(keep_SC1, swiglu_rows(x_SCD, w, jnp.float32), 0.0)


@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_equal_swiglu_on_the_bucket_rows(with_bias):
    # Nonzero inputs in every slot: rows past a bucket must come out zero because they were
    # not computed, not because their inputs were zero.
    x = jax.random.normal(jax.random.key(1), (S, C, D))
    w = weights(with_bias)
    filled = jnp.asarray(FILLED)
    y = jax.jit(swiglu_filled, static_argnums=3)(x, w, filled, jnp.float32)
    rows = [0, 64, 100]  # the buckets holding FILLED
    ref = reference(x, w, rows)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert np.all(y[0] == 0) and np.all(y[1, 64:] == 0) and np.all(y[1, :33] != 0)

    probe = jax.random.normal(jax.random.key(2), (S, C, D))
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)) * probe)
    grads = jax.jit(jax.grad(loss(lambda x, w: swiglu_filled(x, w, filled, jnp.float32)), (0, 1)))
    ref_grads = jax.jit(jax.grad(loss(lambda x, w: reference(x, w, rows)), (0, 1)))
    got_grads, want_grads = jax.tree.leaves(grads(x, w)), jax.tree.leaves(ref_grads(x, w))
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("unrolled", [True, False], ids=["unrolled", "lax_map"])
def test_remat_keeps_one_output_and_the_padded_projections_not_every_bucket(
    capsys, monkeypatch, unrolled
):
    """Under `model.remat=dots` the per-expert path's saved residuals are full-capacity
    arrays. Left to the dots policy, the switch kept each branch's down-projection output,
    one array per bucket size (0.7 GB more for the medium benchmark)."""
    one_expert_at_a_time(monkeypatch, unrolled)
    E = 2
    x = jax.random.normal(jax.random.key(1), (E, 1, C, D))
    w = {n: jnp.stack([a] * E) for n, a in weights(True).items()}
    filled = jnp.asarray([[33], [100]])
    swiglu = lambda x, w: expert_swiglu(x, w, jnp.float32, filled_ES=filled)
    fn = remat(lambda x, w: jnp.sum(jnp.sin(swiglu(x, w))), "dots")
    jax.ad_checkpoint.print_saved_residuals(fn, x, w)
    shapes = re.findall(r"f32\[([\d,]+)\]", capsys.readouterr().out)
    rows = {int(s.split(",")[-2]) for s in shapes if s.count(",") >= 1}
    assert C in rows and not rows & set(row_buckets(C)[1:-1]), shapes


@pytest.fixture(scope="module", params=[True, False], ids=["unrolled", "lax_map"])
def scanned_train_grad_hlo(request):
    """(unrolled, compiled HLO of a scanned, remat'd tiny MoE model's training gradient,
    config, the experts' capacity), with the per-expert path forced on its small buffers,
    its experts unrolled or in a `lax.map`: compiled once for the two tests below."""
    from flax import nnx

    from moe_jax.model import Transformer
    from moe_jax.train.step import loss_fn

    unrolled = request.param
    with pytest.MonkeyPatch.context() as monkeypatch:
        one_expert_at_a_time(monkeypatch, unrolled)
        over = ["moe.interleave_step=1", "attention.nope_interval=0", "model.scan_layers=true"]
        cfg = tiny_config(*over, "model.remat=dots")
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
        B, T = 2, 64
        toks = jax.random.randint(jax.random.key(0), (B, T), 0, 256)
        grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True), static_argnums=(1, 3))
        # XLA:CPU's default emitters, which conftest may swap for compile speed: the copies
        # looked for are the default pipeline's (the classic one copies more).
        lowered = grad_fn.lower(params, graphdef, toks, 1e-4)
        hlo = lowered.compile(compiler_options=DEFAULT_EMITTERS).as_text()
    return unrolled, hlo, cfg, routing.capacity(B * (T - 1), cfg.moe)  # loss predicts T - 1


def test_expert_buffers_cross_the_map_and_the_layer_scan_without_copies(scanned_train_grad_hlo):
    """One routing group is a size-1 segment axis in the [E, S, C, .] buffers. Carried as
    such through the expert map and (as saved gate/up products) the layer scan, XLA:CPU gave
    that axis a permuted layout and copied every buffer back at each loop boundary (5 copies
    of expert buffers per layer at medium, ~2% of the step). The experts take [E, S * C, .]
    rows instead: the compiled train gradient copies no array with a capacity axis
    from one layout to another."""
    _, hlo, _, cap = scanned_train_grad_hlo
    assert f",{cap}," in hlo, "the test no longer sees the expert buffers"
    # (Copies of a broadcast are the loops' zero-filled output buffers, not layout changes.)
    copy = r"= f32\[([\d,]+)\]\S* (?:copy\((?!%wrapped_broadcast)|fusion\(.*calls=%wrapped_copy)"
    copies = re.findall(copy, hlo)
    assert not [c for c in copies if str(cap) in c.split(",")], copies


def test_unrolled_experts_never_copy_a_layers_expert_weights(scanned_train_grad_hlo):
    """Unrolled inside the layer scan, each expert reads its weights as one slice of the
    stacked [L, E, D, F] parameters and its gradients are concatenated once. Through
    `lax.map`, the layer's [E, D, F] weights were copied out of the stack (a fusion), the
    gradients stacked in a zero-filled [E, D, F] buffer (broadcast, dynamic-update-slice)
    and copied on. Taken as E slices `a[e]`, the gradients would be E zero-padded [E, D, F]
    arrays summed. So: in the unrolled gradient only a bitcast or the one concatenate makes
    an [E, D, F] array; the map's gradient is checked to be caught."""
    unrolled, hlo, cfg, _ = scanned_train_grad_hlo
    E, D, F = cfg.moe.n_experts, cfg.model.d_model, cfg.moe.expert_hidden
    made = set()
    for shape in (f"{E},{D},{F}", f"{E},{F},{D}"):
        made |= set(re.findall(rf"= f32\[{shape}\]\S* ([\w-]+)\(", hlo))
    if unrolled:
        # (XLA in jax 0.11+ makes the concatenate alone; 0.10.2 a bitcast too)
        assert "concatenate" in made and made <= {"bitcast", "concatenate"}, made
    else:  # the old way, caught
        assert {"fusion", "dynamic-update-slice", "broadcast"} <= made, made
