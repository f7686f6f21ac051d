"""Parameter and FLOP accounting read off the real model, plus a small CLI.

    python -m moe_jax.summary configs/mixtral_8x7b.yaml [key=value ...]

Counts come from the abstract parameters of `Transformer(cfg)` built under `nnx.eval_shape`
(shapes only, no weights allocated: a 100B-parameter config takes ~0.2 s whatever
`model.scan_layers` says, since both modes share one stacked layout), never from a hand
formula, so they stay true to whatever the model actually creates. Each parameter is put in one
component by its path (see `_component`); an unknown path is an error rather than a silent miscount.

Active parameters per token: everything a token touches, i.e. every parameter except that a
routed expert tensor counts only `top_k / n_experts` of its size (the embedding table, the
output head and the always-on shared expert count in full).

DeepSeek-V3's multi-token prediction module (`model.mtp_depth`) is counted apart, as its card
counts it ("671B + 14B MTP"): its own parameters (`mtp_total`), and as a checkpoint stores it,
with its own copies of the embedding and the head (`mtp_stored`), which here are shared.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from flax import nnx

from moe_jax.config import Config, cli_config
from moe_jax.config.shipped import config_argv
from moe_jax.model.linear_attention import gdn_sizes
from moe_jax.run.door import command, say

COMPONENTS = (
    "embedding",
    "attention",
    "dense_mlp",
    "routed_experts",
    "shared_experts",
    "router",
    "norms",
    "head",
    "vision_proj",
    "mhc",
)


@dataclass(frozen=True)
class ParamBreakdown:
    total: dict[str, int]  # component -> parameter count
    active: dict[str, int]  # component -> parameters one token touches
    active_matmul: int  # active weights a token multiplies with (see train_flops_per_token)
    # The MTP module (model.mtp_depth), in none of the above: its own parameters, those one
    # token touches, and its active matmul weights, each depth's use of the shared head included
    mtp_total: int = 0
    mtp_active: int = 0
    mtp_matmul: int = 0


def _component(names: Sequence[str]) -> str:
    """Component of the parameter at `names` (its path in the model)."""
    if {"attn_hc", "ffn_hc", "hc_head"} & set(names):  # model.hc_mult's hyper-connections
        return "mhc"
    if names[-1] == "scale":  # RMSNorm weights, QK-norm included
        return "norms"
    if tuple(names) == ("embed", "embedding"):
        return "embedding"
    if tuple(names) == ("head",):
        return "head"
    if tuple(names) == ("vision_proj",):
        return "vision_proj"
    if "experts" in names:
        return "routed_experts"
    if "shared" in names or names[-1] == "shared_gate":  # its gate (moe.shared_expert_gate)
        return "shared_experts"
    if names[-1].startswith("router") or names[-1] == "correction_bias":
        return "router"
    if "attn" in names:
        return "attention"
    if "ffn" in names:
        return "dense_mlp"
    raise ValueError(f"summary does not know which component parameter '{'.'.join(names)}' is")


def param_breakdown(cfg: Config) -> ParamBreakdown:
    # Imported here, not at the top, so that the model package may itself import this module
    # (e.g. for `count_params`) without an import cycle.
    from moe_jax.model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    total = dict.fromkeys(COMPONENTS, 0)
    active = dict.fromkeys(COMPONENTS, 0)
    active_matmul = 0
    mtp = dict.fromkeys(("total", "active", "matmul"), 0)
    E, K = cfg.moe.n_experts, cfg.moe.top_k
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        names = [str(p) for p in path]
        if names[-1] == "seed" and names[-2].startswith("lora_"):
            continue  # a LoRA adapter's dropout seed (moe_jax/model/lora.py), not a weight
        if names[-1] == "tid2eid":
            continue  # a hash-routed layer's expert ids (moe.hash_layers): HF's buffer, no weight
        shape = var.shape
        size = math.prod(shape)
        comp = "mtp_proj" if names[-1] == "eh_proj" else _component(names)
        used = size
        if comp == "routed_experts":
            # Expert axis leads, after the stacked-blocks axis when the layer sits in a block.
            expert_axis = 1 if names[0] == "blocks" else 0
            if shape[expert_axis] != E:
                raise ValueError(f"expert parameter '{'.'.join(names)}' {shape} has no {E}-axis")
            used = size // E * K
        elif comp == "vision_proj":  # projects image embeddings, not the text tokens
            used = 0
        matmul = comp not in ("embedding", "norms") and not names[-1].endswith(
            ("bias", "sinks", "scale")
        )
        if names[0] == "mtp":
            mtp["total"] += size
            mtp["active"] += used
            mtp["matmul"] += used if matmul else 0
            continue
        total[comp] += size
        active[comp] += used
        if matmul:
            active_matmul += used
    m = cfg.model
    if m.tie_embeddings:  # the tied table is still multiplied with as the output head
        active_matmul += m.vocab_size * m.d_model
    mtp["matmul"] += m.mtp_depth * m.vocab_size * m.d_model  # each depth's logits
    return ParamBreakdown(total, active, active_matmul, *mtp.values())


def mtp_stored(cfg: Config) -> int:
    """The MTP module's parameters as a checkpoint stores them (DeepSeek-V3's card: 14B):
    its own, and per depth a copy of the embedding and (untied) of the head."""
    m = cfg.model
    copies = (1 if m.tie_embeddings else 2) * m.vocab_size * m.d_model
    return param_breakdown(cfg).mtp_total + m.mtp_depth * copies


def param_counts(cfg: Config) -> tuple[int, int]:
    """(total parameters, active parameters per token) of `Transformer(cfg)`, its MTP module
    apart (`ParamBreakdown.mtp_total`)."""
    b = param_breakdown(cfg)
    return sum(b.total.values()), sum(b.active.values())


def attention_dims(cfg: Config, cached: bool = False) -> tuple[int, int]:
    """(dims a score contracts, dims an output contracts) per head and key: head_dim twice for
    GQA; for MLA the expanded form's dn + dr and dv, or with a cache (`cached`) the absorbed
    form's R + dr twice (its value is the whole cached row, moe_jax/model/mla.py)."""
    a = cfg.attention
    if a.kind != "mla":
        return cfg.head_dim, cfg.head_dim
    if cached:
        return (a.kv_lora_rank + a.qk_rope_head_dim,) * 2
    return a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim


def attention_keys(cfg: Config, layer: int, seq_len: int) -> float:
    """Keys a query of `layer` may attend on average before the causal mask, as MaxText counts
    them: `seq_len` for a global layer, min(window, seq_len) for a sliding-window layer, the
    mean chunk's length for a chunked one (RoPE layers; NoPE layers attend globally)."""
    a = cfg.attention
    if cfg.uses_window(layer):
        return min(a.sliding_window, seq_len)
    if a.chunk_size > 0 and cfg.uses_rope(layer):
        c = a.chunk_size
        return ((seq_len // c) * c * c + (seq_len % c) ** 2) / seq_len
    return seq_len


def linear_layers(cfg: Config) -> int:
    """The main layers that are linear attention (attention.linear: a hybrid stack's)."""
    return sum(cfg.is_linear(j) for j in range(cfg.model.n_layers))


def linear_flops_per_token(cfg: Config) -> int:
    """Forward FLOPs a token costs one linear-attention layer beyond its projections: the gated
    delta rule's recurrence, per value head reading the state out (q S), S^T k and the rank-1
    update, 2 x key_dim x value_dim each. The chunked form computes the same state with more
    work inside a chunk; the count is the rule's, as attention's is the causal half."""
    a = cfg.attention
    return 6 * a.linear_value_heads * a.linear_key_dim * a.linear_value_dim


def attention_flops_per_token(cfg: Config, seq_len: int, causal: bool = True) -> int:
    """QK^T and AV matmuls, forward + backward, in the main layers and the MTP layers; a
    hybrid stack's linear layers their recurrence's (`linear_flops_per_token`, x 3).

    causal (the convention of the peers' published MFU: MaxText's
    `calculate_tflops_training_per_device` halves attention "due to causal mask", citing
    Megatron-LM's and NeMo's formulas): half of each layer's `attention_keys`. causal=False:
    every layer over all `seq_len` keys, the count moe_jax's figures used before 2026-11-27
    (reported beside the causal one where they differ)."""
    per_key = 6 * cfg.attention.n_heads * sum(attention_dims(cfg))
    n_linear = linear_layers(cfg)
    recurrent = 3 * n_linear * linear_flops_per_token(cfg) if n_linear else 0
    softmax = [j for j in range(cfg.model.n_layers) if not cfg.is_linear(j)]
    if not causal:
        return per_key * (len(softmax) + cfg.model.mtp_depth) * seq_len + recurrent
    keys = sum(attention_keys(cfg, j, seq_len) for j in softmax)
    keys += cfg.model.mtp_depth * seq_len  # the MTP layers attend globally
    return int(per_key * keys / 2) + recurrent


def train_flops_per_token(cfg: Config, seq_len: int | None = None, causal: bool = True) -> int:
    """Training FLOPs per token: `6 * N` + attention's (`attention_flops_per_token`, by the
    peers' causal convention unless `causal` is False).

    N = active matmul parameters: the active parameters per token minus the embedding lookup
    table, norm scales and biases, plus the output head (counted even when tied to the
    embedding), and the MTP layers' (`mtp_matmul`: a training step runs them). 6 = 2 FLOPs per
    multiply-add x (forward + 2 backward matmuls). `seq_len` defaults to `cfg.train.seq_len`.
    """
    seq_len = cfg.train.seq_len if seq_len is None else seq_len
    b = param_breakdown(cfg)
    return 6 * (b.active_matmul + b.mtp_matmul) + attention_flops_per_token(cfg, seq_len, causal)


def decode_flops(cfg: Config, batch: int, prompt_len: int, new_tokens: int) -> int:
    """Model FLOPs of sampling `new_tokens` after a `prompt_len` prompt, `batch` rows: the
    prefill's tokens and the `new_tokens - 1` fed back (the last is sampled, never fed), each
    `2 * N` for the matmuls, plus QK^T and AV forward (4 * n_layers * n_heads * head_dim per
    key; MLA's absorbed form: its `attention_dims`): over all `prompt_len` keys in the prefill
    (the training convention), over the keys written so far in decode."""
    n_linear = linear_layers(cfg)  # a hybrid's linear layers: their recurrence, a token each
    softmax = cfg.model.n_layers - n_linear
    per_key = 2 * softmax * cfg.attention.n_heads * sum(attention_dims(cfg, True))
    fed = new_tokens - 1
    tokens = prompt_len + fed
    keys = prompt_len * prompt_len + fed * prompt_len + fed * (fed + 1) // 2
    recurrent = n_linear * linear_flops_per_token(cfg) * tokens if n_linear else 0
    return batch * (2 * param_breakdown(cfg).active_matmul * tokens + per_key * keys + recurrent)


def kv_cache_bytes(cfg: Config, context: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes, bytes if every layer cached the whole context) of one sequence's KV cache at
    `context` tokens, as `Transformer.init_cache` lays it out: a sliding-window layer keeps a
    ring of its window only (and an int32 position per slot); an MLA layer its latent and
    shared RoPE key, kv_lora_rank + qk_rope_head_dim values a token for all heads; a linear-
    attention layer (a hybrid's) its convolution window, in the cache's dtype, and its float32
    state, whatever the context."""
    a = cfg.attention
    per_slot = 2 * a.n_kv_heads * cfg.head_dim * dtype_bytes  # k and v
    if a.kind == "mla":
        per_slot = (a.kv_lora_rank + a.qk_rope_head_dim) * dtype_bytes
    full = cfg.model.n_layers * context * per_slot
    held = 0
    for layer in range(cfg.model.n_layers):
        if cfg.is_linear(layer):
            g = gdn_sizes(cfg)
            held += g.conv_channels * (g.conv_kernel - 1) * dtype_bytes
            held += g.n_value_heads * g.key_dim * g.value_dim * 4
            continue
        window = a.sliding_window if cfg.uses_window(layer) else 0
        ring = 0 < window < context
        held += (window * (per_slot + 4)) if ring else context * per_slot
    return held, full


# ----------------------------------------------------------------------------- CLI


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_summary(cfg: Config, seq_len: int | None = None) -> str:
    seq_len = cfg.train.seq_len if seq_len is None else seq_len
    b = param_breakdown(cfg)
    m, a, e = cfg.model, cfg.attention, cfg.moe
    moe = f"{e.n_experts} experts top-{e.top_k}" if e.n_experts else "dense"
    heads = f"{a.n_heads} heads / {a.n_kv_heads} kv x {cfg.head_dim}"
    if a.kind == "mla":
        heads = (
            f"{a.n_heads} MLA heads (qk {a.qk_nope_head_dim}+{a.qk_rope_head_dim}, v "
            f"{a.v_head_dim}, latent {a.kv_lora_rank}, q rank {a.q_lora_rank})"
        )
    if a.index_topk:  # DeepSeek sparse attention
        heads += f", DSA top-{a.index_topk} (indexer {a.index_n_heads} x {a.index_head_dim})"
    lines = [
        f"{m.n_layers} layers, d_model {m.d_model}, {heads}, {moe}, vocab {m.vocab_size}",
        f"{'component':<16}{'total':>12}{'active/token':>14}",
    ]
    for c in COMPONENTS:
        lines.append(f"{c.replace('_', ' '):<16}{_human(b.total[c]):>12}{_human(b.active[c]):>14}")
    total, active = sum(b.total.values()), sum(b.active.values())
    lines.append(f"{'total':<16}{_human(total):>12}{_human(active):>14}")
    lines.append(f"exact: {total:,} total, {active:,} active per token")
    if m.mtp_depth:  # apart from the total, as DeepSeek-V3's card counts it
        stored = mtp_stored(cfg)
        lines.append(
            f"MTP (depth {m.mtp_depth}): {_human(b.mtp_total)} own params "
            f"({_human(b.mtp_active)} active/token); {_human(stored)} as a checkpoint stores it "
            f"(with copies of the embedding and head): {_human(total)} + {_human(stored)} MTP"
        )
    attn = attention_flops_per_token(cfg, seq_len)
    matmul = b.active_matmul + b.mtp_matmul
    flops = 6 * matmul + attn
    all_keys = train_flops_per_token(cfg, seq_len, causal=False)
    lines.append(
        f"training FLOPs/token at seq_len {seq_len}: {_human(flops)} "
        f"(6 x {_human(matmul)} matmul params + {_human(attn)} causal attention; "
        f"{_human(all_keys)} counting every key)"
    )
    held, full = kv_cache_bytes(cfg, m.max_seq_len)
    ring = f" (full caches on every layer: {full / 2**30:,.2f} GiB)" if held < full else ""
    lines.append(
        f"bf16 KV cache of one {m.max_seq_len:,}-token sequence: {held / 2**30:,.2f} GiB{ring}"
    )
    return "\n".join(lines)


USAGE = (
    "usage: moe-jax summary CONFIG [section.key=value ...]   (CONFIG: a YAML file or a shipped "
    "config's name, e.g. mixtral_8x7b; or python -m moe_jax.summary ...)"
)


@command
def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not args or "=" in args[0]:
        return say(f"no config file given; {USAGE}")
    cfg = cli_config(config_argv(args), default_path=None)
    print(format_summary(cfg))
    return 0
