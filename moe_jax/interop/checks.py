"""What each family requires of our config on export: `Unsupported` collects the reasons a
config cannot be written as a family, the `check_*` functions add the common ones."""

from __future__ import annotations

from moe_jax.config import Config
from moe_jax.interop.safetensors_io import InteropError


class Unsupported:
    """Collects why a config cannot be written as a family (for one clear error)."""

    def __init__(self, architecture: str):
        self.architecture, self.reasons = architecture, []

    def check(self, ok: bool, reason: str) -> None:
        if not ok:
            self.reasons.append(reason)

    def raise_if_any(self) -> None:
        if self.reasons:
            raise InteropError(f"cannot write {self.architecture}: {'; '.join(self.reasons)}")


def has_nope_layers(cfg: Config) -> bool:
    return not all(cfg.uses_rope(i) for i in range(cfg.model.n_layers))


def check_llama_style(
    cfg: Config, u: Unsupported, qk_norm: str, sinks=False, full_attention_interval=False
) -> None:
    """What every rotate-half family (Llama, Qwen3, Mixtral, Qwen3-MoE, gpt-oss) requires;
    `sinks`, `full_attention_interval`: the family has them (gpt-oss)."""
    a = cfg.attention
    u.check(a.rope_style == "half", "attention.rope_style must be 'half'")
    u.check(a.qk_norm == qk_norm, f"attention.qk_norm must be '{qk_norm}'")
    u.check(not has_nope_layers(cfg), "NoPE layers (attention.nope_interval) are not supported")
    u.check(a.chunk_size == 0, "chunked attention (attention.chunk_size) is not supported")
    check_full_rotary(cfg, u)
    if not sinks:
        check_no_gpt_oss_parts(cfg, u, full_attention_interval)


def check_no_hybrid_parts(cfg: Config, u: Unsupported) -> None:
    """What of Qwen3-Next / Qwen3.5 (`qwen3_next.py`) the other families lack."""
    a = cfg.attention
    u.check(a.linear == "none", "linear-attention layers (attention.linear) are not supported")
    u.check(not a.output_gate, "the attention output gate (attention.output_gate) is not supported")
    u.check(not cfg.model.zero_centered_norm, "zero-centred norms are not supported")
    u.check(not cfg.moe.shared_expert_gate, "a gated shared expert is not supported")
    check_no_deepseek_v4_parts(cfg, u)


def check_no_deepseek_v4_parts(cfg: Config, u: Unsupported) -> None:
    """DeepSeek-V4's parts no family writes yet (V4 itself has no import or export)."""
    u.check(cfg.model.hc_mult == 0, "hyper-connections (model.hc_mult) are not supported")
    u.check(cfg.moe.hash_layers == 0, "hash-routed layers (moe.hash_layers) are not supported")
    u.check(
        cfg.attention.o_groups == 0,
        "a grouped output projection (attention.o_groups) is not supported",
    )


def check_full_rotary(cfg: Config, u: Unsupported) -> None:
    check_no_hybrid_parts(cfg, u)
    u.check(
        cfg.attention.kind == "gqa" and cfg.attention.partial_rotary_factor == 1,
        "partial rotary (attention.partial_rotary_factor) and latent attention (attention.kind"
        "=mla) are not supported",
    )


def check_no_deepseek_routing(cfg: Config, u: Unsupported) -> None:
    """What of DeepSeek-V3's routing the other MoE families lack."""
    e = cfg.moe
    u.check(
        e.n_group == 1 and not e.correction_bias and e.routed_scaling_factor == 1,
        "DeepSeek-V3 routing (moe.n_group, moe.correction_bias, moe.routed_scaling_factor) "
        "is not supported",
    )
    u.check(e.first_dense_layers == 0, "dense first layers (moe.first_dense_layers) not supported")


def check_no_gpt_oss_parts(cfg: Config, u: Unsupported, full_attention_interval=False) -> None:
    """What of gpt-oss other families lack: attention sinks, clamped SwiGLU experts, layers
    alternating window and full attention."""
    u.check(not cfg.attention.sinks, "attention sinks (attention.sinks) are not supported")
    u.check(cfg.moe.swiglu_limit == 0, "clamped SwiGLU experts (moe.swiglu_limit) not supported")
    if not full_attention_interval:
        u.check(
            cfg.attention.full_attention_interval == 0,
            "alternating window and full layers (attention.full_attention_interval) are not "
            "supported",
        )


def check_moe_softmax(cfg: Config, u: Unsupported) -> None:
    """What the softmax-routed families (Mixtral, Qwen3-MoE) require of a MoE config."""
    e = cfg.moe
    u.check(e.n_experts > 0, "moe.n_experts must be > 0")
    u.check(e.score == "softmax", "moe.score must be 'softmax'")
    u.check(e.route_scale == "output", "moe.route_scale must be 'output'")
    u.check(e.shared_expert_hidden == 0, "a shared expert is not supported")
    u.check(not e.router_bias and not e.expert_bias, "router/expert biases are not supported")
    check_no_deepseek_routing(cfg, u)
