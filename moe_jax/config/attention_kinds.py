"""The checks of attention's kinds: grouped-query (gqa), multi-head latent (mla), the linear
layers of hybrid stacks (attention.linear) and DeepSeek Sparse Attention on mla
(attention.index_topk). `AttentionConfig.check` calls them; `a` is that section."""

from __future__ import annotations

from moe_jax.config.checks import non_negative, one_of, require

# The linear layers' sizes (attention.linear_*), with Qwen3-Next-80B-A3B's values
LINEAR_SIZES = {
    "linear_key_heads": 16,
    "linear_value_heads": 32,
    "linear_key_dim": 128,
    "linear_value_dim": 128,
}
# The sizes of multi-head latent attention (attention.kind=mla) and DeepSeek-V3's values
MLA_SIZES = {
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# The lightning indexer's sizes (attention.index_topk > 0), with DeepSeek-V3.2's values
INDEX_SIZES = {"index_n_heads": 64, "index_head_dim": 128}
INDEX_ROPE_STYLES = ("half", "interleaved")


def check_linear(a) -> None:
    """What linear-attention layers need, and what they do not combine with."""
    for name, qwen3_next in LINEAR_SIZES.items():
        value = getattr(a, name)
        require(
            value > 0,
            f"attention.linear={a.linear} needs attention.{name} > 0 (Qwen3-Next: "
            f"{qwen3_next}), got {value}",
        )
    require(
        a.linear_value_heads % a.linear_key_heads == 0,
        f"attention.linear_value_heads ({a.linear_value_heads}) must be a multiple of "
        f"attention.linear_key_heads ({a.linear_key_heads}): each key head serves a "
        "whole group of value heads",
    )
    require(
        a.linear_conv_kernel >= 1,
        f"attention.linear_conv_kernel must be >= 1 (Qwen3-Next: 4), got {a.linear_conv_kernel}",
    )
    require(
        a.kind == "gqa" and a.sliding_window == 0,
        "attention.linear interleaves linear layers with full grouped-query attention "
        "(attention.full_attention_interval picks those): set attention.kind=gqa and "
        "attention.sliding_window=0",
    )


def check_gqa(a) -> None:
    require(
        a.n_heads % a.n_kv_heads == 0,
        f"attention.n_heads ({a.n_heads}) must be divisible by attention.n_kv_heads "
        f"({a.n_kv_heads}) for grouped-query attention",
    )
    for name in ("q_lora_rank", *MLA_SIZES):
        require(
            getattr(a, name) == 0,
            f"attention.{name} sizes multi-head latent attention; set attention.kind=mla "
            f"too, or {name}=0",
        )


def check_mla(a) -> None:
    """What attention.kind=mla needs, and what it does not combine with."""
    for name, deepseek_v3 in MLA_SIZES.items():
        value = getattr(a, name)
        require(
            value > 0,
            f"attention.kind=mla needs attention.{name} > 0 (DeepSeek-V3: {deepseek_v3}), "
            f"got {value}",
        )
    non_negative(a, "attention", ["q_lora_rank"])
    require(
        a.qk_rope_head_dim % 2 == 0,
        f"attention.qk_rope_head_dim ({a.qk_rope_head_dim}) must be even for RoPE",
    )
    unsupported = {
        "head_dim": (a.head_dim is not None, "null (mla sizes its heads by "
                     "qk_nope_head_dim, qk_rope_head_dim and v_head_dim)"),
        "sliding_window": (a.sliding_window != 0, "0"),
        "chunk_size": (a.chunk_size != 0, "0"),
        "sinks": (a.sinks, "false"),
        "qk_norm": (a.qk_norm != "none", "none (mla normalises its latents instead)"),
        "nope_interval": (a.nope_interval != 0, "0 (every mla layer has RoPE)"),
        "qkv_bias": (a.qkv_bias, "false"),
        "partial_rotary_factor": (a.partial_rotary_factor != 1, "1 (mla rotates its "
                                  "qk_rope_head_dim dims)"),
        "o_bias": (a.o_bias, "false"),
        "output_gate": (a.output_gate, "false"),
    }  # fmt: skip
    for name, (is_set, fix) in unsupported.items():
        value = getattr(a, name)
        shown = str(value).lower() if isinstance(value, bool) else value  # as YAML writes it
        require(
            not is_set,
            f"attention.kind=mla does not support attention.{name}={shown}; "
            f"set attention.{name}={fix}",
        )


def check_sparse(a) -> None:
    """DeepSeek Sparse Attention (attention.index_*): sizes that fit the mla it selects for,
    or, with index_topk 0 (dense attention), none set."""
    require(
        a.index_topk >= 0,
        f"attention.index_topk must be >= 0 (0 = dense attention), got {a.index_topk}",
    )
    one_of(a.index_rope_style, INDEX_ROPE_STYLES, "attention.index_rope_style")
    if a.index_topk == 0:
        for name in (*INDEX_SIZES, "index_topk_freq"):
            unset = 1 if name == "index_topk_freq" else 0
            require(
                getattr(a, name) == unset,
                f"attention.{name} sizes DeepSeek sparse attention's indexer; set "
                f"attention.index_topk > 0 too, or {name}={unset}",
            )
        return
    require(
        a.kind == "mla" and a.q_lora_rank > 0,
        "attention.index_topk (DeepSeek sparse attention) selects keys for latent attention "
        "and its indexer reads the query latent: set attention.kind=mla and "
        "attention.q_lora_rank > 0, or index_topk=0",
    )
    for name, deepseek_v32 in INDEX_SIZES.items():
        value = getattr(a, name)
        require(
            value > 0,
            f"attention.index_topk needs attention.{name} > 0 (DeepSeek-V3.2: "
            f"{deepseek_v32}), got {value}",
        )
    require(
        a.index_head_dim >= a.qk_rope_head_dim,
        f"attention.index_head_dim ({a.index_head_dim}) must be at least "
        f"attention.qk_rope_head_dim ({a.qk_rope_head_dim}): the indexer rotates that many "
        "of its dims",
    )
    require(
        a.index_topk_freq >= 1,
        f"attention.index_topk_freq must be >= 1 (1 = every layer its own indexer), got "
        f"{a.index_topk_freq}",
    )
    non_negative(a, "attention", ["index_skip_topk_offset"])
