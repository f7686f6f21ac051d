"""Dense Llama (`LlamaForCausalLM`, Llama 2/3): our decoder with `moe.n_experts = 0`."""

from __future__ import annotations

import dataclasses

from moe_jax.config import Config
from moe_jax.interop.checks import Unsupported, check_llama_style
from moe_jax.interop.common import (
    Family,
    HFConfig,
    TensorMap,
    attention_from_hf,
    attention_maps,
    check_hf_basics,
    common_hf_config,
    dense_moe,
    model_from_hf,
    swiglu,
)

ARCH = "LlamaForCausalLM"

# transformers' LlamaConfig defaults for every key read below.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


def to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    hf.require(not hf["mlp_bias"], "mlp_bias=true", "MLPs have no biases here")
    bias = bool(hf["attention_bias"])
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, ffn_hidden=hf["intermediate_size"]),
        attention=attention_from_hf(hf, 10000.0, rope_style="half", qkv_bias=bias, o_bias=bias),
        moe=dense_moe(base),
    )


def from_config(cfg: Config) -> dict:
    a = cfg.attention
    u = Unsupported(ARCH)
    u.check(cfg.moe.n_experts == 0, "it has no MoE layers (moe.n_experts must be 0)")
    check_llama_style(cfg, u, qk_norm="none")
    u.check(a.sliding_window == 0, "sliding-window attention is not supported")
    u.check(a.qkv_bias == a.o_bias, "attention biases must be all on or all off")
    u.raise_if_any()
    return common_hf_config(cfg, ARCH, "llama") | {
        "intermediate_size": cfg.model.ffn_hidden,
        "attention_bias": a.qkv_bias,
        "mlp_bias": False,
    }


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    return attention_maps(cfg) + swiglu("ffn", "mlp")


FAMILY = Family(ARCH, "llama", DEFAULTS, to_config, from_config, layer_maps)
