"""Pieces shared by the family mappings: tensor maps, HF config reading, RoPE, layer patterns.

A `TensorMap` ties one or more of our per-layer parameters (paths inside a decoder layer such as
`attn.wq`, or top-level paths such as `embed.embedding`) to Hugging Face tensors, both ways:
`load(src, *outs)` fills our arrays (preallocated views, our layout) from HF tensors read one
at a time, `save(*arrays)` yields the HF tensors of our arrays. Layout facts used below:
`nn.Linear.weight` is [out, in] and ours are [in..., out...]; our heads are split out
(`wq [D, H, hd]`, `wo [H, hd, D]`) where HF flattens them (`[H*hd, D]`, `[D, H*hd]`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moe_jax.config import AttentionConfig, Config, ModelConfig, MoEConfig, RopeScalingConfig
from moe_jax.interop import fp8
from moe_jax.interop.finite import checked_finite
from moe_jax.interop.lazy import Deferred
from moe_jax.interop.safetensors_io import InteropError, TensorReader

HFTensors = Iterator[tuple[str, np.ndarray]]


class Source:
    """HF tensors under a name prefix (e.g. `model.layers.3.`), recording which were read;
    with `finite`, each region read is checked for NaN and inf (`checked_finite`)."""

    def __init__(self, reader: TensorReader, prefix: str, used: set[str], finite: bool = True):
        self.reader, self.prefix, self.used, self.finite = reader, prefix, used, finite

    def has(self, name: str) -> bool:
        return self.reader.has(self.prefix + name)

    def __call__(self, name: str, shape: tuple[int, ...]) -> Deferred:
        """Tensor `name` in its own dtype, read (memory-mapped) only where it is used; an FP8
        weight with its block scales (`interop.fp8`) dequantised likewise."""
        full = self._used(name, shape)
        scale = full + fp8.SCALE_SUFFIX
        if self.reader.dtype(full) != "F8_E4M3" or not self.reader.has(scale):
            tensor = self.reader.lazy(full)
        else:
            s_shape = self.reader.shape(scale)
            if why := fp8.check_scales(full, shape, s_shape):
                raise InteropError(f"{why} (in '{self.reader.file_of(scale)}')")
            self.used.add(scale)
            tensor = fp8.deferred(self.reader.raw(full), self.reader.raw(scale))
        return checked_finite(tensor, full, self.reader) if self.finite else tensor

    def packed(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 tensor (MXFP4 blocks or scales) of `shape`, as stored."""
        return self.reader.get_packed(self._used(name, shape))

    def _used(self, name: str, shape: tuple[int, ...]) -> str:
        """The full name of tensor `name`, checked to have `shape` (where present: a missing
        one is named by the read), and recorded as read."""
        full = self.prefix + name
        found = self.reader.shape(full) if self.reader.has(full) else None
        if found is not None and found != tuple(shape):
            raise InteropError(
                f"tensor '{full}' in '{self.reader.file_of(full)}' has shape {list(found)} but "
                f"config.json implies {list(shape)}"
            )
        self.used.add(full)
        return full


@dataclass(frozen=True)
class TensorMap:
    ours: tuple[str, ...]
    load: Callable[..., None]  # load(src, *outs): fill our arrays in place
    save: Callable[..., HFTensors]  # save(*arrays): the HF tensors


def linear(ours: str, hf: str, in_axes: int = 1, alt: str | None = None) -> TensorMap:
    """nn.Linear weight [out, in] <-> ours [in..., out...]; `in_axes` leading axes are `in`.
    `alt`: another name the tensor may have on import (written under `hf`)."""

    def load(src: Source, out: np.ndarray) -> None:
        n_in = math.prod(out.shape[:in_axes])
        name = alt if alt is not None and not src.has(hf) and src.has(alt) else hf
        out[...] = src(name, (out.size // n_in, n_in)).T.reshape(out.shape)

    def save(a: np.ndarray) -> HFTensors:
        yield hf, a.reshape(math.prod(a.shape[:in_axes]), -1).T

    return TensorMap((ours,), load, save)


def same(ours: str, hf: str, flat: bool = True) -> TensorMap:
    """Same values; HF keeps them flat (norm scales, biases) unless `flat=False` (embedding)."""

    def load(src: Source, out: np.ndarray) -> None:
        out[...] = src(hf, (out.size,) if flat else out.shape).reshape(out.shape)

    def save(a: np.ndarray) -> HFTensors:
        yield hf, a.reshape(-1) if flat else a

    return TensorMap((ours,), load, save)


def swiglu(ours: str, hf: str) -> list[TensorMap]:
    """A SwiGLU MLP stored as three HF linears `{hf}.gate_proj/up_proj/down_proj`."""
    return [
        linear(f"{ours}.w_gate", f"{hf}.gate_proj.weight"),
        linear(f"{ours}.w_up", f"{hf}.up_proj.weight"),
        linear(f"{ours}.w_down", f"{hf}.down_proj.weight"),
    ]


def per_expert_swiglu(
    hf_gate: str, hf_up: str, hf_down: str, fused: str, n_experts: int
) -> TensorMap:
    """Experts as one nn.Linear per expert (`hf_*` hold `{}` for the expert index), the layout
    `save_pretrained` writes for Mixtral and Qwen3-MoE. On import the fused layout that
    transformers>=5 uses in memory (`{fused}.gate_up_proj [E, 2F, D]` gate first,
    `{fused}.down_proj [E, D, F]`, written by `save_pretrained(save_original_format=False)`)
    is accepted too."""
    ours = ("ffn.experts.w_gate", "ffn.experts.w_up", "ffn.experts.w_down")

    def load(src: Source, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        E, D, F = gate.shape
        if src.has(f"{fused}.gate_up_proj"):
            gate_up = src(f"{fused}.gate_up_proj", (E, 2 * F, D))
            gate[...] = gate_up[:, :F].transpose(0, 2, 1)
            up[...] = gate_up[:, F:].transpose(0, 2, 1)
            down[...] = src(f"{fused}.down_proj", (E, D, F)).transpose(0, 2, 1)
            return
        for e in range(E):
            gate[e] = src(hf_gate.format(e), (F, D)).T
            up[e] = src(hf_up.format(e), (F, D)).T
            down[e] = src(hf_down.format(e), (D, F)).T

    def save(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> HFTensors:
        for e in range(n_experts):
            yield hf_gate.format(e), gate[e].T
            yield hf_up.format(e), up[e].T
            yield hf_down.format(e), down[e].T

    return TensorMap(ours, load, save)


def attention_maps(cfg: Config) -> list[TensorMap]:
    """Pre-norms and attention of a Llama-style layer (`self_attn.*`, `*_layernorm`)."""
    a = cfg.attention
    maps = [
        same("attn_norm.scale", "input_layernorm.weight"),
        same("ffn_norm.scale", "post_attention_layernorm.weight"),
        linear("attn.wq", "self_attn.q_proj.weight"),
        linear("attn.wk", "self_attn.k_proj.weight"),
        linear("attn.wv", "self_attn.v_proj.weight"),
        linear("attn.wo", "self_attn.o_proj.weight", in_axes=2),
    ]
    if a.qkv_bias:
        maps += [same(f"attn.{p}_bias", f"self_attn.{p}_proj.bias") for p in "qkv"]
    if a.o_bias:
        maps.append(same("attn.o_bias", "self_attn.o_proj.bias"))
    if a.qk_norm == "rms":
        maps += [same(f"attn.{p}_norm.scale", f"self_attn.{p}_norm.weight") for p in "qk"]
    return maps


def top_maps(cfg: Config) -> list[TensorMap]:
    """Embedding, final norm and (untied) output head, the same in every family."""
    maps = [
        same("embed.embedding", "model.embed_tokens.weight", flat=False),
        same("final_norm.scale", "model.norm.weight"),
    ]
    if not cfg.model.tie_embeddings:
        maps.append(linear("head", "lm_head.weight"))
    return maps


# ----------------------------------------------------------------------------- HF configs


class HFConfig:
    """config.json values, falling back to the defaults of the family's transformers config
    class (a key absent from config.json means that default to transformers)."""

    def __init__(self, values: dict, defaults: dict, architecture: str):
        self.values, self.defaults, self.architecture = values, defaults, architecture

    def __getitem__(self, key: str):
        return self._checked(key, key) if key in self.values else self.defaults.get(key)

    def get(self, *keys: str):
        """The first of `keys` (aliases) in config.json, else the first one's class default."""
        for k in keys:
            if k in self.values:
                return self._checked(k, keys[0])
        return self.defaults.get(keys[0])

    def _checked(self, key: str, default_key: str):
        """config.json's value of `key`, of the kind its class default has (where known)."""
        value, default = self.values[key], self.defaults.get(default_key)
        kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
        want = kinds.get(type(default))
        ok = want is None or value is None or isinstance(value, want)
        if ok and want != (bool,) and isinstance(value, bool):  # True is an int to Python
            ok = False
        if not ok:
            kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
            raise InteropError(
                f"config.json of this {self.architecture} has {key}={value!r}, which must be "
                f"{kind[type(default)]}; fix config.json"
            )
        return value

    def refuse(self, setting: str, why: str) -> InteropError:
        return InteropError(f"{self.architecture}: {setting} is not supported by moe_jax ({why})")

    def require(self, ok: bool, setting: str, why: str) -> None:
        if not ok:
            raise self.refuse(setting, why)


def head_dim(hf: HFConfig) -> int:
    return hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]


def rope_params(hf: HFConfig) -> dict:
    """config.json's RoPE parameters as transformers takes them (legacy `rope_scaling` first)."""
    return dict(hf.values.get("rope_scaling") or hf.values.get("rope_parameters") or {})


def partial_rotary_from_hf(hf: HFConfig, default: float = 1.0) -> float:
    """The fraction of each head's dims RoPE rotates, as transformers resolves it: inside the
    RoPE parameters over the top-level key over the family's default (GLM-4.5's 0.5)."""
    params, key = rope_params(hf), "partial_rotary_factor"
    value = params[key] if key in params else hf.values.get(key, default)
    return 1.0 if value is None else float(value)


def rope_from_hf(
    hf: HFConfig, default_theta: float, partial: bool = False
) -> tuple[float, RopeScalingConfig]:
    """(theta, scaling) as transformers resolves them: `rope_scaling` (legacy) over
    `rope_parameters`, `rope_theta` inside them over the top-level key over the class default.
    A partial_rotary_factor other than 1 is refused unless `partial` (the family has it)."""
    params = rope_params(hf)
    hf.require(
        not any(isinstance(v, dict) for v in params.values()),
        "RoPE parameters per layer type",
        "one RoPE for all layers",
    )
    theta = params.get("rope_theta", hf.values.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    factor = partial_rotary_from_hf(hf)
    hf.require(partial or factor == 1, f"partial_rotary_factor={factor}", "RoPE on all dims")

    def need(key: str) -> float:
        if key not in params:
            raise InteropError(f"{hf.architecture}: {kind} RoPE parameters lack '{key}'")
        return float(params[key])

    if kind == "default":
        return float(theta), RopeScalingConfig(type="none")
    if kind == "linear":
        return float(theta), RopeScalingConfig(type="linear", factor=need("factor"))
    if kind == "llama3":
        original = hf.values.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", hf["max_position_embeddings"]),
        )
        return float(theta), RopeScalingConfig(
            type="llama3",
            factor=need("factor"),
            low_freq_factor=need("low_freq_factor"),
            high_freq_factor=need("high_freq_factor"),
            original_max_position=int(original),
        )
    if kind == "yarn":
        # transformers' defaults: null/0 betas are 32 and 1, a missing truncate is true, a
        # top-level original_max_position_embeddings wins (Phi-3 style), and a null factor is
        # max_position_embeddings / original (DeepSeek-V3)
        original = int(
            hf.values.get(
                "original_max_position_embeddings",
                params.get("original_max_position_embeddings", hf["max_position_embeddings"]),
            )
        )
        if "factor" not in params:  # transformers requires the key, if only to be null
            raise InteropError(f"{hf.architecture}: yarn RoPE parameters lack 'factor'")
        factor = params["factor"]
        if factor is None:
            factor = hf["max_position_embeddings"] / original
        attention = params.get("attention_factor")
        # Ours reads 0 as "derive it"; transformers would scale q and k by an explicit 0
        hf.require(
            attention is None or attention > 0,
            f"yarn attention_factor={attention}",
            "a positive attention factor, or none to derive it",
        )
        return float(theta), RopeScalingConfig(
            type="yarn",
            factor=float(factor),
            original_max_position=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention or 0.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    raise hf.refuse(f"rope type '{kind}'", "only default, linear, llama3 and yarn RoPE exist here")


def rope_to_hf(a: AttentionConfig) -> dict:
    partial = {"partial_rotary_factor": a.partial_rotary_factor}
    return _rope_to_hf(a) | (partial if a.partial_rotary_factor != 1 else {})


def _rope_to_hf(a: AttentionConfig) -> dict:
    s = a.rope_scaling
    if s.type == "none":
        return {"rope_type": "default", "rope_theta": a.rope_theta}
    if s.type == "linear":
        return {"rope_type": "linear", "rope_theta": a.rope_theta, "factor": s.factor}
    if s.type == "yarn":
        out = {
            "rope_type": "yarn",
            "rope_theta": a.rope_theta,
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "truncate": s.truncate,
        }
        # 0 is "unset" here, an absent key to transformers (which would use an explicit 0)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(s, key):
                out[key] = getattr(s, key)
        return out
    return {
        "rope_type": "llama3",
        "rope_theta": a.rope_theta,
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position,
    }


def every_nth(flags: list[bool], what: str, hf: HFConfig) -> int:
    """The n with flags[i] == ((i + 1) % n == 0) for every layer i; 0 when no flag is set.

    Our config expresses MoE and NoPE layers only as "every n-th layer"; any other layer
    pattern is refused."""
    if not any(flags):
        return 0
    n = flags.index(True) + 1
    if any(f != ((i + 1) % n == 0) for i, f in enumerate(flags)):
        layers = [i for i, f in enumerate(flags) if f]
        raise hf.refuse(f"{what} on layers {layers}", "the pattern must be every n-th layer")
    return n


def common_hf_config(cfg: Config, architecture: str, model_type: str) -> dict:
    """config.json keys every family shares."""
    m, a = cfg.model, cfg.attention
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "rope_parameters": rope_to_hf(a),
        "attention_dropout": 0.0,
        # None keeps transformers from stopping generation at a class-default id that means
        # nothing to this vocabulary; `save_hf` sets the ids of a tokenizer that has them.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


# ----------------------------------------------------------------------------- our configs


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its config mapping both ways and its tensor maps."""

    architecture: str  # e.g. "MixtralForCausalLM"
    model_type: str
    defaults: dict  # the transformers config class defaults of every key read here
    to_config: Callable[[HFConfig, Config], Config]  # config.json over a base config
    from_config: Callable[[Config], dict]  # our config -> config.json, or InteropError
    layer_maps: Callable[[Config, int], list[TensorMap]]
    # Multi-token prediction (model.mtp_depth, which `to_config` sets from config.json): the
    # tensor maps of depth k (0-based), stored as layer `model.layers.{n_layers + k}.`; their
    # `ours` are paths from the model's root (`mtp.{k}.enorm.scale`, or `embed.embedding` /
    # `head` for the copies of the main model's that the layer stores). None: the family has
    # none.
    mtp_maps: Callable[[Config, int], list[TensorMap]] | None = None
    # Name prefixes of tensors a checkpoint of the family may hold that an import skips
    # unread (Qwen3-Next's `mtp.` layers, which the model does not hold yet)
    ignored: tuple[str, ...] = ()


def check_hf_basics(hf: HFConfig) -> None:
    hf.require(hf["hidden_act"] == "silu", f"hidden_act='{hf['hidden_act']}'", "MLPs are SwiGLU")


def model_from_hf(hf: HFConfig, base: Config, ffn_hidden: int, mtp_depth: int = 0) -> ModelConfig:
    """The model section; `mtp_depth`: the multi-token prediction layers config.json gives
    (families with `Family.mtp_maps`), 0 for the others."""
    if base.model.vision:
        raise InteropError(
            "model.vision is set, but the imported Hugging Face text models have no image "
            "projection; drop model.vision from CONFIG.yaml and the overrides"
        )
    return dataclasses.replace(
        base.model,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        ffn_hidden=ffn_hidden,
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        max_seq_len=hf["max_position_embeddings"],
        init_std=float(hf["initializer_range"]),
        mtp_depth=mtp_depth,
    )


def attention_from_hf(
    hf: HFConfig, default_theta: float, partial_default: float | None = None, **settings
) -> AttentionConfig:
    """Heads and RoPE from config.json; `settings`: the family's other attention fields.
    `partial_default`: the family rotates part of each head, this fraction by default."""
    theta, scaling = rope_from_hf(hf, default_theta, partial=partial_default is not None)
    if partial_default is not None:
        settings["partial_rotary_factor"] = partial_rotary_from_hf(hf, partial_default)
    return AttentionConfig(
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"] or hf["num_attention_heads"],
        head_dim=head_dim(hf),
        rope_theta=theta,
        rope_scaling=scaling,
        **settings,
    )


def moe_from_hf(hf: HFConfig, base: Config, interleave_step: int, **settings) -> MoEConfig:
    """MoE section: no capacity drops (transformers never drops a token), the HF load-balance
    coefficient x top_k (HF sums the expert fractions over the k choices, we average them;
    HF also pools layers before the product, so it is the same loss only approximately)."""
    if interleave_step == 0:  # no MoE layer at all: a dense model
        return dense_moe(base)
    top_k = hf["num_experts_per_tok"]
    return dataclasses.replace(
        base.moe,
        top_k=top_k,
        interleave_step=interleave_step,
        router_bias=False,
        expert_bias=False,
        capacity_factor=0.0,
        lb_loss_weight=float(hf["router_aux_loss_coef"]) * top_k,
        **settings,
    )


def dense_moe(base: Config) -> MoEConfig:
    return dataclasses.replace(
        base.moe, n_experts=0, interleave_step=1, shared_expert_hidden=0, capacity_factor=0.0
    )


def aux_coef(cfg: Config) -> float:
    """Inverse of the `router_aux_loss_coef` mapping in `moe_from_hf`."""
    return cfg.moe.lb_loss_weight / cfg.moe.top_k
