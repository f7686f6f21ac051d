"""DeepSeek-V3.2 and GLM-5 (`moe_jax/interop/dsa.py`: DeepSeek Sparse Attention on MLA)
against `transformers` (torch CPU, float32, eager attention): imported logits, greedy decoding
through our cache (the indexer's keys beside the latent), the export round trip, the
full-size parameter counts and the refusals.

Tiny random models (every weight redrawn, norm scales 1 + noise), each built once per module:
- deepseek_v32: rotate-half indexer RoPE under YaRN (mscale 0.707 / mscale_all_dim 1),
  groups of experts (2 of 4), 1 dense layer, 3 layers, every one with its indexer;
- glm_moe_dsa: interleaved indexer RoPE, 5 layers of which 2 reuse the selection of the
  layer before (index_topk_freq 2, index_skip_topk_offset 2: full, full, shared, full,
  shared), so a selection crosses the layer scan's blocks.
index_topk 6 under sequences of 20 (and 17 when decoding): most queries attend to 6 of
their keys, and transformers' logits with the selection switched off differ by > 1e-2
(checked below), so the sparse path is what is compared. The selection is compared only
where the scores decide it: two keys tied at a query's top-k boundary (exactly, as two
scores of 0 where every head's ReLU is 0, or within float32 rounding) are taken by torch
and XLA by rules of their own. With 8 indexer heads one query of the export case had such a
pair (its logits then differed by up to 3); with 16, a score is 0 only where all 16 ReLUs
are, and no case here has one.

Tolerance: 1e-4 absolute on logits of O(1) (the issue's); measured differences are ~5e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the `interop` extra)"
)

from moe_jax.config import load_config  # noqa: E402
from moe_jax.interop import InteropError, config_from_hf, load_hf, save_hf  # noqa: E402
from moe_jax.summary.counts import param_counts  # noqa: E402
from tests.test_interop import (  # noqa: E402
    assert_same_params,
    greedy_ours,
    our_logits,
    random_model,
    write_config,
)

TOL = 1e-4
V, T, PAD, TOPK = 128, 20, 3, 6
BUFFER = "e_score_correction_bias"
COMMON = dict(
    vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, index_topk=TOPK, index_n_heads=16, index_head_dim=16,
    first_k_dense_replace=1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
SPECS = {
    "deepseek_v32": (
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        dict(
            num_hidden_layers=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                mscale_all_dim=1.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaConfig",
        dict(num_hidden_layers=5, index_topk_freq=2, index_skip_topk_offset=2),
    ),
}  # fmt: skip


def hf_model(name: str, seed: int = 0):
    model_cls, config_cls, kwargs = SPECS[name]
    config = getattr(transformers, config_cls)(**(COMMON | kwargs))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(1.0 + noise if pname.endswith("norm.weight") else noise)
        for bname, b in model.named_buffers():
            if bname.endswith(BUFFER):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory):
    """(name, the transformers model, our imported config and model)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name) / "hf"
    model = hf_model(name)
    model.save_pretrained(directory)
    cfg, ours = load_hf(directory)
    return name, model, cfg, ours


def _batch(seed: int):
    """Two rows of T tokens, the second left-padded by PAD (attention_mask 0 / segment 0)."""
    tokens = np.random.default_rng(seed).integers(0, V, (2, T)).astype(np.int64)
    mask = np.ones((2, T), np.int64)
    mask[1, :PAD] = 0
    return tokens, mask


def _hf_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask))
    return out.logits.numpy()


@nnx.jit
def _forward(model, tokens_BT, segments_BT):
    return model(tokens_BT, segments=segments_BT)[0]


def _ours(model, tokens, mask) -> np.ndarray:
    """Our logits, padding as segment 0 (attended by no real token, the indexer's included)."""
    return np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32)))


def test_imported_config_is_sparse_attention(case):
    name, model, cfg, _ = case
    a = cfg.attention
    assert (a.kind, a.rope_style, a.index_topk, a.index_n_heads, a.index_head_dim) == (
        "mla", "interleaved", TOPK, 16, 16
    )  # fmt: skip
    glm = name == "glm_moe_dsa"
    assert a.index_rope_style == ("interleaved" if glm else "half")
    own = [cfg.runs_indexer(i) for i in range(cfg.model.n_layers)]
    assert own == [t == "full" for t in getattr(model.config, "indexer_types", [])] or not glm
    assert own == ([True, True, False, True, False] if glm else [True] * 3)


def test_imported_logits_match_transformers(case):
    """One row left-padded (the indexer keeps to the real keys); the selection matters:
    transformers with every indexer keeping all keys gives other logits."""
    _, model, _, ours = case
    tokens, mask = _batch(0)
    want = _hf_logits(model, tokens, mask)
    real = mask.astype(bool)
    assert np.std(want[real]) > 0.3  # O(1) logits, so 1e-4 is tight
    np.testing.assert_allclose(_ours(ours, tokens, mask)[real], want[real], rtol=0, atol=TOL)
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    for m in indexers:
        m.index_topk = T
    try:
        dense = _hf_logits(model, tokens, mask)
    finally:
        for m in indexers:
            m.index_topk = TOPK
    assert np.abs(dense[real] - want[real]).max() > 1e-2


@pytest.mark.parametrize("case", ["glm_moe_dsa"], indirect=True)
def test_greedy_generation_matches_transformers(case):
    """Prefill then decode through our cache (the latent and the indexer's keys; a shared
    layer's selection passed on) against transformers' greedy `generate` with its cache.
    GLM-5's case only, the one with shared layers (each case compiles for ~15 s; the jitted
    sampler's decoding equals the full forward in tests/test_dsa.py)."""
    _, model, _, ours = case
    prompt, n_new = np.random.default_rng(1).integers(0, V, (2, 5)), 12
    with torch.no_grad():
        ref = model.generate(
            torch.from_numpy(prompt), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False
        ).numpy()[:, prompt.shape[1] :]
    np.testing.assert_array_equal(greedy_ours(ours, prompt, n_new), ref)


def test_round_trip_through_transformers(case, tmp_path):
    """Ours (every param redrawn) -> save_hf -> transformers loads it with the same logits
    -> load_hf gives the same config and bit-identical params."""
    _, model, cfg, _ = case
    fresh = random_model(cfg, seed=2)
    out = tmp_path / "export"
    assert save_hf(cfg, fresh, out, max_shard_bytes=100_000) == type(model).__name__
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(loaded).__name__ == type(model).__name__
    if hasattr(model.config, "indexer_types"):
        assert loaded.config.indexer_types == model.config.indexer_types
    x = np.random.default_rng(3).integers(0, V, (2, T))
    want = _hf_logits(loaded.eval(), x, np.ones_like(x))
    np.testing.assert_allclose(our_logits(fresh, x), want, rtol=0, atol=TOL)
    cfg2, back = load_hf(out)
    assert cfg2 == cfg
    assert_same_params(back, fresh)


# The shape configs and the release config.json keys their transformers config classes'
# defaults lack (DeepSeek-V3.2's YaRN and its MTP layer; GLM-5's MTP layer)
RELEASES = {
    "deepseek_v32": ("deepseek_v32.yaml", dict(
        num_nextn_predict_layers=1, max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
        ),
    )),
    "glm_moe_dsa": ("glm5.yaml", dict(num_nextn_predict_layers=1)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SPECS))
def test_shape_configs_are_the_releases_and_count_transformers_parameters(name, tmp_path):
    """configs/deepseek_v32.yaml and configs/glm5.yaml are the releases' config.json (the
    config classes' defaults, which are the releases' shapes, and `RELEASES`) imported, and
    count the parameters transformers' model of it has (built on the meta device: shapes
    only), its routers' correction biases (buffers there) included, the MTP layer apart
    (transformers builds none)."""
    model_cls, config_cls, _ = SPECS[name]
    path, release = RELEASES[name]
    config = getattr(transformers, config_cls)(**release)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    want = sum(p.numel() for p in model.parameters())
    want += sum(b.numel() for n, b in model.named_buffers() if n.endswith(BUFFER))
    assert want > 6.5e11  # the full size: 671.9B (V3's 671B + 0.85B of indexers), 744B
    shape = load_config(Path(__file__).resolve().parents[1] / "configs" / path)
    assert param_counts(shape)[0] == want
    imported = config_from_hf(tmp_path, base=shape)
    assert (imported.model, imported.attention, imported.moe) == (
        shape.model, shape.attention, shape.moe
    )  # fmt: skip


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4,
          "indexer_types": ["full", "shared", "full", "full"]},
         "indexer_types=['full', 'shared', 'full', 'full'] is not supported by moe_jax (a "
         "layer runs its own indexer every index_topk_freq-th layer from an offset)"),
        ({"architectures": ["DeepseekV32ForCausalLM"], "rope_interleave": False},
         "DeepseekV32ForCausalLM: rope_interleave=false is not supported"),
        ({"architectures": ["DeepseekV32ForCausalLM"], "q_lora_rank": None},
         "q_lora_rank=null is not supported by moe_jax (the indexer reads the query latent)"),
        ({"architectures": ["DeepseekV32ForCausalLM"], "num_hidden_layers": 4,
          "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
         "mlp_layer_types=['dense', 'sparse', 'dense', 'sparse'] is not supported"),
        ({"architectures": ["GlmMoeDsaForCausalLM"], "index_head_dim": 32},
         "attention.index_head_dim (32) must be at least attention.qk_rope_head_dim (64)"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(tmp_path, config, message):
    write_config(tmp_path, **config)
    with pytest.raises(InteropError, match="^[^\n]*$") as err:
        config_from_hf(tmp_path)
    assert message in str(err.value)


def test_export_picks_the_sparse_family_or_refuses_by_name(case, tmp_path):
    """A DSA config is written as its family (DeepSeek-V3 refuses it by name); GLM's shared
    selections have no place in DeepSeek-V3.2; config.json carries the indexer's keys."""
    name, model, cfg, ours = case
    for arch, message in [
        ("DeepseekV3ForCausalLM", "DeepSeek sparse attention (attention.index_topk)"),
        ("DeepseekV32ForCausalLM" if name == "glm_moe_dsa" else "GlmMoeDsaForCausalLM",
         "index_topk_freq 1" if name == "glm_moe_dsa" else "index_rope_style must be"),
    ]:  # fmt: skip
        with pytest.raises(InteropError, match="^[^\n]*$") as err:
            save_hf(cfg, ours, tmp_path / arch, architecture=arch)
        assert message in str(err.value)
    assert save_hf(cfg, ours, tmp_path / "out") == type(model).__name__
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    keys = ("index_topk", "index_n_heads", "index_head_dim", "q_lora_rank")
    assert [written[k] for k in keys] == [getattr(model.config, k) for k in keys]
    assert "rope_interleave" not in written
