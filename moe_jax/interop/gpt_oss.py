"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b).

Rotate-half RoPE with YaRN scaling; q/k/v/o biases (`attention_bias`); a learned sink logit
per head (`self_attn.sinks`, our `attention.sinks`); `layer_types` alternating
sliding-window and full attention (our `sliding_window` + `full_attention_interval`). Every
layer MoE: a router with a bias, top-k on the logits then softmax over the k (our softmax over
all experts renormalised over the k: the same weights); experts with biases and the clamped
SwiGLU (`swiglu_limit`, `swiglu_alpha`; `moe.swiglu_*`), gate and up interleaved in
`gate_up_proj [E, D, 2F]` (gate = [..., 0::2]), `down_proj [E, F, D]`.

The released checkpoints store the experts' weights in MXFP4 (`*_blocks`, `*_scales`, with a
`quantization_config` of quant_method mxfp4): they are dequantised on import exactly as
transformers does (`interop.mxfp4`). Export writes them unquantised.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from moe_jax.config import Config
from moe_jax.interop import mxfp4
from moe_jax.interop.checks import Unsupported, check_llama_style, check_no_deepseek_routing
from moe_jax.interop.common import (
    Family,
    HFConfig,
    HFTensors,
    Source,
    TensorMap,
    attention_from_hf,
    attention_maps,
    aux_coef,
    check_hf_basics,
    common_hf_config,
    every_nth,
    linear,
    model_from_hf,
    moe_from_hf,
    same,
)
from moe_jax.interop.finite import checked_finite
from moe_jax.interop.lazy import Deferred

ARCH = "GptOssForCausalLM"
QUANT_METHOD = "mxfp4"  # the one quantization_config an import takes (and dequantises)

# transformers' GptOssConfig defaults for every key read below (transformers 5.23).
DEFAULTS = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": None,  # None: sliding on even layers, full on odd ones
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001,
    "rope_theta": 150000.0,
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    n = hf["num_hidden_layers"]
    types = hf["layer_types"] or [LAYER_TYPES[i % 2] for i in range(n)]
    unknown = sorted(set(types[:n]) - set(LAYER_TYPES))
    hf.require(not unknown, f"layer_types {unknown}", "only sliding and full attention exist")
    full = [t == "full_attention" for t in types[:n]]
    window = 0 if all(full) else hf["sliding_window"] or 0
    interval = 0 if all(full) else every_nth(full, "full-attention layers (layer_types)", hf)
    bias = bool(hf["attention_bias"])
    attention = attention_from_hf(
        hf,
        DEFAULTS["rope_theta"],
        rope_style="half",
        qk_norm="none",
        sliding_window=window,
        full_attention_interval=interval,
        qkv_bias=bias,
        o_bias=bias,
        sinks=True,
    )
    moe = moe_from_hf(
        hf,
        base,
        1,
        n_experts=hf["num_local_experts"],
        expert_hidden=hf["intermediate_size"],
        score="softmax",
        renormalize=True,
        route_scale="output",
        shared_expert_hidden=0,
    )
    moe = dataclasses.replace(
        moe,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf["swiglu_limit"]),
        swiglu_alpha=float(hf["swiglu_alpha"]),
    )
    hf.require(moe.swiglu_limit > 0, f"swiglu_limit={hf['swiglu_limit']}", "a clamp is needed")
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, ffn_hidden=hf["intermediate_size"]),
        attention=attention,
        moe=moe,
    )


def from_config(cfg: Config) -> dict:
    u = Unsupported(ARCH)
    a, e = cfg.attention, cfg.moe
    check_llama_style(cfg, u, qk_norm="none", sinks=True, full_attention_interval=True)
    u.check(a.qkv_bias and a.o_bias, "attention biases (qkv_bias, o_bias) must be on")
    u.check(a.sinks, "attention.sinks must be true")
    u.check(e.n_experts > 0 and e.interleave_step == 1, "every layer must be MoE")
    u.check(e.score == "softmax" and e.renormalize, "routing must be softmax, renormalised")
    u.check(e.route_scale == "output", "moe.route_scale must be 'output'")
    u.check(e.shared_expert_hidden == 0, "a shared expert is not supported")
    u.check(e.router_bias and e.expert_bias, "router and expert biases must be on")
    u.check(e.swiglu_limit > 0, "the experts must be clamped (moe.swiglu_limit > 0)")
    check_no_deepseek_routing(cfg, u)
    u.raise_if_any()
    n = cfg.model.n_layers
    return common_hf_config(cfg, ARCH, "gpt_oss") | {
        "intermediate_size": e.expert_hidden,
        "num_local_experts": e.n_experts,
        "num_experts_per_tok": e.top_k,
        "sliding_window": a.sliding_window or None,
        "layer_types": [LAYER_TYPES[1 - cfg.uses_window(i)] for i in range(n)],
        "attention_bias": True,
        "swiglu_limit": e.swiglu_limit,
        "swiglu_alpha": e.swiglu_alpha,
        "router_aux_loss_coef": aux_coef(cfg),
    }


def _experts(hf: str = "mlp.experts") -> TensorMap:
    """Our six expert tensors <-> gate_up_proj [E, D, 2F] (gate/up interleaved) with its bias
    [E, 2F], down_proj [E, F, D] and its bias [E, D]; on import the MXFP4 form too."""
    names = ("w_gate", "w_up", "w_down", "gate_bias", "up_bias", "down_bias")
    ours = tuple(f"ffn.experts.{n}" for n in names)

    def load(src: Source, gate, up, down, gate_bias, up_bias, down_bias) -> None:
        E, D, F = gate.shape
        if src.has(f"{hf}.gate_up_proj_blocks"):
            gate_up = _dequantized(src, f"{hf}.gate_up_proj", (E, 2 * F, D // mxfp4.BLOCK))
            down[...] = _dequantized(src, f"{hf}.down_proj", (E, D, F // mxfp4.BLOCK))
        else:
            gate_up = src(f"{hf}.gate_up_proj", (E, D, 2 * F))
            down[...] = src(f"{hf}.down_proj", (E, F, D))
        gate[...], up[...] = gate_up[..., 0::2], gate_up[..., 1::2]
        gate_up_bias = src(f"{hf}.gate_up_proj_bias", (E, 2 * F))
        gate_bias[...], up_bias[...] = gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]
        down_bias[...] = src(f"{hf}.down_proj_bias", (E, D))

    def save(gate, up, down, gate_bias, up_bias, down_bias) -> HFTensors:
        yield f"{hf}.gate_up_proj", _interleave(gate, up)
        yield f"{hf}.gate_up_proj_bias", _interleave(gate_bias, up_bias)
        yield f"{hf}.down_proj", down
        yield f"{hf}.down_proj_bias", down_bias

    return TensorMap(ours, load, save)


def _dequantized(src: Source, name: str, scales_shape: tuple[int, ...]) -> Deferred:
    """The HF parameter `[E, G*32, R]` of MXFP4 `name`, decoded (in bf16, as transformers
    does) only where it is used: the experts and rows a converter's window holds; checked
    finite as it is decoded (`src.finite`: scale 255, or one that overflows bf16, gives inf),
    its scales named."""
    blocks = src.packed(f"{name}_blocks", (*scales_shape, mxfp4.BLOCK // 2))
    scales = src.packed(f"{name}_scales", scales_shape)
    E, R, G = scales_shape

    def compute(index):
        experts, k, rows = index
        return mxfp4.dequantize(blocks[experts, rows], scales[experts, rows])[:, k]

    decoded = Deferred((E, G * mxfp4.BLOCK, R), compute, ml_dtypes.bfloat16)
    if not src.finite:
        return decoded
    return checked_finite(decoded, src.prefix + f"{name}_scales", src.reader)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[..., F] and [..., F] -> [..., 2F] with gate at the even and up at the odd places."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    return attention_maps(cfg) + [
        same("attn.sinks", "self_attn.sinks"),
        linear("ffn.router", "mlp.router.weight"),
        same("ffn.router_bias", "mlp.router.bias"),
        _experts(),
    ]


FAMILY = Family(ARCH, "gpt_oss", DEFAULTS, to_config, from_config, layer_maps)
