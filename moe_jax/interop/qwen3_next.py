"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`):
hybrid stacks of Gated DeltaNet layers and gated full attention (3:1 in the releases).

Both: `layer_types` (or `full_attention_interval`) say which layers are linear
(`attention.linear=gated_deltanet`, every full_attention_interval-th layer full); the full
layers' q projection is doubled, each head's rows its queries then its output gate
(`attention.output_gate`), with rotate-half partial RoPE (0.25 by default) and RMS QK-norm;
every RMSNorm but the linear layers' gated one applies 1 + w (`model.zero_centered_norm`);
MoE layers route softmax, top-k, renormalised (`norm_topk_prob`), beside a shared expert
scaled by sigmoid(x . shared_expert_gate) (`moe.shared_expert_gate`). They differ in:
- the linear layers' input projections: Qwen3-Next fuses them per key head
  (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5 keeps one per stream (`in_proj_qkv`, `in_proj_z`,
  `in_proj_b`, `in_proj_a`) (`gated_deltanet.HF_INPUTS`);
- the MLPs: Qwen3-Next may have dense layers (`decoder_sparse_step`, `mlp_only_layers`,
  `intermediate_size`) and `norm_topk_prob`; Qwen3.5's layers are all MoE, always
  renormalised;
- RoPE: Qwen3.5's is multimodal (`mrope_section`), which for text, every section at the
  token's position, is the plain RoPE of the text positions.
Qwen3.5 as released (`Qwen3_5MoeForConditionalGeneration`) imports as its text model: the
`text_config`, the tensors under `model.language_model.` read as `model.`, the vision tower
(`model.visual.*`) skipped; export writes `Qwen3_5MoeForCausalLM`, which transformers loads
alone. Their multi-token prediction layers (`mtp.*`, `mtp_num_hidden_layers`) are not
imported yet: an import skips those tensors unread.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from moe_jax.config import Config
from moe_jax.interop.checks import (
    Unsupported,
    check_no_deepseek_routing,
    check_no_deepseek_v4_parts,
    has_nope_layers,
)
from moe_jax.interop.common import (
    Family,
    HFConfig,
    TensorMap,
    attention_from_hf,
    aux_coef,
    check_hf_basics,
    common_hf_config,
    every_nth,
    linear,
    model_from_hf,
    moe_from_hf,
    per_expert_swiglu,
    rope_to_hf,
    same,
    swiglu,
)
from moe_jax.interop.lazy import Deferred
from moe_jax.model import gated_deltanet as gdn
from moe_jax.model.linear_attention import gdn_sizes

NEXT_ARCH = "Qwen3NextForCausalLM"
QWEN35_ARCH = "Qwen3_5MoeForCausalLM"
# Qwen3.5 as released: import only, its text model (`text_config`; the vision tower skipped)
MULTIMODAL_ARCH = "Qwen3_5MoeForConditionalGeneration"
_LANGUAGE_MODEL = "model.language_model."
PARTIAL_ROTARY_DEFAULT = 0.25  # both config classes' default
LINEAR, FULL = "linear_attention", "full_attention"

# transformers' Qwen3NextConfig / Qwen3_5MoeTextConfig defaults for every key read below.
_SHARED_DEFAULTS = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "router_aux_loss_coef": 0.001,
    "layer_types": None,
    "full_attention_interval": 4,  # read only where layer_types is absent
}
NEXT_DEFAULTS = _SHARED_DEFAULTS | {
    "vocab_size": 151936,
    "num_hidden_layers": 48,
    "intermediate_size": 5632,
    "decoder_sparse_step": 1,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "mlp_only_layers": None,
}
QWEN35_DEFAULTS = _SHARED_DEFAULTS | {
    "vocab_size": 248320,
    "num_hidden_layers": 40,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}


# ----------------------------------------------------------------------------- config.json


def text_values(values: dict) -> dict:
    """A multimodal config.json's text model as `Qwen3_5MoeForCausalLM`'s config.json: its
    `text_config`, with the top level's `tie_word_embeddings` (the multimodal model ties its
    head by that one)."""
    text = dict(values.get("text_config") or {})
    return text | {"tie_word_embeddings": values.get("tie_word_embeddings", False)}


def text_name(stored: str) -> str:
    """A multimodal checkpoint's tensor name as the text model's (`model.language_model.X`
    -> `model.X`; `lm_head`, `mtp.*` and `model.visual.*` as they are)."""
    if stored.startswith(_LANGUAGE_MODEL):
        return "model." + stored[len(_LANGUAGE_MODEL) :]
    return stored


def _full_attention_interval(hf: HFConfig) -> int:
    """Every how many layers one is full attention (0: none), from `layer_types` as
    transformers builds it; another pattern is refused."""
    n = hf["num_hidden_layers"]
    every = hf["full_attention_interval"]
    types = hf["layer_types"] or [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    hf.require(
        len(types) >= n and set(types[:n]) <= {LINEAR, FULL},
        f"layer_types={types}",
        f"one of {LINEAR} or {FULL} per layer",
    )
    return every_nth([t == FULL for t in types[:n]], "full-attention layers (layer_types)", hf)


def _attention(hf: HFConfig):
    bias = bool(hf["attention_bias"])
    return attention_from_hf(
        hf,
        10000.0,
        partial_default=PARTIAL_ROTARY_DEFAULT,
        rope_style="half",
        qk_norm="rms",
        qkv_bias=bias,
        o_bias=bias,
        output_gate=True,
        linear="gated_deltanet",
        full_attention_interval=_full_attention_interval(hf),
        linear_key_heads=hf["linear_num_key_heads"],
        linear_value_heads=hf["linear_num_value_heads"],
        linear_key_dim=hf["linear_key_head_dim"],
        linear_value_dim=hf["linear_value_head_dim"],
        linear_conv_kernel=hf["linear_conv_kernel_dim"],
    )


def _to_config(hf: HFConfig, base: Config, moe_every: int, renormalize: bool, ffn: int):
    check_hf_basics(hf)
    shared = hf["shared_expert_intermediate_size"]
    hf.require(
        moe_every == 0 or shared > 0,
        f"shared_expert_intermediate_size={shared}",
        "the MoE block's gated shared expert needs a width",
    )
    moe = moe_from_hf(
        hf,
        base,
        moe_every,
        n_experts=hf["num_experts"],
        expert_hidden=hf["moe_intermediate_size"],
        score="softmax",
        renormalize=renormalize,
        route_scale="output",
        shared_expert_hidden=shared,
        shared_expert_gate=True,
    )
    model = dataclasses.replace(model_from_hf(hf, base, ffn_hidden=ffn), zero_centered_norm=True)
    return dataclasses.replace(base, model=model, attention=_attention(hf), moe=moe)


def next_to_config(hf: HFConfig, base: Config) -> Config:
    mlp_only = set(hf["mlp_only_layers"] or [])
    step, n_experts = hf["decoder_sparse_step"], hf["num_experts"]
    is_moe = [
        i not in mlp_only and n_experts > 0 and (i + 1) % step == 0
        for i in range(hf["num_hidden_layers"])
    ]
    every = every_nth(is_moe, "MoE layers (decoder_sparse_step, mlp_only_layers)", hf)
    return _to_config(hf, base, every, bool(hf["norm_topk_prob"]), hf["intermediate_size"])


def qwen35_to_config(hf: HFConfig, base: Config) -> Config:
    # every layer MoE, renormalised; no dense MLP, so no intermediate_size
    return _to_config(hf, base, 1, True, 0)


def _check(cfg: Config, u: Unsupported) -> None:
    """What both families require of our config."""
    m, a, e = cfg.model, cfg.attention, cfg.moe
    u.check(a.linear == "gated_deltanet", "attention.linear must be 'gated_deltanet'")
    u.check(a.output_gate, "the attention output gate (attention.output_gate) is required")
    u.check(m.zero_centered_norm, "zero-centred norms (model.zero_centered_norm) are required")
    u.check(a.kind == "gqa" and a.rope_style == "half", "rotate-half grouped-query attention")
    u.check(a.qk_norm == "rms", "attention.qk_norm must be 'rms'")
    u.check(not has_nope_layers(cfg), "NoPE layers (attention.nope_interval) are not supported")
    u.check(a.chunk_size == 0 and not a.sinks, "chunked attention and sinks are not supported")
    u.check(a.qkv_bias == a.o_bias, "attention biases must be all on or all off")
    u.check(e.n_experts > 0, "moe.n_experts must be > 0")
    u.check(e.score == "softmax", "moe.score must be 'softmax'")
    u.check(e.route_scale == "output", "moe.route_scale must be 'output'")
    u.check(
        e.shared_expert_hidden > 0 and e.shared_expert_gate,
        "a gated shared expert (moe.shared_expert_hidden > 0, moe.shared_expert_gate) is required",
    )
    u.check(not e.router_bias and not e.expert_bias, "router/expert biases are not supported")
    u.check(e.swiglu_limit == 0, "clamped SwiGLU experts (moe.swiglu_limit) not supported")
    check_no_deepseek_routing(cfg, u)
    check_no_deepseek_v4_parts(cfg, u)


def _hf_config(cfg: Config, arch: str, model_type: str) -> dict:
    a, e = cfg.attention, cfg.moe
    n = cfg.model.n_layers
    return common_hf_config(cfg, arch, model_type) | {
        # written even at 1: a missing key means the classes' 0.25
        "rope_parameters": rope_to_hf(a) | {"partial_rotary_factor": a.partial_rotary_factor},
        "attention_bias": a.qkv_bias,
        "layer_types": [LINEAR if cfg.is_linear(i) else FULL for i in range(n)],
        "linear_conv_kernel_dim": a.linear_conv_kernel,
        "linear_key_head_dim": a.linear_key_dim,
        "linear_value_head_dim": a.linear_value_dim,
        "linear_num_key_heads": a.linear_key_heads,
        "linear_num_value_heads": a.linear_value_heads,
        "num_experts": e.n_experts,
        "num_experts_per_tok": e.top_k,
        "moe_intermediate_size": e.expert_hidden,
        "shared_expert_intermediate_size": e.shared_expert_hidden,
        "router_aux_loss_coef": aux_coef(cfg),
    }


def next_from_config(cfg: Config) -> dict:
    u = Unsupported(NEXT_ARCH)
    _check(cfg, u)
    u.raise_if_any()
    e = cfg.moe
    return _hf_config(cfg, NEXT_ARCH, "qwen3_next") | {
        "intermediate_size": cfg.model.ffn_hidden,
        "decoder_sparse_step": e.interleave_step,
        "mlp_only_layers": [],
        "norm_topk_prob": e.renormalize,
    }


def qwen35_from_config(cfg: Config) -> dict:
    u = Unsupported(QWEN35_ARCH)
    _check(cfg, u)
    e = cfg.moe
    u.check(e.interleave_step == 1, "every layer must be MoE (moe.interleave_step must be 1)")
    u.check(e.renormalize, "the top-k weights are always renormalised (moe.renormalize)")
    u.raise_if_any()
    return _hf_config(cfg, QWEN35_ARCH, "qwen3_5_moe_text")


# ----------------------------------------------------------------------------- tensors


def _gated_q() -> TensorMap:
    """`q_proj` [H * 2 * hd, D], each head's rows its queries then its gate <-> wq, wg."""

    def load(src, wq, wg) -> None:
        D, H, hd = wq.shape
        w_H2hD = src("self_attn.q_proj.weight", (2 * H * hd, D)).reshape(H, 2, hd, D)
        wq[...] = w_H2hD[:, 0].transpose(2, 0, 1)
        wg[...] = w_H2hD[:, 1].transpose(2, 0, 1)

    def save(wq, wg):
        D = wq.shape[0]
        both_DH2h = np.stack([np.asarray(wq), np.asarray(wg)], axis=2)
        yield "self_attn.q_proj.weight", both_DH2h.reshape(D, -1).T

    return TensorMap(("attn.wq", "attn.wg"), load, save)


def _gated_attention_maps(cfg: Config) -> list[TensorMap]:
    maps = [
        _gated_q(),
        linear("attn.wk", "self_attn.k_proj.weight"),
        linear("attn.wv", "self_attn.v_proj.weight"),
        linear("attn.wo", "self_attn.o_proj.weight", in_axes=2),
        same("attn.q_norm.scale", "self_attn.q_norm.weight"),
        same("attn.k_norm.scale", "self_attn.k_norm.weight"),
    ]
    if cfg.attention.qkv_bias:
        maps += [same(f"attn.{p}_bias", f"self_attn.{p}_proj.bias") for p in "qkv"]
        maps.append(same("attn.o_bias", "self_attn.o_proj.bias"))
    return maps


def _when_read(shape: tuple, dtype, make) -> Deferred:
    """`make()` (an array of `shape`) as a `Deferred`, made only when a region of it is read:
    the import's first pass, which checks every tensor map with empty windows, reads nothing
    of it (the split of a stacked projection needs the whole tensor)."""

    def compute(index):
        if any(s.stop <= s.start for s in index):
            return np.empty([max(0, s.stop - s.start) for s in index], dtype)
        return np.asarray(make())[index]

    return Deferred(shape, compute, dtype)


def _projection(name: str, streams: str, grouped: bool, sizes: gdn.GDNSizes) -> TensorMap:
    """One stacked input projection of the linear layer <-> our weights of its streams."""
    hf = f"linear_attn.{name}.weight"

    def load(src, *outs) -> None:
        rows = sum(int(np.prod(o.shape[1:])) for o in outs)
        tensor = src(hf, (rows, sizes.d_model))
        split = functools.cache(lambda: gdn.split_projection(tensor, streams, grouped, sizes))
        for c, out in zip(streams, outs, strict=True):
            out[...] = _when_read(out.shape, tensor.dtype, lambda c=c: split()[f"w{c}"])

    def save(*arrays):
        weights = {f"w{c}": np.asarray(a) for c, a in zip(streams, arrays, strict=True)}
        yield hf, gdn.join_projection(weights, streams, grouped, sizes)

    return TensorMap(tuple(f"attn.w{c}" for c in streams), load, save)


def _conv() -> TensorMap:
    """The depthwise `conv1d.weight` [C, 1, W] <-> ours [C, W]."""

    def load(src, out) -> None:
        C, W = out.shape
        out[...] = src("linear_attn.conv1d.weight", (C, 1, W))[:, 0, :]

    def save(a):
        yield "linear_attn.conv1d.weight", np.asarray(a)[:, None, :]

    return TensorMap(("attn.conv",), load, save)


def _linear_maps(cfg: Config, layout: str) -> list[TensorMap]:
    sizes = gdn_sizes(cfg)
    maps = [_projection(*entry, sizes) for entry in gdn.HF_INPUTS[layout]]
    return maps + [
        _conv(),
        same("attn.dt_bias", "linear_attn.dt_bias"),
        same("attn.A_log", "linear_attn.A_log"),
        same("attn.norm_scale", "linear_attn.norm.weight"),
        linear("attn.wo", "linear_attn.out_proj.weight", in_axes=2),
    ]


def _ffn_maps(cfg: Config, layer: int) -> list[TensorMap]:
    if not cfg.is_moe(layer):
        return swiglu("ffn", "mlp")
    experts = per_expert_swiglu(
        "mlp.experts.{}.gate_proj.weight",
        "mlp.experts.{}.up_proj.weight",
        "mlp.experts.{}.down_proj.weight",
        fused="mlp.experts",
        n_experts=cfg.moe.n_experts,
    )
    return [
        linear("ffn.router", "mlp.gate.weight"),
        experts,
        *swiglu("ffn.shared", "mlp.shared_expert"),
        linear("ffn.shared_gate", "mlp.shared_expert_gate.weight"),
    ]


def _layer_maps(layout: str):
    def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
        mixer = _linear_maps(cfg, layout) if cfg.is_linear(layer) else _gated_attention_maps(cfg)
        norms = [
            same("attn_norm.scale", "input_layernorm.weight"),
            same("ffn_norm.scale", "post_attention_layernorm.weight"),
        ]
        return norms + mixer + _ffn_maps(cfg, layer)

    return layer_maps


NEXT = Family(
    NEXT_ARCH,
    "qwen3_next",
    NEXT_DEFAULTS,
    next_to_config,
    next_from_config,
    _layer_maps("qwen3_next"),
    ignored=("mtp.",),
)
QWEN35 = Family(
    QWEN35_ARCH,
    "qwen3_5_moe_text",
    QWEN35_DEFAULTS,
    qwen35_to_config,
    qwen35_from_config,
    _layer_maps("qwen3_5_moe"),
    ignored=("mtp.", "model.visual."),  # the multimodal checkpoint's vision tower too
)
