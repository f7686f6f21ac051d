"""Mixtral (`MixtralForCausalLM`): every layer MoE, softmax top-k renormalised over the k.

Checkpoints store the router as `block_sparse_moe.gate` and one `w1` (gate), `w3` (up),
`w2` (down) linear per expert; the fused transformers>=5 layout (`mlp.gate`,
`mlp.experts.gate_up_proj`) is accepted on import too.
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
    linear,
    model_from_hf,
    moe_from_hf,
    per_expert_swiglu,
)

ARCH = "MixtralForCausalLM"

# transformers' MixtralConfig defaults for every key read below.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_aux_loss_coef": 0.001,
}


def to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    F = hf["intermediate_size"]
    moe = moe_from_hf(
        hf,
        base,
        interleave_step=1,
        n_experts=hf.get("num_local_experts", "num_experts"),
        expert_hidden=F,
        score="softmax",
        renormalize=True,
        route_scale="output",
        shared_expert_hidden=0,
    )
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, ffn_hidden=F),  # unused: every layer is MoE
        attention=attention_from_hf(
            hf, 1e6, rope_style="half", sliding_window=hf["sliding_window"] or 0
        ),
        moe=moe,
    )


def from_config(cfg: Config) -> dict:
    a, e = cfg.attention, cfg.moe
    u = Unsupported(ARCH)
    check_llama_style(cfg, u, qk_norm="none")
    u.check(not a.qkv_bias and not a.o_bias, "attention biases are not supported")
    check_moe_softmax(cfg, u)
    u.check(e.interleave_step == 1, "every layer must be MoE (moe.interleave_step must be 1)")
    u.check(e.renormalize, "top-k weights are always renormalised (moe.renormalize must be true)")
    u.raise_if_any()
    return common_hf_config(cfg, ARCH, "mixtral") | {
        "intermediate_size": e.expert_hidden,
        "num_local_experts": e.n_experts,
        "num_experts_per_tok": e.top_k,
        "sliding_window": a.sliding_window or None,
        "router_aux_loss_coef": aux_coef(cfg),
    }


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    experts = per_expert_swiglu(
        "block_sparse_moe.experts.{}.w1.weight",
        "block_sparse_moe.experts.{}.w3.weight",
        "block_sparse_moe.experts.{}.w2.weight",
        fused="mlp.experts",
        n_experts=cfg.moe.n_experts,
    )
    router = linear("ffn.router", "block_sparse_moe.gate.weight", alt="mlp.gate.weight")
    return attention_maps(cfg) + [router, experts]


FAMILY = Family(ARCH, "mixtral", DEFAULTS, to_config, from_config, layer_maps)
