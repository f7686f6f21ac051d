"""The accelerators' attention kernels against the CPU's blocked attention, and the blocked
KV-cache prefill against the whole-prompt one.

Splash runs here in Pallas interpret mode (plain JAX ops on the CPU), so its numerics are
checked against `Attention._blocked` for every mask kind; cuDNN cannot run without a GPU,
so it is checked to compile for one (and splash for a TPU) on compile-only devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.model import attention
from moe_jax.model.attention import ATTENTION_OUT, Attention
from moe_jax.sharding import make_mesh
from tests.helpers import tiny_config

# float32 throughout, matmuls at full precision (conftest): both paths compute the same sums,
# splash online over 128-key tiles where `_blocked` takes a block's keys at once, so they differ
# by float32 reassociation only: ~1e-6 relative to values of order 1 (measured <= 1e-6).
TOL = dict(rtol=2e-5, atol=2e-5)
B, T = 2, 384  # three of splash's 128-wide tiles: the online softmax spans tiles


def _qkv(attn: Attention, seed: int = 0):
    H, K, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, T, H, hd)),
        jax.random.normal(kk, (B, T, K, hd)),
        jax.random.normal(kv, (B, T, K, hd)),
    )


def _packed():
    """Row 0: documents of 100, 150 and 98 tokens then 36 of padding (segment 0), positions
    restarting at each; row 1: one document of 384 tokens."""
    sizes = [(1, 100), (2, 150), (3, 98), (0, 36)]
    seg0 = np.concatenate([np.full(n, s) for s, n in sizes])
    pos0 = np.concatenate([np.arange(n) for _, n in sizes])
    segments = jnp.asarray(np.stack([seg0, np.ones(T, int)]), jnp.int32)
    positions = jnp.asarray(np.stack([pos0, np.arange(T)]), jnp.int32)
    return positions, segments


def _value_and_grads(attn: Attention, impl: str, q, k, v, positions, segments):
    """Output and (dq, dk, dv) of a loss weighting every output element differently."""
    attn.impl = impl

    def loss(q, k, v):
        out = attn._self_attention(q, k, v, positions, segments)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_close(got, want):
    names = ("out", "dq", "dk", "dv")
    for name, a, b in zip(names, (got[0], *got[1]), (want[0], *want[1]), strict=True):
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)


@pytest.mark.parametrize(
    "overrides, packed",
    [
        ((), False),  # causal
        (("attention.sliding_window=100",), False),
        (("attention.chunk_size=96",), False),
        (("attention.chunk_size=64",), True),  # documents, and chunks within them
    ],
    ids=["causal", "window", "chunked", "packed"],
)
def test_splash_equals_blocked_values_and_gradients(overrides, packed):
    # head_dim 8 and 4 query heads over 2 key/value heads: GQA in every case
    attn = Attention(tiny_config(*overrides), 0, rngs=nnx.Rngs(0))
    q, k, v = _qkv(attn)
    if packed:
        positions, segments = _packed()
    else:
        positions, segments = jnp.broadcast_to(jnp.arange(T), (B, T)), None
    want = _value_and_grads(attn, "blocked", q, k, v, positions, segments)
    got = _value_and_grads(attn, "splash", q, k, v, positions, segments)
    _assert_close(got, want)


def test_splash_under_a_mesh_runs_on_each_devices_rows_and_heads():
    """Rows over data (2), heads over tensor (2): the same values as on one device."""
    cfg = tiny_config("attention.sliding_window=100", "mesh.data=2", "mesh.tensor=2")
    attn = Attention(cfg, 0, rngs=nnx.Rngs(0))
    q, k, v = _qkv(attn, seed=1)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    want = _value_and_grads(attn, "blocked", q, k, v, positions, None)
    mesh = make_mesh(cfg, jax.devices()[:4])
    x = NamedSharding(mesh, P(("data",), None, "tensor", None))
    q, k, v = (jax.device_put(a, x) for a in (q, k, v))
    with jax.set_mesh(mesh):
        got = _value_and_grads(attn, "splash", q, k, v, positions, None)
    _assert_close(got, want)


def test_blocked_prefill_equals_the_whole_prompt_at_once(monkeypatch):
    """A 40-token prompt after 8 cached ones, in query blocks of 16 (the last padded), gives
    the logits and cache of one [T, S] attention; a chunked RoPE layer and a NoPE layer with
    temperature tuning, so that the masks by position are exercised. Same sums per query row
    either way: only float32 reassociation in the batched matmuls may differ (1e-6)."""
    from moe_jax.model import Transformer

    cfg = tiny_config("model.n_layers=2", "attention.nope_interval=2", "attention.chunk_size=12")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(2), (2, 48), 0, cfg.model.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(48), (2, 48))
    seen = []
    real_attend = attention.attend
    monkeypatch.setattr(
        attention, "attend", lambda q, *a: seen.append(q.shape[1]) or real_attend(q, *a)
    )

    def prefill(block):
        monkeypatch.setattr(attention, "PREFILL_BLOCK", block)
        seen.clear()
        run = nnx.jit(lambda m, t, p, c: m(t, positions=p, cache=c))  # new: traced anew
        _, _, cache = run(model, toks[:, :8], pos[:, :8], model.init_cache(2, 64))
        logits, _, cache = run(model, toks[:, 8:], pos[:, 8:], cache)
        return logits, cache, sorted(set(seen))

    whole, whole_cache, whole_seen = prefill(512)
    blocked, blocked_cache, blocked_seen = prefill(16)
    assert (whole_seen, blocked_seen) == ([8, 40], [8, 16])  # the blocks did run
    np.testing.assert_allclose(blocked, whole, rtol=1e-6, atol=1e-6)
    # the second layer's keys and values come from the first layer's attention
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    jax.tree.map(close, blocked_cache, whole_cache)


def test_cudnn_takes_bfloat16_and_not_cudnn_on_a_tpu():
    attn = Attention(tiny_config("attention.impl=cudnn"), 0, rngs=nnx.Rngs(0))
    q, k, v = _qkv(attn)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    with backends.targeting("gpu"), pytest.raises(ValueError, match="model.dtype=bfloat16"):
        attn._self_attention(q, k, v, positions, None)
    with backends.targeting("tpu"), pytest.raises(ValueError, match="runs on gpu only"):
        attn._self_attention(q, k, v, positions, None)


def test_named_residuals_are_kept_by_remat_dots_not_recomputed():
    """cuDNN's call (`cudnn_attention.attention`) names its residuals through
    `named_residuals`; here the same wrapper around a custom_vjp with one `exp` in its
    forward and its residual that `exp`, in a two-layer scan under remat=dots: the named
    residual is kept, so the backward scan computes no `exp`; unnamed, it recomputes it.
    The gradient is the function's own either way."""
    from moe_jax.kernels.cudnn_attention import named_residuals
    from moe_jax.model.remat import remat

    @jax.custom_vjp
    def f(x):
        return jnp.exp(x)

    f.defvjp(lambda x: (jnp.exp(x), jnp.exp(x)), lambda e, g: (e * g,))
    x = jax.random.normal(jax.random.key(0), (64,))

    def compiled_grad(fn):
        def loss(x):
            step = remat(lambda c, _: (fn(c) * 0.25, None), "dots")
            return jnp.sum(jax.lax.scan(step, x, None, length=2)[0])

        grad = jax.jit(jax.grad(loss))
        return grad(x), grad.lower(x).compile().as_text().count("exponential(")

    plain, n_plain = compiled_grad(f)
    named, n_named = compiled_grad(named_residuals(f, ATTENTION_OUT, lambda r, out: True))
    unnamed, n_unnamed = compiled_grad(named_residuals(f, ATTENTION_OUT, lambda r, out: False))
    np.testing.assert_allclose(named, plain, rtol=1e-6)
    np.testing.assert_allclose(unnamed, plain, rtol=1e-6)
    assert (n_named, n_unnamed) == (1, 2)  # the forward scan's exp; and the backward's


# ----------------------------------------------------------------------------- compiled


def _compile_layer_grad(
    topology: str, impl: str, mesh_axes: dict[str, int], packed: bool, remat: str = "none"
):
    """Forward and backward of one attention (4 heads over 2 kv heads of 128, 1024 tokens,
    bf16, a sliding window, packed documents or not) compiled for `topology`'s devices, under
    the `remat` policy (moe_jax/model/remat.py); its HLO text."""
    from moe_jax.aot.topology import get_topology
    from moe_jax.model.remat import remat as with_remat

    # "local": this host's devices (the GPU kit's run of the cuDNN checks)
    if topology == "local":
        devices, platform = jax.devices(), jax.default_backend()
    else:
        topo = get_topology(topology)
        devices, platform = list(topo.devices), topo.platform
    overrides = [f"mesh.{ax}={n}" for ax, n in mesh_axes.items()]
    cfg = tiny_config(
        "model.d_model=512", "model.dtype=bfloat16", "attention.sliding_window=256", *overrides
    )
    attn = Attention(cfg, 0, rngs=nnx.Rngs(0))
    attn.impl = impl
    mesh = make_mesh(cfg, devices)
    Bc, Tc = 4, 1024
    x = NamedSharding(mesh, P(("data",), None, "tensor", None))
    rows = NamedSharding(mesh, P(("data",), None))
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=x)
    ints = jax.ShapeDtypeStruct((Bc, Tc), jnp.int32, sharding=rows)

    def layer(q, k, v, positions, *segments):
        return attn._self_attention(q, k, v, positions, *segments or (None,))

    def loss(q, k, v, positions, *segments):
        if remat == "none":
            out = layer(q, k, v, positions, *segments)
        else:  # two layers in a scan, as the model runs them: XLA cannot merge a recomputed
            # forward into the first one across the loop boundary
            step = with_remat(lambda x, _: (layer(x, k, v, positions, *segments), None), remat)
            out, _ = jax.lax.scan(step, q, None, length=2)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    qkv = bf16(Bc, Tc, 4, 128), bf16(Bc, Tc, 2, 128), bf16(Bc, Tc, 2, 128)
    # The default precision, as the programs run: under the tests' `highest` Mosaic refuses
    # the bf16 kernels' matmuls (it has no float32 contraction of bf16 operands).
    with (
        backends.targeting(platform),
        jax.set_mesh(mesh),
        jax.default_matmul_precision("default"),
    ):
        lowered = grad.lower(*qkv, ints, *(ints,) * packed)
    return lowered.compile().as_text()


def _needs_aot_extra():
    pytest.importorskip("libtpu", reason="the `aot` extra (libtpu) is not installed")
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the `aot` extra (CUDA plugin) is missing")


def test_splash_compiles_for_a_tpu_per_device():
    _needs_aot_extra()
    hlo = _compile_layer_grad("v5p-8", "splash", {"data": 2, "tensor": 2}, packed=True)
    # forward, dq and dkv kernels, as Mosaic calls on each device's 2 rows and 1 kv head
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 3
    assert "all-gather" not in hlo  # q, k and v stay where the mesh put them


def test_cudnn_compiles_for_a_gpu():
    """From this CPU for an H100 (the `aot` extra); it needs cuDNN on the host, which CI's
    machines lack (716 MB), so there it skips: the GPU kit runs the same checks on the GPU
    (tests/test_gpu.py::test_cudnn_calls_in_the_compiled_layer)."""
    _needs_aot_extra()
    if not backends.cudnn_installed():  # the `aot` extra leaves it out (716 MB)
        pytest.skip("cuDNN is not installed (nvidia-cudnn-cu12): JAX refuses to trace cuDNN calls")
    assert_cudnn_calls("h100:1x1")


def assert_cudnn_calls(topology: str) -> None:
    """The attention layer's compiled gradient calls cuDNN's fused kernels as the train step
    needs them, compiled for `topology` ("local": this host's GPU)."""
    fwd, bwd = 'custom_call_target="__cudnn$fmhaSoftmax"', "__cudnn$fmhaSoftmaxBackward"
    # causal and the window: cuDNN's own masks, no bias
    hlo = _compile_layer_grad(topology, "cudnn", {}, packed=False)
    assert hlo.count(fwd) == 1 and bwd in hlo
    # cuDNN's calls carry no FLOPs the HLO says: counted as uncosted, never as zero work
    from moe_jax.aot import hlo as hlo_analysis

    assert hlo_analysis.analyze(hlo).count(hlo_analysis.UNCOSTED) == 2
    # remat=dots keeps the named output and statistics: the backward scan runs no forward of
    # its own (before they were named it did)
    hlo = _compile_layer_grad(topology, "cudnn", {}, packed=False, remat="dots")
    assert hlo.count(fwd) == 1 and hlo.count(bwd) == 1  # one of each, in the two scan bodies
    # documents: a [B, 1, T, S] bias, and no gradient for it (jax's own call returns a
    # bf16[4,1,1024,1024] dbias from the backward)
    hlo = _compile_layer_grad(topology, "cudnn", {}, packed=True)
    (bwd_line,) = [ln for ln in hlo.splitlines() if "fmhaScaleBiasSoftmaxBackward" in ln]
    assert (
        "bf16[4,4,1024,128]" in bwd_line
        and "[4,1,1024,1024]" not in bwd_line.split("custom-call")[0]
    )
