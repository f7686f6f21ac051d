"""Qwen3-Next and Qwen3.5-MoE (`moe_jax/interop/qwen3_next.py`) against `transformers`
(torch CPU, float32, eager attention, its torch fallbacks for the delta rule and the
convolution): imported logits, the export round trip, Qwen3.5's multimodal checkpoint as its
text model, and the full-size parameter counts. Decoding from the cache equals the full
forward in tests/test_hybrid.py (the model's cache and the jitted sampler's), so with the
logits here it equals transformers' too; that is not run a third time here.

Tiny random models (every weight redrawn, so a swapped or transposed tensor cannot hide
behind ones and zeros) with what each family can do: Qwen3-Next with dense and MoE layers
alternating (decoder_sparse_step 2), unnormalised top-k and one full-attention layer in 4;
Qwen3.5 with full attention every other layer, tied embeddings and its separate linear
projections. Sequences of 70 tokens: past one chunk of the rule (64).

Tolerance: 1e-4 absolute on logits of O(1) (the issue's); the two sides compute the same
float32 math in other orders (another triangular solve in the rule: see
tests/test_gated_deltanet.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the `interop` extra)"
)

from moe_jax.config import load_config  # noqa: E402
from moe_jax.config.shipped import config_path  # noqa: E402
from moe_jax.interop import config_from_hf, load_hf, save_hf  # noqa: E402
from moe_jax.interop.safetensors_io import TensorReader  # noqa: E402
from moe_jax.summary.counts import param_counts  # noqa: E402
from tests.test_interop import assert_same_params  # noqa: E402

TOL = 1e-4
V, T, PAD = 128, 70, 3
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # x partial_rotary_factor 0.25: 4 rotated dims
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SHIPPED = {"qwen3_next": "qwen3_next_80b_a3b", "qwen3_5_moe": "qwen3_5_35b_a3b"}  # configs/
SPECS = {
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=4, intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        dict(num_hidden_layers=4, full_attention_interval=2, tie_word_embeddings=True),
    ),
}


def _scale(name: str) -> float:
    """The random weights' scale: 0.1, but 1 for the linear layers' convolution (of order 1
    as in trained models and torch's init). At 0.1 the convolution shrank q, k and v to
    ~0.1, the rule's outputs to rms ~1e-4, and the gated norm's 1 / rms(o) magnified float32
    rounding (of state terms far larger than o) past 1e-4 at one position of 70."""
    return 1.0 if name.endswith(("conv1d.weight", "conv")) else 0.1


def _hf_model(name: str, seed: int = 0):
    """transformers' model with every parameter redrawn: N(0, `_scale`^2), the gated norm's
    weight 1 + that (applied as w), A = exp(A_log) ~ U(0.01, 1). Not the reference's
    U(0.01, 16): with decays that strong transformers' own float32 rule (decays between
    tokens as differences of cumulative sums near -1e3) is ~1e-5 off per layer, 2e-4 on
    these logits; ours keeps 1e-6 there against float64 (tests/test_gated_deltanet.py,
    which checks the layer at the reference's range)."""
    model_cls, config_cls, kwargs = SPECS[name]
    config = getattr(transformers, config_cls)(**COMMON, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _redraw_torch(model, seed)
    return model


def _redraw_torch(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = _scale(pname) * torch.randn(p.shape, generator=g)
            if pname.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 1, generator=g).log())
            else:
                p.copy_(1.0 + noise if pname.endswith("linear_attn.norm.weight") else noise)


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory):
    """(name, the transformers model, our imported config and model)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name) / "hf"
    model = _hf_model(name)
    model.save_pretrained(directory)
    cfg, ours = load_hf(directory)
    return name, model, cfg, ours


def _redrawn(model, seed: int):
    """`model` with every param drawn as `_hf_model` draws transformers' (N(0, `_scale`^2),
    the gated norm's 1 + that, A ~ U(0.01, 1)), keeping its graph, so that `_forward`
    reuses the program compiled for it."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = _scale(path[-1]) * rng.standard_normal(var.shape)
        if path[-1] == "norm_scale":  # the gated norm's, applied as w (the others 1 + w)
            value = value + 1.0
        elif path[-1] == "A_log":
            value = np.log(rng.uniform(0.01, 1, var.shape))
        # placed as the imported array is (committed to its device): another placement
        # would compile `_forward` anew
        array = jax.device_put(np.asarray(value, var[...].dtype), var[...].sharding)
        flat.append((path, var.copy(array)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@nnx.jit
def _forward(model, tokens_BT, segments_BT):
    return model(tokens_BT, segments=segments_BT)[0]


def _padded_batch(seed: int):
    """Two rows of 70 tokens, the second left-padded by 3 (attention_mask 0 / segment 0)."""
    tokens = np.random.default_rng(seed).integers(0, V, (2, T)).astype(np.int64)
    mask = np.ones((2, T), np.int64)
    mask[1, :PAD] = 0
    return tokens, mask


def _hf_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask))
    return out.logits.numpy()


def _our_logits(model, tokens, mask) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32)))


def test_imported_config_is_the_hybrid_stack(case):
    name, model, cfg, _ = case
    a = cfg.attention
    assert (a.linear, a.output_gate, a.partial_rotary_factor) == ("gated_deltanet", True, 0.25)
    assert cfg.model.zero_centered_norm and cfg.moe.shared_expert_gate
    kinds = ["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(4)]
    assert kinds == model.config.layer_types
    moe = [cfg.is_moe(i) for i in range(4)]
    assert moe == ([False, True] * 2 if name == "qwen3_next" else [True] * 4)


@pytest.mark.parametrize("case", ["qwen3_5_moe"], indirect=True)
def test_released_multimodal_qwen35_imports_its_text_model(case, tmp_path):
    """Qwen3.5 as released, `Qwen3_5MoeForConditionalGeneration` (a one-block vision
    tower beside the text model, its tensors under `model.language_model.`): the import is
    the text model, the vision tower skipped, and its logits on text are transformers'."""
    name, _, cfg, _ = case
    kwargs = SPECS[name][2]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen3_5MoeConfig(
        text_config=COMMON | kwargs, vision_config=vision, tie_word_embeddings=True
    )
    torch.manual_seed(3)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    _redraw_torch(model, seed=3)
    model.save_pretrained(tmp_path)
    names = TensorReader(tmp_path).names()
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    imported, ours = load_hf(tmp_path)
    assert imported == cfg  # the text model's config, as the text-only checkpoint's
    tokens, mask = _padded_batch(4)
    with torch.no_grad():  # no padding: the multimodal model counts its positions from 0
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = _our_logits(ours, tokens, np.ones_like(mask))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", list(SPECS))
def test_full_size_configs_count_the_parameters_transformers_counts(name, tmp_path):
    """The config classes' defaults are the releases' shapes (Qwen3-Next-80B-A3B,
    Qwen3.5-35B-A3B): the config imported from their config.json counts the parameters
    transformers' model has (built on the meta device: shapes only)."""
    model_cls, config_cls, _ = SPECS[name]
    config = getattr(transformers, config_cls)()
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    want = sum(p.numel() for p in model.parameters())
    assert want > 3e10  # the full size: 35B, 80B
    imported = config_from_hf(tmp_path)
    assert param_counts(imported)[0] == want
    # the shipped shape config is that config (in bf16, a shape config's compute dtype)
    shipped = load_config(config_path(SHIPPED[name]))
    for section in ("model", "attention", "moe"):
        want_section = getattr(imported, section)
        if section == "model":
            want_section = dataclasses.replace(want_section, dtype="bfloat16")
        assert getattr(shipped, section) == want_section, section


def test_imported_logits_match_transformers(case):
    """70 tokens (a chunk and a part), one row left-padded: the real positions' logits."""
    _, model, cfg, ours = case
    assert cfg.moe.capacity_factor == 0
    tokens, mask = _padded_batch(0)
    want = _hf_logits(model, tokens, mask)
    got = _our_logits(ours, tokens, mask)
    real = mask.astype(bool)
    assert np.std(want[real]) > 0.3  # O(1) logits, so 1e-4 is tight
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=TOL)


def test_export_round_trip(case, tmp_path):
    """Our random model -> save_hf -> transformers: the same logits; and back: the same
    config and bit-identical weights."""
    name, model, cfg, ours = case
    fresh = _redrawn(ours, seed=2)
    out = tmp_path / "export"
    arch = save_hf(cfg, fresh, out, architecture=type(model).__name__, max_shard_bytes=100_000)
    assert arch == type(model).__name__
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(loaded).__name__ == arch
    tokens, mask = _padded_batch(3)
    real = mask.astype(bool)
    want = _hf_logits(loaded.eval(), tokens, mask)
    got = _our_logits(fresh, tokens, mask)
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=TOL)
    cfg2, back = load_hf(out)
    assert cfg2 == cfg
    assert_same_params(back, fresh)
