"""Typed configuration tree: dataclass schema <- YAML file <- dotted command-line overrides.

OmegaConf does the merging and type coercion against the dataclass schema; this module adds
the cross-field validation (shapes that must divide, enums, ranges) and turns every failure
into one `ConfigError` whose message names the problem and the fix. The result is a tree of
frozen (hence hashable) dataclasses, so a config can be a static argument to `jax.jit`.

    cfg = load_config("configs/tiny.yaml", ["model.n_layers=4", "moe.capacity_factor=1.25"])
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from moe_jax.backends import EXCHANGES, IMPLS, WEIGHT_GATHERS

DTYPES = ("auto", "float32", "bfloat16")
REMAT_POLICIES = ("none", "dots", "full")
# Activations the model names for remat policies (moe_jax/model/remat.py); `model.remat_save`
# and `model.remat_offload` take them.
REMAT_NAMES = {
    "layer_input": "each decoder layer's input [B, T, D]",
    "qkv_proj": "the attention's q, k, v projections (before norms and RoPE)",
    "attention_out": "the attention kernel's output and log-sum-exp",
    "out_proj": "the attention's output projection [B, T, D]",
    "expert_in": "the tokens as the experts take them: capacity buffers or sorted rows",
    "expert_gate_up": "the experts' gate and up products",
    "expert_out": "the experts' outputs",
}
DEFAULT_WARMUP_STEPS = 50  # train.warmup_steps=null: this many, at most a tenth of the run


class ConfigError(ValueError):
    """An impossible or malformed configuration; the message says what to change."""


@dataclass(frozen=True)
class RopeScalingConfig:
    # none | linear (positions divided by factor) | llama3 (Llama-3/4 frequency-band scaling)
    type: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    ffn_hidden: int = 512  # hidden width of the dense SwiGLU layers
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048  # longest context the model (and its KV cache) is used with
    # compute dtype; params are always float32. auto: float32 on CPU, bfloat16 on GPU and TPU
    # (moe_jax/backends.py)
    dtype: str = "auto"
    scan_layers: bool = False  # lax.scan over repeating blocks of layers
    # Rematerialisation of each scanned block in the backward pass (needs scan_layers; memory
    # for compute): none = keep the activations the backward needs (the attention blocks and
    # the experts already recompute their cheap parts); dots = keep only matmul outputs;
    # full = keep only each block's input and recompute its forward (one extra forward pass).
    remat: str = "none"
    # Named activations (REMAT_NAMES, comma-separated) that remat dots or full keeps anyway:
    # remat_save in device memory, remat_offload in host memory, copied out in the forward and
    # back for the backward (TPU/GPU; moe_jax/model/remat.py). MaxText's v6e recipe:
    # remat=full remat_offload=layer_input,qkv_proj,out_proj.
    remat_save: str = ""
    remat_offload: str = ""
    init_std: float = 0.02
    # Width of precomputed image embeddings the model accepts (`model(tokens, images=...,
    # image_mask=...)`, projected to d_model); 0 = text only, no projection parameter.
    vision: int = 0

    @property
    def remat_saved(self) -> tuple[str, ...]:
        """model.remat_save as names."""
        return _names(self.remat_save)

    @property
    def remat_offloaded(self) -> tuple[str, ...]:
        """model.remat_offload as names."""
        return _names(self.remat_offload)


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list -> its names."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


@dataclass(frozen=True)
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None: d_model // n_heads
    rope_theta: float = 10000.0
    # half: rotate split halves (Llama/Mixtral/Qwen); interleaved: rotate pairs (Llama 4)
    rope_style: str = "half"
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    qk_norm: str = "none"  # none | rms (learned, before RoPE) | l2 (weightless, after RoPE)
    nope_interval: int = 0  # every nope_interval-th layer has no RoPE; 0 = none
    temperature_tuning: bool = False  # Llama 4 attention temperature on NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    chunk_size: int = 0  # chunked local attention on RoPE layers; 0 = off
    sliding_window: int = 0  # attend to the last `sliding_window` positions; 0 = off
    qkv_bias: bool = False
    o_bias: bool = False
    # Kernel (moe_jax/backends.py): auto (the backend's own) | blocked (blocked softmax with a
    # hand-written backward, XLA:CPU's) | cudnn (GPU fused attention) | splash (TPU Pallas)
    impl: str = "auto"


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 256
    interleave_step: int = 1  # MoE on every interleave_step-th layer, dense SwiGLU elsewhere
    # The three routing switches are independent: Llama 4 is score=sigmoid, renormalize=false,
    # route_scale=input (configs/llama4_scout_17b_16e.yaml); sigmoid alone keeps the others.
    score: str = "softmax"  # softmax | sigmoid
    renormalize: bool = True  # renormalise the top-k weights to sum to 1 (top-1: always 1,
    # so the router then learns from the aux losses only)
    route_scale: str = "output"  # output (Mixtral/Qwen) | input (Llama 4: scales expert input)
    shared_expert_hidden: int = 0  # 0 = no shared expert
    router_bias: bool = False
    expert_bias: bool = False
    capacity_factor: float = 1.25  # <= 0: no token is ever dropped
    lb_loss_weight: float = 0.01
    z_loss_weight: float = 1e-3
    # Expert kernel (moe_jax/backends.py): auto (the backend's own) | buckets (capacity buffers,
    # filled rows by lax.switch: XLA:CPU's) | batched (every buffer slot in one batched matmul:
    # GPU's) | ragged (rows sorted by expert, jax.lax.ragged_dot) | megablox (TPU Pallas
    # grouped matmul). Every one computes the same routing and drops.
    impl: str = "auto"
    # How expert-parallel layers with moe.impl=ragged move tokens (moe_jax/backends.py):
    # auto (ragged on GPU/TPU, buffers on CPU) | ragged (only the routed rows, by
    # jax.lax.ragged_all_to_all) | buffers (the fixed [E, C] capacity buffers by all_to_all).
    exchange: str = "auto"
    # The grouped impls (ragged, megablox) run the sorted rows in this many consecutive chunks,
    # forward and backward, so their [rows, expert_hidden] intermediates exist for one chunk
    # at a time; the backward recomputes each chunk's gate/up products (moe_jax/model/grouped.py).
    row_chunks: int = 1


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None  # text file(s) or glob(s), comma separated; None: embedded corpus
    # byte | char | PATH: a directory with tokenizer.json (Hugging Face) or tokenizer.model
    # (SentencePiece), or such a file; a run keeps a copy of its files (RUN_DIR/tokenizer/)
    tokenizer: str = "byte"
    val_fraction: float = 0.1
    num_workers: int = 0  # Grain prefetch threads; 0 = batches are cut in the main thread
    embedded_max_bytes: int = 4_000_000  # cap on the embedded (stdlib sources) corpus
    # Prepared datasets (`python -m moe_jax.prepare`; data.path=DIR trains on one) mixed by
    # weight, instead of data.path: "DIR:WEIGHT,DIR:WEIGHT,..." (weights > 0, any scale)
    mixture: str | None = None
    # Packing of prepared data (text files are one stream without documents): documents are
    # packed back to back into windows. document_mask: attention and the loss stay within a
    # document (the batch carries segment ids); false: a window is one sequence, as text.
    document_mask: bool = True
    # Positions restart at 0 at every document start in a window (RoPE, chunked attention and
    # NoPE temperature see each document as if it began the window); needs document_mask.
    document_positions: bool = True
    # Supervised fine-tuning from JSONL files (data.path; moe_jax/data/sft.py): none |
    # prompt_completion (lines {"prompt": ..., "completion": ...}; the loss covers the
    # completion and an EOS) | chat (lines {"messages": [{"role": ..., "content": ...}, ...]},
    # rendered with the tokenizer's chat template; the loss covers the assistant turns).
    # Examples are packed whole into windows of train.seq_len+1 tokens (needs document_mask);
    # the last val_fraction of the examples (at least one) is the validation split.
    sft: str = "none"

    @property
    def mixture_entries(self) -> list[tuple[str, float]]:
        """data.mixture as (dir, weight) pairs; ConfigError names a malformed entry."""
        entries = []
        for item in (self.mixture or "").split(","):
            path, sep, weight = item.strip().rpartition(":")
            try:
                w = float(weight)
            except ValueError:
                w = None
            if not sep or not path.strip() or w is None or not (math.isfinite(w) and w > 0):
                raise ConfigError(
                    f"data.mixture entry '{item.strip()}' is not DIR:WEIGHT with a positive "
                    'weight; write data.mixture="DIR:WEIGHT,DIR:WEIGHT"'
                )
            entries.append((path.strip(), w))
        return entries


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per step; batch_size must divide by it
    lr: float = 3e-3
    # The LR after warmup (moe_jax/train_step.py: lr_schedule): cosine | linear decay to
    # min_lr_ratio * lr at train.steps, or wsd (warmup-stable-decay: lr held, then a linear
    # decay over the last decay_fraction of the steps)
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd's decay phase, a fraction of train.steps
    min_lr_ratio: float = 0.1
    # Steps of linear warmup to lr; None: DEFAULT_WARMUP_STEPS, at most a tenth of the run
    # (see `warmup`), so that any train.steps works and a short run is not mostly warmup
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    # dtype the Adam moments are stored in (float32 | bfloat16); the update is computed in
    # float32 either way. bfloat16 saves 4 of the 12 bytes per parameter of the train state.
    moments_dtype: str = "float32"
    logit_z_loss: float = 0.0
    # Positions per chunk of the output head in the loss (moe_jax/loss.py): the [B, T, V]
    # float32 logits are never held whole, for one more head matmul in the backward; must
    # divide train.seq_len. 0 = all positions at once; -1 = auto (moe_jax/backends.py: 0 on
    # CPU, up to 1024 on GPU / TPU).
    loss_chunk: int = -1
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    peak_flops: float = 0.0  # FLOP/s of one device (one host on CPU) for MFU; 0 = measure
    tensorboard: bool = True  # TensorBoard event files in RUN_DIR/tb (JSONL is always written)
    # Resume from this saved step instead of the latest (e.g. when the latest is damaged); the
    # checkpoints after it are moved to RUN_DIR/superseded. 0 = the latest. A one-off override.
    resume_step: int = 0

    @property
    def decay_steps(self) -> int:
        """wsd's decay phase in steps: decay_fraction of train.steps, rounded."""
        return round(self.decay_fraction * self.steps)

    @property
    def warmup(self) -> int:
        """The warmup steps in effect: warmup_steps, or min(DEFAULT_WARMUP_STEPS, steps // 10)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(DEFAULT_WARMUP_STEPS, self.steps // 10)


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    # Multi-slice (TPU slices, or GPU hosts, joined by the data-center network): the data axis
    # spans `slices` slices, each holding data/slices of it; the other axes stay in a slice.
    slices: int = 1
    # Let a mesh axis take part of a physical torus axis (e.g. fsdp=8 x expert=8 on v5p-128's
    # 4x4x4): jax refuses such layouts by default, as their collectives may share links.
    split_physical_axes: bool = False
    # How training gathers the attention weights and the head, split over the batch axes, and
    # reduces their gradients (moe_jax/backends.py): auto | partitioner (XLA's) | steps
    # (inside a shard_map, one batch axis at a time: reduce-scatters over one axis each; TPU's)
    weight_gather: str = "auto"
    # With the steps: the most devices one of their collectives spans (-1 = auto: 8 on TPU,
    # 0 elsewhere; 0 = a whole axis). A longer batch axis is gathered in steps of at most this
    # many devices: the rest that groups of it do not tile first (consecutive devices), then
    # the groups across them (fsdp 64: 8 x 8; fsdp 256: 4, 8, 8; expert 16: 2, 8;
    # moe_jax/model/gather.py).
    gather_group: int = -1
    # multi-host (jax.distributed): on with `distributed` or when a coordinator / more than one
    # process is given; unset fields come from JAX_COORDINATOR_ADDRESS or the cluster's env
    distributed: bool = False
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class SampleConfig:
    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0
    # Rows and prompt length of a batch: sample.py's --num-samples sets batch_size (its prompt
    # sets the length); `moe_jax.aot --step decode` compiles for both.
    batch_size: int = 1
    prompt_len: int = 128
    # Form of the weights when sampling (moe_jax/weights.py): auto (bfloat16 if model.dtype is
    # bfloat16, else float32: no result changes) | float32 | bfloat16 | int8 (per channel)
    weights: str = "auto"


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    run_dir: str = "runs/tiny"
    seed: int = 0
    # Start a new run from the params of another run directory (trained, or imported with
    # `moe_jax.interop import`): its latest checkpoint, or init_step; a fresh optimizer state,
    # data position and step 0. The source is only read. Its architecture (model, attention,
    # moe, data.tokenizer) must be this config's: start from its config, `train.py
    # SRC/config.yaml init_from=SRC run_dir=NEW ...`. Its tokenizer is the new run's. Ignored
    # once run_dir has checkpoints of its own (it resumes them).
    init_from: str | None = None
    init_step: int | None = None  # the source's checkpoint to start from; None: its latest

    # Derived architecture facts, used by the model, the summary and the tests.
    @property
    def head_dim(self) -> int:
        a = self.attention
        return a.head_dim if a.head_dim is not None else self.model.d_model // a.n_heads

    def uses_rope(self, layer: int) -> bool:
        n = self.attention.nope_interval
        return not (n > 0 and (layer + 1) % n == 0)

    def is_moe(self, layer: int) -> bool:
        return self.moe.n_experts > 0 and (layer + 1) % self.moe.interleave_step == 0

    @property
    def layer_period(self) -> int:
        """Smallest block of layers whose (RoPE, MoE) pattern repeats."""
        return math.lcm(max(self.attention.nope_interval, 1), self.moe.interleave_step)


# ----------------------------------------------------------------------------- loading


def _suggest(key: str, parent: object) -> str:
    names = [f.name for f in fields(parent)] if is_dataclass(parent) else []
    close = difflib.get_close_matches(key, names, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"


def _node_at(path: str) -> object:
    node: object = Config
    for part in path.split(".") if path else []:
        sub = {f.name: f for f in fields(node)}.get(part) if is_dataclass(node) else None
        if sub is None:
            return None
        node = sub.default_factory() if callable(sub.default_factory) else sub.default
    return node() if isinstance(node, type) else node


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    full_key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError) and full_key:
        parent, _, key = full_key.rpartition(".")
        hint = _suggest(key, _node_at(parent))
        return ConfigError(f"unknown config key '{full_key}' in {source}{hint}")
    first_line = str(err).splitlines()[0]
    where = f" for '{full_key}'" if full_key else ""
    return ConfigError(f"bad config value{where} in {source}: {first_line}")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Schema defaults <- YAML file at `path` <- `key.sub=value` overrides, then validated."""
    cfg = OmegaConf.structured(Config)
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(
                f"config file '{path}' does not exist; pass a YAML file from configs/"
            )
        if not path.is_file():
            raise ConfigError(f"config path '{path}' is not a file; pass a YAML file from configs/")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as e:  # yaml.YAMLError and friends
            detail = " ".join(str(e).split())
            raise ConfigError(f"config file '{path}' is not valid YAML: {detail}") from None
        if not isinstance(file_cfg, type(OmegaConf.create({}))):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
        try:
            cfg = OmegaConf.merge(cfg, file_cfg)
        except OmegaConfBaseException as e:
            raise _explain(e, str(path)) from None
    return _validated(_merge_overrides(cfg, overrides))


def _validated(cfg) -> Config:
    """The OmegaConf config as a validated Config."""
    try:
        result = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _explain(e, "config") from None
    validate(result)
    return result


def _merge_overrides(cfg, overrides: Sequence[str]):
    """An OmegaConf config <- `key.sub=value` overrides, each checked against the schema."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _explain(e, f"override '{item}'") from None
        except yaml.YAMLError as e:  # the value is parsed as YAML: `{`, `,,` ...
            detail = " ".join(str(e).split())
            raise ConfigError(
                f"override '{item}' has a value that is not valid YAML ({detail}); put the "
                f"value in double quotes inside the argument: '{key}=\"...\"'"
            ) from None
    return cfg


# What sampling may change in a run's saved config: where and how it runs, not what the
# weights mean (the mesh, the compute dtype, the sample section).
SAMPLING_OVERRIDES = ("mesh.", "sample.", "model.dtype=")


def sampling_config(saved: Config, overrides: Sequence[str]) -> Config:
    """A run's saved config <- sampling overrides (SAMPLING_OVERRIDES only), validated. Call
    with `saved=Config()` to check overrides before a run is read."""
    for item in overrides:
        if not item.startswith(SAMPLING_OVERRIDES):
            key = item.partition("=")[0]
            raise ConfigError(
                f"'{key}' cannot be set when sampling: the run's checkpoint fixes it; set "
                "mesh.*, model.dtype or sample.* (e.g. mesh.expert=2 sample.weights=int8)"
            )
    return _validated(_merge_overrides(OmegaConf.structured(saved), overrides))


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_yaml(text: str) -> Config:
    """Inverse of `config_to_yaml` (used for configs saved inside run directories)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
        result = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _explain(e, "saved config") from None
    validate(result)
    return result


def cli_config(argv: Sequence[str], default_path: str | Path | None) -> Config:
    """For the CLIs: `[CONFIG.yaml] [key=value ...]`; a bad config prints one line and exits 2."""
    args = list(argv)
    path = default_path
    if args and "=" not in args[0]:
        path = args.pop(0)
    try:
        return load_config(path, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# ----------------------------------------------------------------------------- validation


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _one_of(value: str, allowed: Sequence[str], key: str) -> None:
    _require(value in allowed, f"{key}='{value}' is not supported; use one of {', '.join(allowed)}")


def _positive(obj: object, section: str, names: Sequence[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(v > 0, f"{section}.{n} must be positive, got {v}")


# Logits divided by the temperature stay finite in float32 (|logit| < 1e30) inside this range.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
INT32_MAX = 2**31 - 1  # sizes and counts index int32 arrays
SCHEDULES = ("cosine", "linear", "wsd")  # train.schedule (train_step.lr_schedule)
WEIGHT_KINDS = ("auto", "float32", "bfloat16", "int8")  # sample.weights (moe_jax/weights.py)
SEEDS = ("seed", "sample.seed")  # PRNG keys take 32 bits: larger seeds would collide
SFT_FORMATS = ("none", "prompt_completion", "chat")  # data.sft (moe_jax/data/sft.py)


def _numbers_in_range(obj: object, prefix: str = "") -> None:
    """Every float of the config is finite and every int fits the arrays it sizes."""
    for f in fields(obj):
        v, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(v):
            _numbers_in_range(v, f"{key}.")
        elif isinstance(v, float):
            _require(math.isfinite(v), f"{key} must be a finite number, got {v}")
        elif isinstance(v, int) and not isinstance(v, bool):
            if key in SEEDS:
                _require(0 <= v < 2**32, f"{key} must be within [0, 2^32), got {v}")
            else:
                _require(abs(v) <= INT32_MAX, f"{key} must be within +-{INT32_MAX:,}, got {v}")


def _check_remat_names(m: ModelConfig) -> None:
    save, offload = m.remat_saved, m.remat_offloaded
    for key, listed in (("model.remat_save", save), ("model.remat_offload", offload)):
        for name in listed:
            _require(
                name in REMAT_NAMES,
                f"{key} names '{name}', which the model does not name; choose from "
                f"{', '.join(REMAT_NAMES)}",
            )
    both = sorted(set(save) & set(offload))
    _require(
        not both,
        f"{', '.join(both)} is in both model.remat_save and model.remat_offload; "
        "keep each name in one of them",
    )
    _require(
        m.remat != "none" or not (save or offload),
        "model.remat_save / remat_offload choose what remat dots or full keeps; with remat=none "
        "everything is kept: set model.remat=full (or dots) too",
    )


def validate(cfg: Config) -> None:
    m, a, e, t, mesh = cfg.model, cfg.attention, cfg.moe, cfg.train, cfg.mesh
    _numbers_in_range(cfg)
    _positive(m, "model", ["vocab_size", "d_model", "n_layers", "max_seq_len", "norm_eps"])
    _positive(a, "attention", ["n_heads", "n_kv_heads", "rope_theta"])
    _one_of(m.dtype, DTYPES, "model.dtype")
    _one_of(m.remat, REMAT_POLICIES, "model.remat")
    _require(
        m.remat == "none" or m.scan_layers,
        f"model.remat={m.remat} needs model.scan_layers=true (unrolled layers give XLA "
        "freedom to recompute in the forward, which saves no memory); set both or remat=none",
    )
    _check_remat_names(m)
    _one_of(a.rope_style, ("half", "interleaved"), "attention.rope_style")
    _one_of(a.qk_norm, ("none", "rms", "l2"), "attention.qk_norm")
    _one_of(a.rope_scaling.type, ("none", "linear", "llama3"), "attention.rope_scaling.type")
    _one_of(e.score, ("softmax", "sigmoid"), "moe.score")
    _one_of(e.route_scale, ("output", "input"), "moe.route_scale")
    _one_of(a.impl, IMPLS["attention"], "attention.impl")
    _one_of(e.impl, IMPLS["moe"], "moe.impl")
    _one_of(e.exchange, EXCHANGES, "moe.exchange")
    _one_of(cfg.mesh.weight_gather, WEIGHT_GATHERS, "mesh.weight_gather")
    _require(
        cfg.mesh.gather_group >= -1,
        f"mesh.gather_group must be -1 (auto), 0 (whole axes) or a group size, got "
        f"{cfg.mesh.gather_group}",
    )
    _require(e.row_chunks >= 1, f"moe.row_chunks must be >= 1, got {e.row_chunks}")
    _require(
        e.row_chunks == 1 or e.impl in ("auto", "ragged", "megablox"),
        f"moe.row_chunks={e.row_chunks} chunks the grouped experts' rows; moe.impl={e.impl} "
        "has none: use moe.impl=ragged, megablox or auto, or moe.row_chunks=1",
    )
    kept = set(m.remat_saved) | set(m.remat_offloaded)
    _require(
        e.row_chunks == 1 or not kept & {"expert_gate_up", "expert_out"},
        f"moe.row_chunks={e.row_chunks} recomputes the experts' gate/up products chunk by "
        "chunk, so model.remat_save / remat_offload cannot keep expert_gate_up or expert_out: "
        "drop those names or set moe.row_chunks=1",
    )
    _one_of(t.moments_dtype, ("float32", "bfloat16"), "train.moments_dtype")
    # A path is read (and its existence checked) when a run starts: a saved config keeps the
    # path it was started with, and a moved run reads its own copy of the files.
    _require(
        cfg.data.tokenizer.strip() != "",
        "data.tokenizer is empty; use byte, char, or the path of a tokenizer.json / "
        "tokenizer.model file or of a directory holding one",
    )

    _require(
        a.n_heads % a.n_kv_heads == 0,
        f"attention.n_heads ({a.n_heads}) must be divisible by attention.n_kv_heads "
        f"({a.n_kv_heads}) for grouped-query attention",
    )
    if a.head_dim is None:
        _require(
            m.d_model % a.n_heads == 0,
            f"model.d_model ({m.d_model}) must be divisible by attention.n_heads ({a.n_heads}), "
            "or set attention.head_dim explicitly",
        )
    _require(cfg.head_dim > 0, f"attention.head_dim must be positive, got {cfg.head_dim}")
    if any(cfg.uses_rope(i) for i in range(m.n_layers)):
        _require(
            cfg.head_dim % 2 == 0,
            f"head_dim ({cfg.head_dim}) must be even for RoPE; change attention.head_dim",
        )
    _require(a.nope_interval >= 0, f"attention.nope_interval must be >= 0, got {a.nope_interval}")
    _require(a.chunk_size >= 0, f"attention.chunk_size must be >= 0 (0 = off), got {a.chunk_size}")
    _require(
        a.sliding_window >= 0,
        f"attention.sliding_window must be >= 0 (0 = off), got {a.sliding_window}",
    )
    if a.temperature_tuning:
        _positive(a, "attention", ["floor_scale"])
    if a.rope_scaling.type != "none":
        _positive(a.rope_scaling, "attention.rope_scaling", ["factor"])
    if a.rope_scaling.type == "llama3":
        _require(
            a.rope_scaling.high_freq_factor >= a.rope_scaling.low_freq_factor,
            "attention.rope_scaling.high_freq_factor must be >= low_freq_factor",
        )

    _require(e.n_experts >= 0, f"moe.n_experts must be >= 0 (0 = dense model), got {e.n_experts}")
    _require(e.interleave_step >= 1, f"moe.interleave_step must be >= 1, got {e.interleave_step}")
    if e.n_experts > 0:
        _require(
            1 <= e.top_k <= e.n_experts,
            f"moe.top_k ({e.top_k}) must be between 1 and moe.n_experts ({e.n_experts})",
        )
        _positive(e, "moe", ["expert_hidden"])
        _require(
            e.shared_expert_hidden >= 0,
            f"moe.shared_expert_hidden must be >= 0, got {e.shared_expert_hidden}",
        )
    if any(not cfg.is_moe(i) for i in range(m.n_layers)):
        _positive(m, "model", ["ffn_hidden"])

    for axis in ("data", "fsdp", "expert", "tensor"):
        v = getattr(mesh, axis)
        _require(v >= 1 or v == -1, f"mesh.{axis} must be >= 1 or -1 (the rest), got {v}")
    _require(
        sum(getattr(mesh, ax) == -1 for ax in ("data", "fsdp", "expert", "tensor")) <= 1,
        "at most one mesh axis may be -1",
    )
    _require(mesh.slices >= 1, f"mesh.slices must be >= 1, got {mesh.slices}")
    _require(
        mesh.num_processes >= 0,
        f"mesh.num_processes must be >= 0 (0 = from the environment), got {mesh.num_processes}",
    )
    _require(
        mesh.process_id >= -1 and (mesh.num_processes == 0 or mesh.process_id < mesh.num_processes),
        f"mesh.process_id ({mesh.process_id}) must be within [0, mesh.num_processes) "
        f"(num_processes {mesh.num_processes}), or -1 for the environment's",
    )
    if e.n_experts > 0 and mesh.expert > 0:
        _require(
            e.n_experts % mesh.expert == 0,
            f"moe.n_experts ({e.n_experts}) must be divisible by mesh.expert ({mesh.expert})",
        )

    _positive(t, "train", ["steps", "batch_size", "seq_len", "grad_accum", "lr", "log_every"])
    _positive(t, "train", ["eval_every", "eval_batches"])
    _require(
        t.batch_size % t.grad_accum == 0,
        f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum ({t.grad_accum})",
    )
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})",
    )
    _require(
        t.loss_chunk in (-1, 0) or (t.loss_chunk > 0 and t.seq_len % t.loss_chunk == 0),
        f"train.loss_chunk ({t.loss_chunk}) must be -1 (auto), 0 (off) or divide train.seq_len "
        f"({t.seq_len})",
    )
    if t.warmup_steps is not None:
        _require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
        _require(
            t.warmup_steps <= t.steps,
            f"train.warmup_steps ({t.warmup_steps}) exceeds train.steps ({t.steps}); set it to "
            f"at most {t.steps}, or to null for the default, min({DEFAULT_WARMUP_STEPS}, "
            "train.steps // 10)",
        )
    _require(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio must be within [0, 1]")
    _one_of(t.schedule, SCHEDULES, "train.schedule")
    _require(
        0.0 < t.decay_fraction <= 1.0,
        f"train.decay_fraction must be within (0, 1], got {t.decay_fraction}",
    )
    if t.schedule == "wsd":
        _require(
            t.warmup + t.decay_steps <= t.steps,
            f"train.schedule=wsd: warmup ({t.warmup}) and decay ({t.decay_steps} = "
            f"decay_fraction {t.decay_fraction} x {t.steps} steps) exceed train.steps; lower "
            "train.decay_fraction or train.warmup_steps",
        )
    _require(
        t.resume_step >= 0, f"train.resume_step must be >= 0 (0 = the latest), got {t.resume_step}"
    )
    _require(
        0.0 < cfg.data.val_fraction < 1.0,
        f"data.val_fraction must be within (0, 1), got {cfg.data.val_fraction}",
    )
    for section, obj, names in (
        ("moe", e, ["lb_loss_weight", "z_loss_weight"]),
        ("train", t, ["weight_decay", "clip_norm", "logit_z_loss"]),
    ):
        for n in names:
            _require(getattr(obj, n) >= 0, f"{section}.{n} must be >= 0, got {getattr(obj, n)}")
    for n in ("b1", "b2"):
        _require(0.0 <= getattr(t, n) < 1.0, f"train.{n} must be within [0, 1)")
    _positive(t, "train", ["eps"])
    _positive(m, "model", ["init_std"])
    _require(m.vision >= 0, f"model.vision must be >= 0 (0 = no image inputs), got {m.vision}")
    _require(
        cfg.data.num_workers >= 0, f"data.num_workers must be >= 0, got {cfg.data.num_workers}"
    )
    _positive(cfg.data, "data", ["embedded_max_bytes"])
    if cfg.data.mixture is not None:
        _require(
            cfg.data.path is None,
            "data.mixture and data.path are both set; train on one prepared dataset with "
            "data.path=DIR or on several with data.mixture, and set the other to null",
        )
        paths = [path for path, _ in cfg.data.mixture_entries]  # ConfigError if malformed
        _require(
            len(set(paths)) == len(paths),
            f"data.mixture names a directory twice ({cfg.data.mixture}); give each one entry "
            "with the sum of its weights",
        )
    _require(
        cfg.data.document_mask or not cfg.data.document_positions,
        "data.document_positions=true needs data.document_mask=true: positions that restart "
        "while attention crosses documents give an earlier document's keys later positions "
        "than the query; set data.document_positions=false too",
    )
    _one_of(cfg.data.sft, SFT_FORMATS, "data.sft")
    if cfg.data.sft != "none":
        _require(
            cfg.data.path is not None and cfg.data.mixture is None,
            f"data.sft={cfg.data.sft} reads JSONL files: name them with data.path (and set "
            "data.mixture to null)",
        )
        _require(
            cfg.data.document_mask,
            f"data.sft={cfg.data.sft} packs several examples into a window, which needs "
            "data.document_mask=true to keep them apart",
        )
    if cfg.init_step is not None:
        _require(cfg.init_from is not None, "init_step is set but init_from is not; set both")
        _require(cfg.init_step >= 0, f"init_step must be >= 0, got {cfg.init_step}")
    _require(
        cfg.init_from is None or cfg.init_from.strip() != "",
        "init_from is empty; name the run directory to start from, or set it to null",
    )
    _positive(cfg.checkpoint, "checkpoint", ["every", "keep"])
    s = cfg.sample
    _require(
        s.temperature == 0 or MIN_TEMPERATURE <= s.temperature <= MAX_TEMPERATURE,
        f"sample.temperature must be 0 (greedy) or within [{MIN_TEMPERATURE:g}, "
        f"{MAX_TEMPERATURE:g}], got {s.temperature}",
    )
    _require(s.top_k >= 0, f"sample.top_k must be >= 0 (0 = off), got {s.top_k}")
    _one_of(s.weights, WEIGHT_KINDS, "sample.weights")
    _require(0.0 < s.top_p <= 1.0, f"sample.top_p must be within (0, 1], got {s.top_p}")
    _positive(s, "sample", ["max_new_tokens", "batch_size", "prompt_len"])
