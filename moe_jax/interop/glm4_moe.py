"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`).

Attention (transformers' Glm4MoeAttention): grouped-query attention with `head_dim` of its own,
q/k/v biases where `attention_bias` (never on `o_proj`), a learned RMSNorm on each head's q and
k before RoPE where `use_qk_norm` (our `qk_norm=rms`), and partial rotary: only the first
int(head_dim x `partial_rotary_factor`) dims of each head are rotated, rotate-half style
within them (`rope_style=half`), the rest pass unrotated. The factor is read from the RoPE
parameters, else the top-level key, else 0.5 (the config class's default, so an export
always writes it). The MoE is DeepSeek-V3's (`deepseek.py`): sigmoid router with the
correction bias, groups, routed scaling, shared experts, `first_k_dense_replace` dense layers;
and so are its multi-token prediction layers (`num_nextn_predict_layers`, layer
`model.layers.{num_hidden_layers + k - 1}` for depth k: `enorm`, `hnorm`, `eh_proj`, this
family's decoder layer, `shared_head.norm`, and the embedding / head copies), imported and
exported as there.
"""

from __future__ import annotations

import dataclasses

from moe_jax.config import Config
from moe_jax.interop.checks import Unsupported, has_nope_layers
from moe_jax.interop.common import (
    Family,
    HFConfig,
    TensorMap,
    attention_from_hf,
    attention_maps,
    check_hf_basics,
    common_hf_config,
    model_from_hf,
)
from moe_jax.interop.deepseek import (
    check_deepseek_moe,
    deepseek_ffn_maps,
    deepseek_moe_to_hf,
    moe_from_deepseek,
    mtp_depth_from_hf,
    mtp_maps,
)

ARCH = "Glm4MoeForCausalLM"
PARTIAL_ROTARY_DEFAULT = 0.5  # Glm4MoeConfig's, where config.json gives none

# transformers' Glm4MoeConfig defaults for every key read below (transformers 5.23).
DEFAULTS = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": None,  # not a Glm4MoeConfig field: hidden_size // num_attention_heads
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    "num_nextn_predict_layers": 1,
}


def to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    attention = attention_from_hf(
        hf,
        10000.0,
        partial_default=PARTIAL_ROTARY_DEFAULT,
        rope_style="half",
        qk_norm="rms" if hf["use_qk_norm"] else "none",
        qkv_bias=bool(hf["attention_bias"]),
        o_bias=False,
    )
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, hf["intermediate_size"], mtp_depth_from_hf(hf)),
        attention=attention,
        moe=moe_from_deepseek(hf, base),
    )


def from_config(cfg: Config) -> dict:
    a = cfg.attention
    u = Unsupported(ARCH)
    u.check(a.kind == "gqa", "attention.kind must be 'gqa'")
    u.check(a.rope_style == "half", "attention.rope_style must be 'half'")
    u.check(a.qk_norm in ("none", "rms"), "attention.qk_norm must be 'rms' or 'none'")
    u.check(not has_nope_layers(cfg), "NoPE layers (attention.nope_interval) are not supported")
    u.check(a.chunk_size == 0, "chunked attention (attention.chunk_size) is not supported")
    u.check(a.sliding_window == 0, "sliding-window attention is not supported")
    u.check(not a.o_bias, "an output projection bias (attention.o_bias) is not supported")
    check_deepseek_moe(cfg, u)
    u.raise_if_any()
    hf = common_hf_config(cfg, ARCH, "glm4_moe") | deepseek_moe_to_hf(cfg)
    hf["rope_parameters"] |= {"partial_rotary_factor": a.partial_rotary_factor}
    return hf | {"attention_bias": a.qkv_bias, "use_qk_norm": a.qk_norm == "rms"}


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    return attention_maps(cfg) + deepseek_ffn_maps(cfg, layer)


FAMILY = Family(
    ARCH, "glm4_moe", DEFAULTS, to_config, from_config, layer_maps, mtp_maps(layer_maps)
)
