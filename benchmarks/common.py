"""Shared by the benchmarks: the two sizes, the three routing styles, the equivalent Hugging
Face peer, timing and the machine description.

    cfg = bench_config("small", "mixtral")             # benchmarks/configs/small.yaml + style
    peer = hf_model(cfg, "mixtral")                     # MixtralForCausalLM, random init, fp32

Every style runs every layer as MoE (the sizes' configs say so); a style fixes routing and the
attention details its family uses. The Hugging Face config is derived from *our* config, so
the two models have the same shapes, routing and attention by construction (weights differ:
both are random).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from moe_jax.config import Config, load_config

CONFIGS = Path(__file__).resolve().parent / "configs"
SIZES = ("small", "medium")

STYLES: dict[str, list[str]] = {
    # Mixtral: softmax over the top-2 router logits (= softmax, top-2, renormalise), experts'
    # outputs weighted, half-split RoPE, no QK-norm.
    "mixtral": [
        "moe.score=softmax",
        "moe.top_k=2",
        "moe.renormalize=true",
        "moe.route_scale=output",
        "attention.qk_norm=none",
        "attention.rope_style=half",
    ],
    # Qwen3-MoE: softmax, top-2, renormalised (norm_topk_prob), learned RMS QK-norm before RoPE.
    "qwen3": [
        "moe.score=softmax",
        "moe.top_k=2",
        "moe.renormalize=true",
        "moe.route_scale=output",
        "attention.qk_norm=rms",
        "attention.rope_style=half",
    ],
    # Llama 4: top-1 on raw router logits, sigmoid of the pick scales the expert *input*, an
    # always-on shared expert as wide as a routed one; interleaved RoPE, weightless L2 QK-norm
    # on RoPE layers, every 4th layer NoPE with attention-temperature tuning, chunked attention
    # on RoPE layers (Llama4TextConfig defaults; chunks of 8192 never bind at these lengths).
    "llama4": [
        "moe.score=sigmoid",
        "moe.top_k=1",
        "moe.renormalize=false",
        "moe.route_scale=input",
        "moe.shared_expert_hidden=${moe.expert_hidden}",
        "attention.qk_norm=l2",
        "attention.rope_style=interleaved",
        "attention.nope_interval=4",
        "attention.temperature_tuning=true",
        "attention.chunk_size=8192",
    ],
}


def count(minimum: int = 1) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum` (a bad one is argparse's usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def counts(text: str) -> list[int]:
    """argparse type: a comma list of integers >= 1, e.g. `1,8`."""
    return [count()(t) for t in text.split(",")]


def bench_config(size: str, style: str, *overrides: str) -> Config:
    return load_config(CONFIGS / f"{size}.yaml", [*STYLES[style], *overrides])


def hf_config(cfg: Config, style: str):
    """The transformers config of the same architecture as `cfg` (a `style` model)."""
    import transformers

    m, a, e = cfg.model, cfg.attention, cfg.moe
    if not all(cfg.is_moe(i) for i in range(m.n_layers)):
        raise ValueError("the peers are built for configs whose every layer is MoE")
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        num_hidden_layers=m.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        num_experts_per_tok=e.top_k,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    if style == "mixtral":
        return transformers.MixtralConfig(
            **common,
            intermediate_size=e.expert_hidden,
            num_local_experts=e.n_experts,
            router_jitter_noise=0.0,
        )
    if style == "qwen3":
        hf = transformers.Qwen3MoeConfig(
            **{k: v for k, v in common.items() if k != "head_dim"},
            moe_intermediate_size=e.expert_hidden,
            intermediate_size=m.ffn_hidden,  # dense layers; there are none (mlp_only_layers=[])
            num_experts=e.n_experts,
            norm_topk_prob=e.renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
        )
        hf.head_dim = cfg.head_dim
        return hf
    if style == "llama4":
        return transformers.Llama4TextConfig(
            **common,
            intermediate_size=e.expert_hidden,  # routed experts and the shared expert
            intermediate_size_mlp=m.ffn_hidden,  # dense layers; there are none
            num_local_experts=e.n_experts,
            interleave_moe_layer_step=1,
            use_qk_norm=a.qk_norm == "l2",
            no_rope_layers=[int(cfg.uses_rope(i)) for i in range(m.n_layers)],
            attention_chunk_size=a.chunk_size or None,
            attn_temperature_tuning=a.temperature_tuning,
            floor_scale=int(a.floor_scale),
            attn_scale=a.attn_scale,
            router_jitter_noise=0.0,
        )
    raise ValueError(f"unknown style '{style}'; use one of {', '.join(STYLES)}")


def hf_model(cfg: Config, style: str, threads: int = 2):
    """The peer: transformers' causal LM for `style`, random init, float32, eval mode."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cls = {
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3": transformers.Qwen3MoeForCausalLM,
        "llama4": transformers.Llama4ForCausalLM,
    }[style]
    return cls(hf_config(cfg, style)).to(torch.float32).eval()


def cpu_idle_fraction(window_s: float) -> float:
    """Fraction of all CPUs' time spent idle over the next `window_s` seconds (/proc/stat)."""

    def sample():
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    (t0, i0), _ = sample(), time.sleep(window_s)
    t1, i1 = sample()
    return (i1 - i0) / max(t1 - t0, 1)


def wait_until_idle(min_idle: float = 0.85, window_s: float = 2.0, timeout_s: float = 300) -> bool:
    """Block until the machine is quiet (other processes distort timings, the peer's OpenMP
    threads far more than XLA's); False if it never was within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cpu_idle_fraction(window_s) >= min_idle:
            return True
    return False


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of `fn` (which must block until its work is done)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> dict:
    """Where and with what the numbers were taken (torch and transformers: None where the
    `interop` extra is not installed, as in the newest CI leg)."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "torch_threads": _torch_threads(),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_threads() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()
