"""Qwen3 (`Qwen3ForCausalLM`, dense) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

Both: rotate-half RoPE, learned RMS QK-norm on the head dim before RoPE (`qk_norm=rms`), one
`attention_bias` flag for q/k/v/o. Qwen3-MoE routes with softmax over all experts, top-k,
renormalised over the k when `norm_topk_prob`; MoE on every `decoder_sparse_step`-th layer
except `mlp_only_layers` (dense layers use `intermediate_size`, experts `moe_intermediate_size`).
"""

from __future__ import annotations

import dataclasses

from moe_jax.config import Config
from moe_jax.interop.checks import Unsupported, check_llama_style, check_moe_softmax
from moe_jax.interop.common import (
    Family,
    HFConfig,
    TensorMap,
    attention_from_hf,
    attention_maps,
    aux_coef,
    check_hf_basics,
    common_hf_config,
    dense_moe,
    every_nth,
    linear,
    model_from_hf,
    moe_from_hf,
    per_expert_swiglu,
    swiglu,
)

DENSE_ARCH = "Qwen3ForCausalLM"
MOE_ARCH = "Qwen3MoeForCausalLM"

# transformers' Qwen3Config / Qwen3MoeConfig defaults for every key read below.
_SHARED_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
}
DENSE_DEFAULTS = _SHARED_DEFAULTS | {
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_window_layers": 28,
    "layer_types": None,
}
MOE_DEFAULTS = _SHARED_DEFAULTS | {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": None,  # not a Qwen3MoeConfig field: hidden_size // num_attention_heads
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_local_experts": 128,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": None,
}


def _attention(hf: HFConfig, sliding_window: int):
    bias = bool(hf["attention_bias"])
    return attention_from_hf(
        hf,
        10000.0,
        rope_style="half",
        qk_norm="rms",
        sliding_window=sliding_window,
        qkv_bias=bias,
        o_bias=bias,
    )


def _window(cfg: Config) -> dict:
    w = cfg.attention.sliding_window
    return {"use_sliding_window": w > 0, "sliding_window": w or None}


def _check_attention(cfg: Config, u: Unsupported) -> None:
    check_llama_style(cfg, u, qk_norm="rms")
    a = cfg.attention
    u.check(a.qkv_bias == a.o_bias, "attention biases must be all on or all off")


# ----------------------------------------------------------------------------- Qwen3 (dense)


def dense_to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    n = hf["num_hidden_layers"]
    window = hf["sliding_window"] if hf["use_sliding_window"] else None
    first_sliding = n if window is None else hf["max_window_layers"]
    layer_types = hf["layer_types"] or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(n)
    ]
    windows = {window if t == "sliding_attention" else None for t in layer_types[:n]}
    hf.require(len(windows) == 1, f"layer_types={layer_types}", "one attention kind for all layers")
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, ffn_hidden=hf["intermediate_size"]),
        attention=_attention(hf, windows.pop() or 0),
        moe=dense_moe(base),
    )


def dense_from_config(cfg: Config) -> dict:
    u = Unsupported(DENSE_ARCH)
    u.check(cfg.moe.n_experts == 0, "it has no MoE layers (moe.n_experts must be 0)")
    _check_attention(cfg, u)
    u.raise_if_any()
    n, window = cfg.model.n_layers, cfg.attention.sliding_window
    return (
        common_hf_config(cfg, DENSE_ARCH, "qwen3")
        | _window(cfg)
        | {
            "intermediate_size": cfg.model.ffn_hidden,
            "attention_bias": cfg.attention.qkv_bias,
            "max_window_layers": 0 if window else n,
            "layer_types": ["sliding_attention" if window else "full_attention"] * n,
        }
    )


def dense_layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    return attention_maps(cfg) + swiglu("ffn", "mlp")


# ----------------------------------------------------------------------------- Qwen3-MoE


def moe_to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    n_experts = hf.get("num_local_experts", "num_experts")
    mlp_only = set(hf["mlp_only_layers"] or [])
    step = hf["decoder_sparse_step"]
    is_moe = [
        i not in mlp_only and n_experts > 0 and (i + 1) % step == 0
        for i in range(hf["num_hidden_layers"])
    ]
    interleave = every_nth(is_moe, "MoE layers (decoder_sparse_step, mlp_only_layers)", hf)
    moe = moe_from_hf(
        hf,
        base,
        interleave,
        n_experts=n_experts,
        expert_hidden=hf["moe_intermediate_size"],
        score="softmax",
        renormalize=bool(hf["norm_topk_prob"]),
        route_scale="output",
        shared_expert_hidden=0,
    )
    window = hf["sliding_window"] if hf["use_sliding_window"] else None
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, ffn_hidden=hf["intermediate_size"]),
        attention=_attention(hf, window or 0),
        moe=moe,
    )


def moe_from_config(cfg: Config) -> dict:
    u = Unsupported(MOE_ARCH)
    _check_attention(cfg, u)
    check_moe_softmax(cfg, u)
    u.raise_if_any()
    e = cfg.moe
    return (
        common_hf_config(cfg, MOE_ARCH, "qwen3_moe")
        | _window(cfg)
        | {
            "intermediate_size": cfg.model.ffn_hidden,
            "attention_bias": cfg.attention.qkv_bias,
            "num_experts": e.n_experts,
            "num_experts_per_tok": e.top_k,
            "moe_intermediate_size": e.expert_hidden,
            "decoder_sparse_step": e.interleave_step,
            "mlp_only_layers": [],
            "norm_topk_prob": e.renormalize,
            "router_aux_loss_coef": aux_coef(cfg),
        }
    )


def moe_layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    if not cfg.is_moe(layer):
        return attention_maps(cfg) + swiglu("ffn", "mlp")
    experts = per_expert_swiglu(
        "mlp.experts.{}.gate_proj.weight",
        "mlp.experts.{}.up_proj.weight",
        "mlp.experts.{}.down_proj.weight",
        fused="mlp.experts",
        n_experts=cfg.moe.n_experts,
    )
    return attention_maps(cfg) + [linear("ffn.router", "mlp.gate.weight"), experts]


DENSE = Family(
    DENSE_ARCH, "qwen3", DENSE_DEFAULTS, dense_to_config, dense_from_config, dense_layer_maps
)
MOE = Family(MOE_ARCH, "qwen3_moe", MOE_DEFAULTS, moe_to_config, moe_from_config, moe_layer_maps)
