"""Gated DeltaNet (moe_jax/model/gated_deltanet.py): the chunked rule against the recurrence in
float64, forward and gradient; the layer against transformers' torch layers (Qwen3-Next's fused
projections and Qwen3.5-MoE's separate ones), forward and gradient; prefill then decode
against the full forward. Each jitted program is built once for the module."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model import gated_deltanet as gdn

# Tiny sizes with every distinction the layer makes: 2 key heads serving 4 value heads (G = 2),
# key and value widths that differ, the reference's conv kernel. 80 tokens: a whole chunk and
# a padded one (64 + 16).
SIZES = gdn.GDNSizes(d_model=32, n_key_heads=2, n_value_heads=4, key_dim=8, value_dim=6)
B, T = 2, 80
PREFIX = 67  # prefilled tokens before decoding: more than a chunk, not a multiple of it
LAYOUTS = ("qwen3_next", "qwen3_5_moe")


# ----------------------------------------------------------------------------- the rule


def _rule_inputs(rng, T, strongest_decay=2.0):
    """Inputs as the layer makes them: unit keys, queries scaled by 1/sqrt(K), decays g in
    (-strongest_decay, 0) (g = -A softplus(.)), beta in (0, 1); a random initial state."""
    N, H, K, V = 2, 4, 8, 6
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, T, N, K))) * K**-0.5
    k = unit(rng.normal(size=(B, T, N, K)))
    v = rng.normal(size=(B, T, H, V))
    g = -rng.uniform(0.0, strongest_decay, size=(B, T, H))
    beta = rng.uniform(size=(B, T, H))
    S0 = rng.normal(size=(B, H, K, V))
    return q, k, v, g, beta, S0  # numpy float64


def _outputs_and_grads(rule, inputs, weights):
    """The rule's outputs and final state, and the gradient of a fixed random scalar of both
    with respect to q, k, v, g, beta and the initial state."""

    def scalar(*args):
        o, S = rule(*args)
        return jnp.sum(o * weights[0]) + jnp.sum(S * weights[1]), (o, S)

    grads, (o, S) = jax.jit(jax.grad(scalar, argnums=tuple(range(6)), has_aux=True))(*inputs)
    return o, S, grads


def test_chunked_rule_equals_the_recurrence_in_float64_forward_and_gradient():
    """150 tokens (two whole chunks and a padded third) from a random state.

    Tolerance 1e-10 (absolute, on values of order 1): both forms are exact rearrangements of
    the same sums, so in float64 (eps 2.2e-16) they differ by rounding only. The chunked form
    adds a 64-row unit-triangular solve whose off-diagonal entries are at most 1 in size
    (unit keys, beta < 1, decays <= 1) and a few hundred multiply-adds per output; measured
    differences are 3e-16 (forward) and 2e-15 (gradient), so 1e-10 fails on any real
    error (a wrong decay, mask or padding moves values by 1e-3 or more) and never on
    rounding."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        inputs = tuple(map(jnp.asarray, _rule_inputs(rng, 150)))
        weights = tuple(jnp.asarray(rng.normal(size=x.shape)) for x in (inputs[2], inputs[5]))
        chunked = _outputs_and_grads(gdn.chunked_rule, inputs, weights)
        recurrent = _outputs_and_grads(gdn.recurrent_rule, inputs, weights)
        assert chunked[0].dtype == jnp.float64
        for name, a, b in zip(("outputs", "state"), chunked[:2], recurrent[:2], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=name)
        names = ("q", "k", "v", "g", "beta", "initial state")
        for name, a, b in zip(names, chunked[2], recurrent[2], strict=True):
            assert np.abs(b).max() > 1e-3, name  # the gradient reaches every input
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"d/d{name}")


def test_float32_chunked_rule_keeps_strong_decays_accurate():
    """Decays down to g = -60 a token (A = 16 on a large softplus: a chunk's cumulative decay
    reaches -2e3), the float32 chunked rule against the float64 recurrence. The decay between
    two tokens summed over their own g's (`_gaps`) keeps it within 1e-6 (measured 7e-8);
    taken as a difference of the chunk's cumulative sums, as transformers' torch form takes
    it, it was 6e-6 off (float32's rounding of sums near -1e3)."""
    rng = np.random.default_rng(1)
    inputs = _rule_inputs(rng, 100, strongest_decay=60.0)
    got, _ = jax.jit(gdn.chunked_rule)(*(jnp.asarray(x, jnp.float32) for x in inputs))
    with jax.enable_x64(True):
        want, _ = jax.jit(gdn.recurrent_rule)(*(jnp.asarray(x, jnp.float64) for x in inputs))
        want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the layer


@pytest.fixture(scope="module")
def jitted():
    """The layer's programs, each compiled once: the training forward (with a padding mask),
    prefill, one decode step, and the gradient of a scalar of the forward."""
    graphdef, _ = nnx.split(gdn.GatedDeltaNet(SIZES, rngs=nnx.Rngs(0)))
    layer = lambda params: nnx.merge(graphdef, params)
    forward = lambda params, x, mask: layer(params)(x, mask)

    def scalar(params, x, mask, r):
        return jnp.sum(forward(params, x, mask) * r)

    return {
        "forward": jax.jit(forward),
        "prefill": jax.jit(lambda params, x, mask: layer(params).prefill(x, None, mask)),
        "step": jax.jit(lambda params, x, state: layer(params).step(x, state)),
        "init_state": lambda params: layer(params).init_state(B),
        "grad": jax.jit(jax.grad(scalar, argnums=(0, 1))),
    }


def _weight_scale(name: str) -> float:
    """The random weights' scale: the projections' keep their outputs of order 1; b's and
    a's rows smaller (b, a ~ N(0, 0.6)) so that no head's beta is near 0, where its output
    nears 0 and the gated norm's 1 / rms(o) magnifies every rounding (a head at rms 2e-3
    turned float32 rounding into 1e-4 differences, in transformers' layer as in ours)."""
    if name in ("in_proj_ba.weight", "in_proj_b.weight", "in_proj_a.weight"):
        return 0.1
    return 0.3 if "proj" in name else 1.0


def _torch_layer(layout: str):
    """transformers' layer with random weights (every parameter, not its init: a weight left
    at ones or zeros would hide a misplaced one), and its weights as numpy; they map onto
    ours and back (`from_hf`, `to_hf`) unchanged."""
    torch = pytest.importorskip("torch", reason="needs torch (the `interop` extra)")
    pytest.importorskip("transformers", reason="needs transformers (the `interop` extra)")
    # Without fla and causal-conv1d transformers runs its torch fallback, the reference here.
    assert importlib.util.find_spec("fla") is None, "fla installed: not the torch fallback"
    assert importlib.util.find_spec("causal_conv1d") is None, "not the torch fallback"
    if layout == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        config, cls = m.Qwen3NextConfig, m.Qwen3NextGatedDeltaNet
    else:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        config, cls = m.Qwen3_5MoeTextConfig, m.Qwen3_5MoeGatedDeltaNet
    c = config(
        hidden_size=SIZES.d_model,
        linear_num_key_heads=SIZES.n_key_heads,
        linear_num_value_heads=SIZES.n_value_heads,
        linear_key_head_dim=SIZES.key_dim,
        linear_value_head_dim=SIZES.value_dim,
        linear_conv_kernel_dim=SIZES.conv_kernel,
        rms_norm_eps=SIZES.eps,
        num_hidden_layers=4,
    )
    assert gdn.GDNSizes.from_hf_config(c.to_dict()) == SIZES
    torch.manual_seed({"qwen3_next": 1, "qwen3_5_moe": 2}[layout])
    ref = cls(c, layer_idx=0).float()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name == "A_log":  # the reference's own range: decays from mild to strong
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            else:
                p.copy_(torch.randn_like(p) * _weight_scale(name))
        ref.norm.weight.add_(1.0)
    weights = {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}
    assert gdn.hf_layout(weights) == layout
    back = gdn.to_hf(gdn.from_hf(weights, SIZES), SIZES, layout)  # the export's mapping
    assert back.keys() == weights.keys()
    for name, w in weights.items():
        np.testing.assert_array_equal(back[name], w, err_msg=name)
    return torch, ref, weights


@pytest.fixture(scope="module", params=LAYOUTS)
def reference(request):
    """(torch, the torch layer, our layer's parameters with its weights copied across)."""
    torch, ref, weights = _torch_layer(request.param)
    layer = gdn.GatedDeltaNet(SIZES, rngs=nnx.Rngs(0))
    gdn.load_hf(layer, weights)
    return torch, ref, nnx.split(layer)[1]


def _inputs(seed: int, length: int = T):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, length, SIZES.d_model)).astype(np.float32)
    mask = np.ones((B, length), np.float32)
    mask[1, :5] = 0  # the second row left-padded, as the sampler pads prompts
    return x, mask


def test_layer_equals_transformers(reference, jitted):
    """80 tokens, batch 2, one row left-padded, float32, both weight layouts.

    Tolerance 1e-4 absolute, on outputs of up to ~30 (3e-6 of the largest): the same float32
    arithmetic in another order (another triangular solve, other einsum groupings, the
    decays between tokens summed rather than differenced: `_gaps`), whose rounding (eps
    1.2e-7 relative) grows through the 80-token state, the norms and the projections to
    1.7e-5 (Qwen3-Next's weights) and 9e-6 (Qwen3.5's), measured; a misplaced weight, head
    or decay moves outputs by 1e-2 or more."""
    torch, ref, params = reference
    x, mask = _inputs(3)
    with torch.no_grad():
        want = ref(torch.from_numpy(x), attention_mask=torch.from_numpy(mask)).numpy()
    got = np.asarray(jitted["forward"](params, x, mask))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_layer_gradient_equals_torch_autograd(reference, jitted):
    """The gradient of a random scalar of the outputs (20 tokens, one row left-padded) with
    respect to the input and every weight, against torch autograd of the reference: ours
    mapped onto our weights by the same `from_hf` that maps the weights. Tolerance 1e-4
    relative to each gradient's largest entry (float32, as above; measured 6e-6 at most)."""
    torch, ref, params = reference
    x, mask = _inputs(4, length=20)
    r = np.random.default_rng(5).normal(size=(B, 20, SIZES.d_model)).astype(np.float32)
    x_t = torch.from_numpy(x).requires_grad_(True)
    ref.zero_grad()
    (ref(x_t, attention_mask=torch.from_numpy(mask)) * torch.from_numpy(r)).sum().backward()
    want = gdn.from_hf({n: p.grad.numpy() for n, p in ref.named_parameters()}, SIZES)
    want["x"] = x_t.grad.numpy()
    d_params, d_x = jitted["grad"](params, x, mask, r)
    got = {name: np.asarray(d_params[name][...]) for name in want if name != "x"}
    got["x"] = np.asarray(d_x)
    for name, w in want.items():
        scale = np.abs(w).max()
        assert scale > 1e-3, name
        np.testing.assert_allclose(got[name], w, rtol=0, atol=1e-4 * scale, err_msg=name)


def test_prefill_then_decode_equals_the_full_forward(reference, jitted):
    """Prefill 67 tokens (chunked, padded; the second row's first 5 masked, a left-padded
    prompt), then decode the other 13 one at a time (the recurrence and the conv window):
    every position equals the full forward's. Also the first 5 tokens decoded from an empty
    state (the window still holding the zeros before the sequence), against the unmasked
    forward. Tolerance 2e-5 absolute (float32, outputs of up to ~30): the two forms differ
    by rounding only (measured 4e-6)."""
    _, _, params = reference
    x, mask = _inputs(6)
    full = np.asarray(jitted["forward"](params, x, mask))
    y, state = jitted["prefill"](params, x[:, :PREFIX], mask[:, :PREFIX])
    decoded = [np.asarray(y)]
    for t in range(PREFIX, T):
        y_t, state = jitted["step"](params, x[:, t], state)
        decoded.append(np.asarray(y_t)[:, None])
    np.testing.assert_allclose(np.concatenate(decoded, axis=1), full, rtol=0, atol=2e-5)

    full = np.asarray(jitted["forward"](params, x, np.ones((B, T), np.float32)))
    state = jitted["init_state"](params)
    for t in range(5):
        y_t, state = jitted["step"](params, x[:, t], state)
        np.testing.assert_allclose(np.asarray(y_t), full[:, t], rtol=0, atol=2e-5)
