"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's
latent attention and MoE (`deepseek.py`) with DeepSeek Sparse Attention
(`attention.index_topk`, moe_jax/model/sparse_attention.py).

Each layer's `self_attn.indexer` holds `wq_b` [Hi Di, q_lora_rank] (from the query latent),
`wk` [Di, D] (our `w_key`), the key's LayerNorm `k_norm` (weight and bias) and
`weights_proj` [Hi, D]: our `attn.indexer.*`. `index_topk`, `index_n_heads`,
`index_head_dim` are ours by name. The two differ in:
- the indexer's RoPE: rotate-half in DeepSeek-V3.2, interleaved pairs in GLM-5
  (`attention.index_rope_style`); the main attention's is interleaved in both (transformers'
  classes have no `rope_interleave`: an import refuses it false);
- GLM-5's sharing: `indexer_types` ("full" | "shared" per layer; transformers derives it
  from `index_topk_freq` / `index_skip_topk_offset` or `index_topk_pattern`) is read as the
  freq / offset pair that gives it (`attention.index_topk_freq`, `index_skip_topk_offset`);
  another pattern is refused. A shared layer has no indexer tensors. An export writes the
  list. DeepSeek-V3.2 always runs every layer's indexer.
Both take the query LoRA (`q_lora_rank`) as given: transformers' attention always has it.
Multi-token prediction layers (`num_nextn_predict_layers`, which transformers' classes do not
name, so a missing key means none) travel as DeepSeek-V3's, with their indexer.
"""

from __future__ import annotations

import dataclasses

from moe_jax.config import Config
from moe_jax.interop import deepseek
from moe_jax.interop.checks import Unsupported
from moe_jax.interop.common import Family, HFConfig, TensorMap, linear, same

V32_ARCH, GLM5_ARCH = "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"
FULL, SHARED = "full", "shared"

# transformers' DeepseekV32Config / GlmMoeDsaConfig defaults for every key read here
# (transformers 5.23); the others as DeepseekV3Config's (`deepseek.DEFAULTS`).
V32_DEFAULTS = deepseek.DEFAULTS | {
    "max_position_embeddings": 163840,
    "rope_interleave": True,  # not a field of theirs: always interleaved
    "num_nextn_predict_layers": 0,  # not a field of theirs either
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "mlp_layer_types": None,
    "mlp_bias": False,
    "indexer_types": None,
    "index_topk_freq": 1,
    "index_skip_topk_offset": 2,
    "index_topk_pattern": None,
}
GLM5_DEFAULTS = V32_DEFAULTS | {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "index_n_heads": 32,
}


def _own(layer: int, freq: int, offset: int) -> bool:
    """transformers' rule: layer `layer` runs its own indexer (Config.runs_indexer's too)."""
    return max(layer - offset + 1, 0) % freq == 0


def _indexer_types(hf: HFConfig) -> list[str]:
    """config.json's per-layer indexer modes, as GlmMoeDsaConfig derives them."""
    n = hf["num_hidden_layers"]
    if hf["indexer_types"] is not None:
        return list(hf["indexer_types"])
    pattern = hf["index_topk_pattern"]
    if pattern is not None:
        return [{"F": FULL, "S": SHARED}.get(c, c) for c in pattern]
    freq, offset = max(hf["index_topk_freq"] or 1, 1), hf["index_skip_topk_offset"]
    return [FULL if _own(i, freq, offset) else SHARED for i in range(n)]


def _sharing(hf: HFConfig) -> tuple[int, int]:
    """(index_topk_freq, index_skip_topk_offset) giving config.json's indexer_types (GLM-5):
    the ones config.json names where they do, else the least that do."""
    n, types = hf["num_hidden_layers"], _indexer_types(hf)
    hf.require(
        len(types) == n and set(types) <= {FULL, SHARED},
        f"indexer_types={types}",
        f"one of '{FULL}' or '{SHARED}' per layer",
    )
    want = [t == FULL for t in types]
    named = (max(hf["index_topk_freq"] or 1, 1), hf["index_skip_topk_offset"])
    pairs = [named] + [(f, o) for f in range(1, n + 1) for o in range(n + 2)]
    for freq, offset in pairs:
        if [_own(i, freq, offset) for i in range(n)] == want:
            return freq, offset
    raise hf.refuse(
        f"indexer_types={types}",
        "a layer runs its own indexer every index_topk_freq-th layer from an offset",
    )


def _to_config(hf: HFConfig, base: Config, glm: bool) -> Config:
    hf.require(hf["rope_interleave"] is not False, "rope_interleave=false", "always interleaved")
    hf.require(not hf["mlp_bias"], "mlp_bias=true", "the MLPs have no biases")
    hf.require(bool(hf["q_lora_rank"]), "q_lora_rank=null", "the indexer reads the query latent")
    cfg = deepseek.to_config(hf, base)
    n, k = cfg.model.n_layers, cfg.moe.first_dense_layers
    mlp = hf["mlp_layer_types"]
    hf.require(
        mlp is None or list(mlp) == ["dense"] * k + ["sparse"] * (n - k),
        f"mlp_layer_types={mlp}",
        "the first first_k_dense_replace layers dense, the rest MoE",
    )
    freq, offset = _sharing(hf) if glm else (1, 2)
    attention = dataclasses.replace(
        cfg.attention,
        rope_style="interleaved",
        index_topk=hf["index_topk"],
        index_n_heads=hf["index_n_heads"],
        index_head_dim=hf["index_head_dim"],
        index_rope_style="interleaved" if glm else "half",
        index_topk_freq=freq,
        index_skip_topk_offset=offset,
    )
    return dataclasses.replace(cfg, attention=attention)


def _from_config(cfg: Config, glm: bool) -> dict:
    a, n = cfg.attention, cfg.model.n_layers
    arch = GLM5_ARCH if glm else V32_ARCH
    u = Unsupported(arch)
    u.check(a.kind == "mla" and a.q_lora_rank > 0, "latent attention with a query LoRA")
    u.check(a.rope_style == "interleaved", "attention.rope_style must be 'interleaved'")
    u.check(a.index_topk > 0, "DeepSeek sparse attention (attention.index_topk > 0)")
    style = "interleaved" if glm else "half"
    u.check(a.index_rope_style == style, f"attention.index_rope_style must be '{style}'")
    if not glm:
        u.check(a.index_topk_freq == 1, "every layer runs its own indexer (index_topk_freq 1)")
    deepseek.check_deepseek_moe(cfg, u)
    u.raise_if_any()
    hf = deepseek.dense_mla_hf_config(cfg)
    hf.pop("rope_interleave")  # no field of theirs
    hf |= {
        "architectures": [arch],
        "model_type": "glm_moe_dsa" if glm else "deepseek_v32",
        "index_topk": a.index_topk,
        "index_n_heads": a.index_n_heads,
        "index_head_dim": a.index_head_dim,
    }
    if glm:
        hf["indexer_types"] = [FULL if cfg.runs_indexer(i) else SHARED for i in range(n)]
    return hf


def _indexer_maps() -> list[TensorMap]:
    own, hf = "attn.indexer.", "self_attn.indexer."
    return [
        linear(f"{own}wq_b", f"{hf}wq_b.weight"),
        linear(f"{own}w_key", f"{hf}wk.weight"),
        same(f"{own}k_norm_scale", f"{hf}k_norm.weight"),
        same(f"{own}k_norm_bias", f"{hf}k_norm.bias"),
        linear(f"{own}weights_proj", f"{hf}weights_proj.weight"),
    ]


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    indexer = _indexer_maps() if cfg.runs_indexer(layer) else []
    return deepseek.mla_maps(cfg) + indexer + deepseek.deepseek_ffn_maps(cfg, layer)


V32 = Family(
    V32_ARCH,
    "deepseek_v32",
    V32_DEFAULTS,
    lambda hf, base: _to_config(hf, base, glm=False),
    lambda cfg: _from_config(cfg, glm=False),
    layer_maps,
    deepseek.mtp_maps(layer_maps),
)
GLM5 = Family(
    GLM5_ARCH,
    "glm_moe_dsa",
    GLM5_DEFAULTS,
    lambda hf, base: _to_config(hf, base, glm=True),
    lambda cfg: _from_config(cfg, glm=True),
    layer_maps,
    deepseek.mtp_maps(layer_maps),
)
