"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3/R1, Kimi K2) and its MoE, which GLM-4.5
shares (`glm4_moe.py`).

Attention is multi-head latent attention (`attention.kind=mla`, moe_jax/model/mla.py):
`q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (or one `q_proj` where `q_lora_rank` is null),
`kv_a_proj_with_mqa` [R + dr, D] (the latent, then the one shared RoPE key), `kv_a_layernorm`,
`kv_b_proj` [H (dn + dv), R] (per head: the key's dn rows, then the value's dv rows; our
`wk_b` and `wv_b`), `o_proj`. `rope_interleave` (default true) is our `rope_style=interleaved`,
false `half`; YaRN with mscale / mscale_all_dim as transformers computes it (rope.py).

MoE (`mlp.*`) on every layer from `first_k_dense_replace` on (the dense ones: `mlp.gate_proj`
etc. of width `intermediate_size`): a sigmoid router `mlp.gate.weight` with the correction
bias `mlp.gate.e_score_correction_bias` (a buffer there, a parameter here: `correction_bias`,
always on import), group-limited top-k (`n_group`, `topk_group`), renormalised where
`norm_topk_prob`, times `routed_scaling_factor`; `n_routed_experts` experts of width
`moe_intermediate_size` (`mlp.experts.{e}.gate_proj` ..., or the fused transformers>=5 layout)
and an always-on `mlp.shared_experts` of `n_shared_experts` x that width.

Multi-token prediction (`num_nextn_predict_layers`, our `model.mtp_depth`: moe_jax/model/mtp.py)
is imported and exported. Depth k is layer `model.layers.{num_hidden_layers + k - 1}`, which
transformers' `from_pretrained` skips and vLLM / SGLang read: `enorm`, `hnorm`, `eh_proj`
([D, 2D], the embedding's half first; ours transposed), a decoder layer of the last main
layer's kind mapped as the main layers are (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`), `shared_head.norm`, and `embed_tokens` /
`shared_head.head`: copies of the main model's embedding and head (exact copies in the
released checkpoints), which moe_jax ties to those. An import checks a copy it finds to be
exact (else refuses it by name) and skips it; an export writes both, where serving engines
look for them. An import takes config.json's depth where the checkpoint holds the first MTP
layer, 0 where it holds none (`save_pretrained` of transformers writes none, though its
config.json says 1) or with `load_hf(..., mtp=False)` (the layers skipped unread).

Training-only settings: an import balances with the correction bias (`moe.lb_loss_weight` 0:
the Switch loss is not DeepSeek-V3's); the bias's update rate and the sequence-wise loss
(`moe.bias_update_rate`, `moe.seq_aux_loss_weight`) are the base config's (the released
config.json's `aux_loss_alpha` 0.001 is not the report's 0.0001, so neither is taken as the
recipe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from moe_jax.config import AttentionConfig, Config, MoEConfig
from moe_jax.interop.checks import Unsupported, check_no_gpt_oss_parts, check_no_hybrid_parts
from moe_jax.interop.common import (
    Family,
    HFConfig,
    HFTensors,
    Source,
    TensorMap,
    check_hf_basics,
    common_hf_config,
    linear,
    model_from_hf,
    per_expert_swiglu,
    rope_from_hf,
    rope_params,
    same,
    swiglu,
)
from moe_jax.interop.safetensors_io import InteropError

ARCH = "DeepseekV3ForCausalLM"

# transformers' DeepseekV3Config defaults for every key read below (transformers 5.23).
DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
}
# Keys of the released config.json that transformers ignores (it always routes this way) but
# vLLM and SGLang read; an import refuses other values, an export writes these.
ROUTING_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


# ----------------------------------------------------------------------------- MoE (shared)


def moe_from_deepseek(hf: HFConfig, base: Config) -> MoEConfig:
    """The MoE section of a DeepSeek-V3 / GLM-4.5 config.json (the module doc)."""
    for key, value in ROUTING_KEYS.items():
        got = hf.values.get(key, value)
        hf.require(got == value, f"{key}={got!r}", f"transformers routes as {key}={value!r}")
    F = hf["moe_intermediate_size"]
    shared = hf["n_shared_experts"]
    hf.require(shared > 0, f"n_shared_experts={shared}", "the shared expert is always on")
    return dataclasses.replace(
        base.moe,
        n_experts=hf.get("n_routed_experts", "num_local_experts"),
        top_k=hf["num_experts_per_tok"],
        expert_hidden=F,
        interleave_step=1,
        score="sigmoid",
        renormalize=bool(hf["norm_topk_prob"]),
        route_scale="output",
        shared_expert_hidden=shared * F,
        router_bias=False,
        expert_bias=False,
        n_group=hf["n_group"] or 1,
        topk_group=hf["topk_group"] or 1,
        correction_bias=True,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        first_dense_layers=min(hf["first_k_dense_replace"] or 0, hf["num_hidden_layers"]),
        swiglu_limit=0.0,
        capacity_factor=0.0,
        lb_loss_weight=0.0,
    )


def check_deepseek_moe(cfg: Config, u: Unsupported) -> None:
    """What a DeepSeek-V3 / GLM-4.5 MoE requires of our config."""
    e = cfg.moe
    u.check(e.n_experts > 0, "moe.n_experts must be > 0")
    u.check(e.score == "sigmoid", "moe.score must be 'sigmoid'")
    u.check(e.route_scale == "output", "moe.route_scale must be 'output'")
    u.check(
        e.interleave_step == 1,
        "every layer after moe.first_dense_layers must be MoE (moe.interleave_step must be 1)",
    )
    u.check(
        e.shared_expert_hidden > 0 and e.shared_expert_hidden % e.expert_hidden == 0,
        "the shared expert must be a whole number (>= 1) of routed experts wide "
        "(moe.shared_expert_hidden a multiple of moe.expert_hidden)",
    )
    u.check(not e.router_bias and not e.expert_bias, "router/expert biases are not supported")
    check_no_gpt_oss_parts(cfg, u)
    check_no_hybrid_parts(cfg, u)


def deepseek_moe_to_hf(cfg: Config) -> dict:
    """config.json's MoE keys (inverse of `moe_from_deepseek`) and the MTP depth."""
    e = cfg.moe
    return {
        "intermediate_size": cfg.model.ffn_hidden,
        "moe_intermediate_size": e.expert_hidden,
        "n_routed_experts": e.n_experts,
        "num_experts_per_tok": e.top_k,
        "n_shared_experts": e.shared_expert_hidden // e.expert_hidden,
        "norm_topk_prob": e.renormalize,
        "routed_scaling_factor": e.routed_scaling_factor,
        "n_group": e.n_group,
        "topk_group": e.topk_group,
        "first_k_dense_replace": e.first_dense_layers,
        "num_nextn_predict_layers": cfg.model.mtp_depth,  # the MTP layers (`mtp_maps`)
    }


def _zero_correction_bias(n_experts: int) -> TensorMap:
    """Export of a router without a correction bias: transformers always has the buffer, and
    a zero bias chooses exactly as none does. (An import always takes the bias.)"""

    def load(src: Source) -> None:
        raise AssertionError("an import always maps the correction bias to moe.correction_bias")

    def save() -> HFTensors:
        yield "mlp.gate.e_score_correction_bias", np.zeros(n_experts, np.float32)

    return TensorMap((), load, save)


def deepseek_ffn_maps(cfg: Config, layer: int) -> list[TensorMap]:
    """The FFN of layer `layer`: dense SwiGLU (`mlp.*`) or the routed and shared experts."""
    if not cfg.is_moe(layer):
        return swiglu("ffn", "mlp")
    e = cfg.moe
    experts = per_expert_swiglu(
        "mlp.experts.{}.gate_proj.weight",
        "mlp.experts.{}.up_proj.weight",
        "mlp.experts.{}.down_proj.weight",
        fused="mlp.experts",
        n_experts=e.n_experts,
    )
    bias = (
        same("ffn.correction_bias", "mlp.gate.e_score_correction_bias")
        if e.correction_bias
        else _zero_correction_bias(e.n_experts)
    )
    router = linear("ffn.router", "mlp.gate.weight")
    return [router, bias, experts, *swiglu("ffn.shared", "mlp.shared_experts")]


# ----------------------------------------------------------------------------- MTP (shared)


def mtp_depth_from_hf(hf: HFConfig) -> int:
    """config.json's multi-token prediction depth (`num_mtp_layers` is transformers' alias)."""
    return hf.get("num_nextn_predict_layers", "num_mtp_layers") or 0


def _main_copy(ours: str, hf: str, what: str, transposed: bool) -> TensorMap:
    """The MTP layer's copy `hf` of the main model's `ours` (the embedding, or the head: [V, D]
    as `lm_head.weight`, `transposed` from ours), which the placements load before it: written
    on export; on import checked to be exact where present, its values used no further."""

    def load(src: Source, main: np.ndarray) -> None:
        if not src.has(hf):
            return
        want = main.T if transposed else main
        got = src(hf, want.shape)
        step = max(1, 2**24 // got.shape[1])  # rows at a time: no [V, D] temporary
        blocks = range(0, len(got), step)
        if not all(np.array_equal(got[i : i + step], want[i : i + step]) for i in blocks):
            raise InteropError(
                f"tensor '{src.prefix}{hf}' is not an exact copy of the main model's {what}, "
                "which moe_jax's multi-token prediction layers share; fix the checkpoint or "
                "import it without those layers"
            )

    def save(main: np.ndarray) -> HFTensors:
        yield hf, main.T if transposed else main

    return TensorMap((ours,), load, save)


def mtp_maps(layer_maps: Callable[[Config, int], list[TensorMap]]):
    """`Family.mtp_maps` of a family whose decoder layers `layer_maps` maps (the module doc):
    depth k's (0-based) parameters `mtp.{k}.*` and the embedding / head copies."""

    def maps(cfg: Config, k: int) -> list[TensorMap]:
        own = f"mtp.{k}."
        # the decoder layer, of the last main layer's kind, as that layer maps
        layer = [
            dataclasses.replace(m, ours=tuple(f"{own}layer.{n}" for n in m.ours))
            for m in layer_maps(cfg, cfg.model.n_layers - 1)
        ]
        tied = cfg.model.tie_embeddings
        return [
            same(f"{own}enorm.scale", "enorm.weight"),
            same(f"{own}hnorm.scale", "hnorm.weight"),
            linear(f"{own}eh_proj", "eh_proj.weight"),
            *layer,
            same(f"{own}head_norm.scale", "shared_head.norm.weight"),
            _main_copy("embed.embedding", "embed_tokens.weight", "embedding", transposed=False),
            _main_copy(
                "embed.embedding" if tied else "head",
                "shared_head.head.weight",
                "output head",
                transposed=not tied,
            ),
        ]

    return maps


# ----------------------------------------------------------------------------- DeepSeek-V3


def to_config(hf: HFConfig, base: Config) -> Config:
    check_hf_basics(hf)
    hf.require(
        not hf["attention_bias"], "attention_bias=true", "the latent attention has no biases"
    )
    H = hf["num_attention_heads"]
    kv = hf["num_key_value_heads"] or H
    hf.require(
        kv == H,
        f"num_key_value_heads={kv}",
        "latent attention expands keys for every head: it must equal num_attention_heads",
    )
    theta, scaling = rope_from_hf(hf, 10000.0)
    mscale_all_dim = rope_params(hf).get("mscale_all_dim")
    hf.require(
        scaling.type in ("none", "yarn") or not mscale_all_dim,
        f"mscale_all_dim with {scaling.type} RoPE",
        "the softmax scale takes mscale_all_dim with YaRN only",
    )
    attention = AttentionConfig(
        kind="mla",
        n_heads=H,
        n_kv_heads=H,  # unused: every head has its own keys, from the latent
        rope_theta=theta,
        rope_scaling=scaling,
        rope_style="interleaved" if hf["rope_interleave"] else "half",
        q_lora_rank=hf["q_lora_rank"] or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
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
    u.check(a.kind == "mla", "attention.kind must be 'mla' (multi-head latent attention)")
    u.check(a.index_topk == 0, "DeepSeek sparse attention (attention.index_topk) is not supported")
    check_deepseek_moe(cfg, u)
    u.raise_if_any()
    return dense_mla_hf_config(cfg)


def dense_mla_hf_config(cfg: Config) -> dict:
    """config.json of a DeepSeek-V3 (its MLA and MoE keys), checked by the caller (`dsa.py`
    adds its indexer's keys)."""
    a = cfg.attention
    return (
        common_hf_config(cfg, ARCH, "deepseek_v3")
        | deepseek_moe_to_hf(cfg)
        | ROUTING_KEYS
        | {
            "num_key_value_heads": a.n_heads,
            "head_dim": a.qk_rope_head_dim,  # what transformers' config derives it as
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "rope_interleave": a.rope_style == "interleaved",
            "attention_bias": False,
        }
    )


def _kv_b() -> TensorMap:
    """Our wk_b [R, H, dn] and wv_b [R, H, dv] <-> kv_b_proj.weight [H (dn + dv), R], each
    head's key rows then its value rows."""
    name = "self_attn.kv_b_proj.weight"

    def load(src: Source, wk: np.ndarray, wv: np.ndarray) -> None:
        R, H, N = wk.shape
        V = wv.shape[2]
        w = src(name, (H * (N + V), R)).reshape(H, N + V, R)
        wk[...] = w[:, :N].transpose(2, 0, 1)
        wv[...] = w[:, N:].transpose(2, 0, 1)

    def save(wk: np.ndarray, wv: np.ndarray) -> HFTensors:
        w = np.concatenate([wk.transpose(1, 2, 0), wv.transpose(1, 2, 0)], axis=1)
        yield name, w.reshape(-1, wk.shape[0])

    return TensorMap(("attn.wk_b", "attn.wv_b"), load, save)


def mla_maps(cfg: Config) -> list[TensorMap]:
    """Pre-norms and the latent attention (`self_attn.*`) of a layer."""
    maps = [
        same("attn_norm.scale", "input_layernorm.weight"),
        same("ffn_norm.scale", "post_attention_layernorm.weight"),
    ]
    if cfg.attention.q_lora_rank > 0:
        maps += [
            linear("attn.wq_a", "self_attn.q_a_proj.weight"),
            same("attn.q_a_norm.scale", "self_attn.q_a_layernorm.weight"),
            linear("attn.wq_b", "self_attn.q_b_proj.weight"),
        ]
    else:
        maps.append(linear("attn.wq", "self_attn.q_proj.weight"))
    return maps + [
        linear("attn.wkv_a", "self_attn.kv_a_proj_with_mqa.weight"),
        same("attn.kv_a_norm.scale", "self_attn.kv_a_layernorm.weight"),
        _kv_b(),
        linear("attn.wo", "self_attn.o_proj.weight", in_axes=2),
    ]


def layer_maps(cfg: Config, layer: int) -> list[TensorMap]:
    return mla_maps(cfg) + deepseek_ffn_maps(cfg, layer)


FAMILY = Family(
    ARCH, "deepseek_v3", DEFAULTS, to_config, from_config, layer_maps, mtp_maps(layer_maps)
)
