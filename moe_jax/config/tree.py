"""The `Config` tree: its sections, the architecture facts derived from them, and the checks
that span sections (`Config.check`: each section's own checks, then these)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_jax.config.checks import numbers_in_range, positive, require
from moe_jax.config.lora import LORA_TARGETS, LoRAConfig
from moe_jax.config.mesh import MeshConfig
from moe_jax.config.model import (
    AttentionConfig,
    ModelConfig,
    MoEConfig,
)
from moe_jax.config.rl import RLConfig
from moe_jax.config.run import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    SampleConfig,
    TrainConfig,
)


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    rl: RLConfig = field(default_factory=RLConfig)  # train.objective=grpo (moe_jax/posttrain/rl/)
    run_dir: str = "runs/tiny"  # checkpoints, metrics, config; resumed when it has some
    seed: int = 0  # of the params' initialisation and the data order
    # Start a new run from the params of another run directory (trained, or imported with
    # `moe_jax.interop import`): its latest checkpoint, or init_step; a fresh optimizer state,
    # data position and step 0. The source is only read. Its architecture (model, attention,
    # moe, data.tokenizer) is the new run's (train/init_from.py), as is its tokenizer: e.g.
    # `train.py finetune/sft init_from=SRC run_dir=NEW data.path=...`. Ignored once run_dir
    # has checkpoints of its own (it resumes them).
    init_from: str | None = None
    init_step: int | None = None  # the source's checkpoint to start from; None: its latest

    # Derived architecture facts, used by the model, the summary and the tests.
    @property
    def head_dim(self) -> int:
        a = self.attention
        return a.head_dim if a.head_dim is not None else self.model.d_model // a.n_heads

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones): int(head_dim x
        attention.partial_rotary_factor), as transformers counts them."""
        return int(self.head_dim * self.attention.partial_rotary_factor)

    def uses_rope(self, layer: int) -> bool:
        n = self.attention.nope_interval
        return not (n > 0 and (layer + 1) % n == 0)

    def uses_window(self, layer: int) -> bool:
        """Whether `layer` attends within attention.sliding_window (not every
        full_attention_interval-th layer)."""
        a = self.attention
        n = a.full_attention_interval
        return a.sliding_window > 0 and not (n > 0 and (layer + 1) % n == 0)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention layer (attention.linear: all but every
        full_attention_interval-th layer)."""
        a = self.attention
        n = a.full_attention_interval
        return a.linear != "none" and not (n > 0 and (layer + 1) % n == 0)

    def runs_indexer(self, layer: int) -> bool:
        """Whether `layer` runs its own DSA indexer (attention.index_topk > 0); False for a
        layer reusing an earlier one's selection (GLM's sharing) and for dense attention."""
        a = self.attention
        own = max(layer - a.index_skip_topk_offset + 1, 0) % a.index_topk_freq == 0
        return a.index_topk > 0 and own

    @property
    def prefix_layers(self) -> int:
        """The layers before the repeating pattern, each its own (outside the layer scan):
        moe.first_dense_layers dense ones, then moe.hash_layers hash-routed MoE layers."""
        return self.moe.first_dense_layers + self.moe.hash_layers

    def is_hashed(self, layer: int) -> bool:
        """Whether `layer` routes by DeepSeek-V4's token-id table (moe.hash_layers)."""
        return self.moe.first_dense_layers <= layer < self.prefix_layers

    def is_moe(self, layer: int) -> bool:
        e = self.moe
        return (
            e.n_experts > 0
            and layer >= e.first_dense_layers
            and (layer + 1) % e.interleave_step == 0
        )

    @property
    def layer_period(self) -> int:
        """Smallest block of layers whose (RoPE, window or linear, indexer, MoE) pattern
        repeats."""
        a = self.attention
        index = a.index_topk_freq if a.index_topk > 0 else 1
        intervals = (a.nope_interval, a.full_attention_interval, index, self.moe.interleave_step)
        return math.lcm(*(max(n, 1) for n in intervals))

    def check(self) -> None:
        """Every section's own checks, then the checks that span sections."""
        numbers_in_range(self)
        for section in (self.model, self.attention, self.moe, self.mesh, self.train,
                        self.data, self.checkpoint, self.sample, self.eval,
                        self.lora, self.rl):  # fmt: skip
            section.check()
        _check_across_sections(self)


def _check_across_sections(cfg: Config) -> None:
    m, a, e = cfg.model, cfg.attention, cfg.moe
    if a.kind == "gqa":  # mla sizes its heads by its own fields (AttentionConfig)
        _check_head_dim(cfg)
    require(
        e.first_dense_layers <= m.n_layers,
        f"moe.first_dense_layers ({e.first_dense_layers}) exceeds model.n_layers ({m.n_layers})",
    )
    if e.hash_layers:
        _check_hash_layers(cfg)
    if any(not cfg.is_moe(i) for i in range(m.n_layers)):
        positive(m, "model", ["ffn_hidden"])
    kept = set(m.remat_saved) | set(m.remat_offloaded)
    require(
        e.row_chunks == 1 or not kept & {"expert_gate_up", "expert_out"},
        f"moe.row_chunks={e.row_chunks} recomputes the experts' gate/up products chunk by "
        "chunk, so model.remat_save / remat_offload cannot keep expert_gate_up or expert_out: "
        "drop those names or set moe.row_chunks=1",
    )
    if e.n_experts > 0 and cfg.mesh.expert > 0:
        require(
            e.n_experts % cfg.mesh.expert == 0,
            f"moe.n_experts ({e.n_experts}) must be divisible by mesh.expert ({cfg.mesh.expert})",
        )
    require(
        cfg.train.seq_len <= m.max_seq_len,
        f"train.seq_len ({cfg.train.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})",
    )
    if cfg.init_step is not None:
        require(cfg.init_from is not None, "init_step is set but init_from is not; set both")
        require(cfg.init_step >= 0, f"init_step must be >= 0, got {cfg.init_step}")
    require(
        cfg.init_from is None or cfg.init_from.strip() != "",
        "init_from is empty; name the run directory to start from, or set it to null",
    )
    require(
        cfg.train.epochs is None or cfg.data.sft != "none",
        "train.epochs counts passes over fine-tuning rows (data.sft: SFT examples, DPO pairs, "
        "GRPO prompts); a text corpus or token store trains for train.steps: set "
        "train.epochs=null",
    )
    _check_objective(cfg)
    _check_lora_targets(cfg)
    if a.index_topk > 0:
        _check_index_sharing(cfg)
    _check_indexer_training(cfg)
    _check_muon(cfg)
    if cfg.mesh.context > 1:  # -1 is checked once resolved (sharding.mesh_shape)
        check_context(cfg, cfg.mesh.context)


def check_context(cfg: Config, n: int, inference: bool = False) -> None:
    """What a context axis of `n` shards (model/context_parallel.py) runs today; the rest is
    refused by name, before anything is compiled or written."""
    a, t = cfg.attention, cfg.train
    require(
        not inference,
        f"mesh.context={n} splits training sequences; the sampler's prefill under a context "
        "axis is not supported yet: sample with mesh.context=1",
    )
    require(
        t.seq_len % (2 * n) == 0,
        f"train.seq_len ({t.seq_len}) must be divisible by 2 x mesh.context ({2 * n}): the "
        "load-balanced layout cuts every sequence into that many equal chunks",
    )
    unsupported = [
        (t.objective != "lm", f"train.objective={t.objective}", "train.objective=lm"),
        (cfg.model.mtp_depth > 0, "model.mtp_depth > 0 (its loss shifts tokens along the "
         "sequence)", "model.mtp_depth=0"),
        (cfg.moe.seq_aux_loss_weight > 0, "moe.seq_aux_loss_weight > 0 (a per-sequence "
         "statistic)", "moe.seq_aux_loss_weight=0"),
        (cfg.model.vision > 0, "model.vision > 0 (images placed by order in the row)",
         "model.vision=0"),
        (a.linear != "none", f"attention.linear={a.linear} (its recurrent state would pass "
         "between the shards)", "attention.linear=none"),
        (a.index_topk > 0, "attention.index_topk > 0 (the indexer picks among every "
         "shard's keys)", "attention.index_topk=0"),
        (a.impl not in ("auto", "blocked"), f"attention.impl={a.impl} (the context axis "
         "runs its own XLA attention)", "attention.impl=auto"),
        (bool(cfg.eval.tasks.strip()), "eval.tasks (the harness scores rows on the training "
         "mesh in row order, not the axis's layout)", "eval.tasks=''"),
    ]  # fmt: skip
    for bad, what, fix in unsupported:
        require(
            not bad,
            f"mesh.context={n} does not support {what} yet; set {fix} or mesh.context=1",
        )


def _check_hash_layers(cfg: Config) -> None:
    """DeepSeek-V4's hash-routed layers: MoE layers right after the dense prefix."""
    m, e = cfg.model, cfg.moe
    require(
        e.n_experts > 0 and e.interleave_step == 1,
        "moe.hash_layers routes the first MoE layers by token id: it needs moe.n_experts > 0 "
        "and every layer after the dense prefix MoE (moe.interleave_step=1)",
    )
    require(
        cfg.prefix_layers <= m.n_layers,
        f"moe.first_dense_layers + moe.hash_layers ({cfg.prefix_layers}) exceeds "
        f"model.n_layers ({m.n_layers})",
    )
    require(
        m.mtp_depth == 0 or not cfg.is_hashed(m.n_layers - 1),
        "model.mtp_depth > 0 builds MTP layers of the last layer's kind, hash-routed here; "
        "lower moe.hash_layers below the MoE layers' count, or set model.mtp_depth=0",
    )


def _check_index_sharing(cfg: Config) -> None:
    """GLM's shared selections fit the layer scan and the MTP layers: the pattern repeats
    after the dense prefix, and an MTP layer (the last layer's kind) runs its own indexer."""
    a, k = cfg.attention, cfg.prefix_layers
    hashed = " + moe.hash_layers" if cfg.moe.hash_layers else ""
    require(
        a.index_topk_freq == 1 or a.index_skip_topk_offset <= k + 1,
        f"attention.index_skip_topk_offset ({a.index_skip_topk_offset}) must be at most "
        f"moe.first_dense_layers{hashed} + 1 ({k + 1}) with index_topk_freq "
        f"{a.index_topk_freq}: the layers after the dense prefix repeat one pattern",
    )
    require(
        cfg.model.mtp_depth == 0 or cfg.runs_indexer(cfg.model.n_layers - 1),
        "model.mtp_depth > 0 builds MTP layers of the last layer's kind, which reuses an "
        "earlier layer's DSA selection here (attention.index_topk_freq); set mtp_depth=0 or "
        "a pattern whose last layer runs its own indexer",
    )


def _check_indexer_training(cfg: Config) -> None:
    """train.indexer_stage trains a DSA indexer; the warm-up freezes all else, the routers'
    correction bias (updated outside the gradient) and the adapters of LoRA included."""
    t, e = cfg.train, cfg.moe
    if t.indexer_stage == "none":
        return
    require(
        cfg.attention.index_topk > 0,
        f"train.indexer_stage={t.indexer_stage} trains DeepSeek sparse attention's indexer; "
        "set attention.index_topk > 0 (with its index_* sizes) or indexer_stage=none",
    )
    require(
        t.indexer_stage != "warmup" or not e.correction_bias or e.bias_update_rate == 0,
        "train.indexer_stage=warmup freezes every weight but the indexer's; set "
        "moe.bias_update_rate=0 (the correction bias moves outside the gradient)",
    )
    require(
        t.indexer_stage != "warmup" or cfg.lora.rank == 0,
        "train.indexer_stage=warmup trains the indexer alone; set lora.rank=0",
    )


def _check_muon(cfg: Config) -> None:
    """train.optimizer=muon trains full matrices, and train.qk_clip rescales the query and key
    projections of GQA and MLA layers (train/muon.py, train/qk_clip.py): what neither covers
    is refused by name."""
    t, a, m = cfg.train, cfg.attention, cfg.model
    require(
        t.optimizer != "muon" or cfg.lora.rank == 0,
        "train.optimizer=muon orthogonalises whole weight matrices, not LoRA's rank-r adapters; "
        "set train.optimizer=adamw for LoRA (or lora.rank=0 for a full fine-tune with Muon)",
    )
    if not t.qk_clip:
        return
    unsupported = [
        (a.qk_norm != "none", f"attention.qk_norm={a.qk_norm} (the norm undoes a scaled "
         "projection; QK-norm already bounds the logits)", "attention.qk_norm=none"),
        (a.linear != "none", f"attention.linear={a.linear} (linear layers have no softmax "
         "logits)", "attention.linear=none"),
        (a.impl not in ("auto", "blocked"), f"attention.impl={a.impl} (the max logit comes "
         "from the blocked kernel)", "attention.impl=blocked"),
        (cfg.mesh.context > 1 or cfg.mesh.context == -1, "mesh.context > 1 (its attention "
         "returns no max logit)", "mesh.context=1"),
        (m.mtp_depth > 0, "model.mtp_depth > 0 (the MTP layers' attention is not clipped)",
         "model.mtp_depth=0"),
        (a.index_topk > 0, "attention.index_topk > 0 (DeepSeek sparse attention's layers "
         "return no max logit)", "attention.index_topk=0"),
        (t.objective != "lm", f"train.objective={t.objective}", "train.objective=lm"),
        (cfg.lora.rank > 0, "lora.rank > 0 (the base's projections are frozen)", "lora.rank=0"),
    ]  # fmt: skip
    for bad, what, fix in unsupported:
        require(not bad, f"train.qk_clip does not support {what}; set {fix} or train.qk_clip=0")


def lora_groups(cfg: Config) -> tuple[str, ...]:
    """The lora.targets groups this model has weights of (model/lora.py's GROUP_WEIGHTS):
    attention in every layer, mlp in the dense layers, experts in the MoE layers, shared in
    those with a shared expert. (The MTP layers are of the last layer's kind.)"""
    moe = [cfg.is_moe(i) for i in range(cfg.model.n_layers)]
    has = {"attention": bool(moe), "mlp": not all(moe), "experts": any(moe),
           "shared": any(moe) and cfg.moe.shared_expert_hidden > 0}  # fmt: skip
    return tuple(g for g in LORA_TARGETS if has[g])


def _check_lora_targets(cfg: Config) -> None:
    """Where the config holds the model's architecture, `check_lora_targets` (an init_from
    Hugging Face directory brings its own, checked when the model is built)."""
    if cfg.init_from is None:
        check_lora_targets(cfg)


def check_lora_targets(cfg: Config) -> None:
    """A target this model has no weight of would train nothing: refused by name (the config
    check, and `Transformer` for a config whose architecture came from elsewhere)."""
    if cfg.lora.rank == 0:
        return
    have = lora_groups(cfg)
    for target in cfg.lora.targets:
        require(
            target in have,
            f"lora.targets has '{target}', which matches no weight of this model (its "
            f"targets: {', '.join(have)}); drop '{target}' from lora.targets",
        )


def _check_objective(cfg: Config) -> None:
    """train.objective=dpo trains on preference pairs (against the base with LoRA's adapters
    off, or a frozen copy of the initial params: moe_jax/posttrain/reference_policy.py);
    grpo on prompts (`_check_grpo`)."""
    _check_grpo(cfg)
    dpo = cfg.train.objective == "dpo"
    require(
        dpo == (cfg.data.sft == "preference"),
        "train.objective=dpo trains on preference pairs (data.sft=preference) and those pairs "
        "train nothing else; set both or neither",
    )
    if dpo:
        require(
            cfg.train.grad_accum == 1 and cfg.model.mtp_depth == 0,
            "train.objective=dpo runs whole batches of pairs without the MTP loss: set "
            "train.grad_accum=1 and model.mtp_depth=0",
        )


def _check_grpo(cfg: Config) -> None:
    grpo, rl = cfg.train.objective == "grpo", cfg.rl
    require(
        grpo == (cfg.data.sft == "prompts"),
        "train.objective=grpo samples from prompts (data.sft=prompts) and those prompts "
        "train nothing else; set both or neither",
    )
    require(
        grpo or not rl.rollout_engine,
        "rl.rollout_engine=true draws GRPO's rollouts, and train.objective="
        f"{cfg.train.objective} draws none; set train.objective=grpo or drop it",
    )
    if grpo:
        require(rl.rewards, "train.objective=grpo needs rl.rewards=[pkg.module:function, ...]")
        # model.mtp_depth > 0 is taken: the MTP loss is off and the MTP layers stay frozen
        # (MiMo's RL; the sampler never runs them, so there are no experts of theirs to replay)
        require(
            cfg.train.grad_accum == 1,
            "train.objective=grpo splits a batch of rollouts with rl.minibatches, not "
            "train.grad_accum: set train.grad_accum=1",
        )
        rows = cfg.train.batch_size * rl.group_size
        require(
            rows % rl.minibatches == 0,
            f"rl.minibatches={rl.minibatches} does not divide a batch's {rows} rollouts "
            f"(train.batch_size x rl.group_size); pick a divisor of {rows}",
        )


def _check_head_dim(cfg: Config) -> None:
    m, a = cfg.model, cfg.attention
    if a.head_dim is None:
        require(
            m.d_model % a.n_heads == 0,
            f"model.d_model ({m.d_model}) must be divisible by attention.n_heads ({a.n_heads}), "
            "or set attention.head_dim explicitly",
        )
    require(cfg.head_dim > 0, f"attention.head_dim must be positive, got {cfg.head_dim}")
    if any(cfg.uses_rope(i) for i in range(m.n_layers)):
        require(
            cfg.head_dim % 2 == 0 or a.partial_rotary_factor < 1,
            f"head_dim ({cfg.head_dim}) must be even for RoPE; change attention.head_dim",
        )
        require(
            cfg.rotary_dim > 0 and cfg.rotary_dim % 2 == 0,
            f"attention.partial_rotary_factor ({a.partial_rotary_factor}) rotates "
            f"int(head_dim x factor) = {cfg.rotary_dim} of the {cfg.head_dim} dims of a head, "
            "which must be even and > 0; change attention.partial_rotary_factor",
        )


def validate(cfg: Config) -> None:
    """ConfigError, naming the fix, unless `cfg` is a possible configuration."""
    cfg.check()
