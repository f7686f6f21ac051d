"""Llama 4 text (`Llama4ForCausalLM` / `Llama4TextConfig`; the text part of
`Llama4ForConditionalGeneration` checkpoints is read from under `language_model.`).

Semantics matched (transformers' modeling_llama4.py):
- RoPE rotates interleaved pairs; `no_rope_layers[i] == 0` marks NoPE layers (default every
  `no_rope_layer_interval`-th); NoPE layers attend globally with attention-temperature tuning
  (`attn_temperature_tuning`, `floor_scale`, `attn_scale`), RoPE layers attend within
  `attention_chunk_size` chunks (`layer_types`: chunked on RoPE layers, full on NoPE layers;
  all "full_attention" means no chunking).
- `use_qk_norm`: weightless RMS norm (eps `rms_norm_eps`) after RoPE on RoPE layers only.
- Router: top-k on raw logits, sigmoid of the picked logit scales the expert's input, the
  outputs are summed (no renormalisation); a shared expert of width `intermediate_size` is
  always added. MoE on `moe_layers` (default every `interleave_moe_layer_step`-th layer);
  dense layers are SwiGLU of width `intermediate_size_mlp`.
- Experts are fused: `gate_up_proj [E, D, 2F]` (gate first), `down_proj [E, F, D]`, both
  input-by-output (unlike nn.Linear).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_jax.config import Config
from moe_jax.interop.checks import (
    Unsupported,
    check_full_rotary,
    check_no_deepseek_routing,
    check_no_gpt_oss_parts,
)
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
    swiglu,
)

ARCH = "Llama4ForCausalLM"
MULTIMODAL_ARCH = "Llama4ForConditionalGeneration"  # import only: its text_config and weights
MULTIMODAL_PREFIX = "language_model."

# transformers' Llama4TextConfig defaults for every key read below.
DEFAULTS = {
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "moe_layers": None,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "router_aux_loss_coef": 0.001,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "layer_types": None,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}


def to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    n = hf["num_hidden_layers"]
    step = hf["interleave_moe_layer_step"]
    moe_layers = hf["moe_layers"]
    if moe_layers is None:
        moe_layers = range(step - 1, n, step)
    interleave = every_nth([i in set(moe_layers) for i in range(n)], "MoE layers", hf)

    interval = hf["no_rope_layer_interval"]
    rope_flags = hf["no_rope_layers"] or [int((i + 1) % interval != 0) for i in range(n)]
    hf.require(len(rope_flags) >= n, f"no_rope_layers={rope_flags}", "one entry per layer")
    nope_interval = every_nth([not rope_flags[i] for i in range(n)], "NoPE layers", hf)
    chunked = ["chunked_attention" if rope_flags[i] else "full_attention" for i in range(n)]
    layer_types = list(hf["layer_types"] or chunked)[:n]
    hf.require(
        layer_types in (chunked, ["full_attention"] * n),
        f"layer_types={layer_types}",
        "chunked attention must be on exactly the RoPE layers, or on none",
    )
    chunk_size = (hf["attention_chunk_size"] or 0) if layer_types == chunked else 0
    F = hf["intermediate_size"]
    moe = moe_from_hf(
        hf,
        base,
        interleave,
        n_experts=hf["num_local_experts"],
        expert_hidden=F,
        score="sigmoid",
        renormalize=False,
        route_scale="input",
        shared_expert_hidden=F,
    )
    bias = bool(hf["attention_bias"])
    attention = attention_from_hf(
        hf,
        500000.0,
        rope_style="interleaved",
        qk_norm="l2" if hf["use_qk_norm"] else "none",
        nope_interval=nope_interval,
        temperature_tuning=bool(hf["attn_temperature_tuning"]),
        floor_scale=float(hf["floor_scale"]),
        attn_scale=float(hf["attn_scale"]),
        chunk_size=chunk_size,
        qkv_bias=bias,
        o_bias=bias,
    )
    return dataclasses.replace(
        base,
        model=model_from_hf(hf, base, ffn_hidden=hf["intermediate_size_mlp"]),
        attention=attention,
        moe=moe,
    )


def from_config(cfg: Config) -> dict:
    m, a, e = cfg.model, cfg.attention, cfg.moe
    u = Unsupported(ARCH)
    u.check(a.rope_style == "interleaved", "attention.rope_style must be 'interleaved'")
    u.check(a.qk_norm in ("none", "l2"), "attention.qk_norm must be 'l2' or 'none'")
    u.check(a.sliding_window == 0, "sliding-window attention is not supported")
    check_no_gpt_oss_parts(cfg, u)
    check_full_rotary(cfg, u)
    u.check(a.qkv_bias == a.o_bias, "attention biases must be all on or all off")
    u.check(float(a.floor_scale).is_integer(), "attention.floor_scale must be a whole number")
    if e.n_experts > 0:
        u.check(e.score == "sigmoid", "moe.score must be 'sigmoid'")
        u.check(e.route_scale == "input", "moe.route_scale must be 'input'")
        u.check(not e.renormalize, "moe.renormalize must be false")
        u.check(
            e.shared_expert_hidden == e.expert_hidden,
            "the shared expert must be as wide as a routed expert",
        )
        u.check(not e.router_bias and not e.expert_bias, "router/expert biases are not supported")
        check_no_deepseek_routing(cfg, u)
    u.raise_if_any()
    n = m.n_layers
    rope = [cfg.uses_rope(i) for i in range(n)]
    chunked = a.chunk_size > 0
    return common_hf_config(cfg, ARCH, "llama4_text") | {
        "intermediate_size": e.expert_hidden if e.n_experts else m.ffn_hidden,
        "intermediate_size_mlp": m.ffn_hidden,
        "num_local_experts": e.n_experts,
        "num_experts_per_tok": e.top_k,
        "interleave_moe_layer_step": e.interleave_step,
        "moe_layers": [i for i in range(n) if cfg.is_moe(i)],
        "router_aux_loss_coef": aux_coef(cfg) if e.n_experts else 0.0,
        "use_qk_norm": a.qk_norm == "l2",
        "no_rope_layers": [int(r) for r in rope],
        "no_rope_layer_interval": a.nope_interval or n + 1,
        # transformers builds the chunked mask even when no layer uses it, so it needs a
        # size; with chunking off every layer is full attention and the size is moot.
        "attention_chunk_size": a.chunk_size if chunked else m.max_seq_len,
        "layer_types": ["chunked_attention" if chunked and r else "full_attention" for r in rope],
        "attn_temperature_tuning": a.temperature_tuning,
        "floor_scale": int(a.floor_scale),
        "attn_scale": a.attn_scale,
        "attention_bias": a.qkv_bias,
    }


def experts_map() -> TensorMap:
    """Fused, input-by-output experts: gate_up [E, D, 2F] (gate first), down [E, F, D]."""
    ours = ("ffn.experts.w_gate", "ffn.experts.w_up", "ffn.experts.w_down")

    def load(src: Source, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        E, D, F = gate.shape
        gate_up = src("feed_forward.experts.gate_up_proj", (E, D, 2 * F))
        gate[...], up[...] = gate_up[..., :F], gate_up[..., F:]
        down[...] = src("feed_forward.experts.down_proj", (E, F, D))

    def save(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> HFTensors:
        yield "feed_forward.experts.gate_up_proj", np.concatenate([gate, up], axis=-1)
        yield "feed_forward.experts.down_proj", down

    return TensorMap(ours, load, save)


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    if not cfg.is_moe(layer):
        return attention_maps(cfg) + swiglu("ffn", "feed_forward")
    return attention_maps(cfg) + [
        linear("ffn.router", "feed_forward.router.weight"),
        experts_map(),
        *swiglu("ffn.shared", "feed_forward.shared_expert"),
    ]


FAMILY = Family(ARCH, "llama4_text", DEFAULTS, to_config, from_config, layer_maps)
