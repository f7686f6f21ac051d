"""How a run trains, reads data, saves, samples and is evaluated: the data, train, checkpoint,
sample and eval sections, each checking its own fields (the mesh section: mesh.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_jax.config.checks import (
    SEED_LIMIT,
    ConfigError,
    non_negative,
    one_of,
    positive,
    require,
)

DEFAULT_WARMUP_STEPS = 50  # train.warmup_steps=null: this many, at most a tenth of the run
SCHEDULES = ("cosine", "linear", "wsd")  # train.schedule (train_step.lr_schedule)
INDEXER_STAGES = ("none", "warmup", "sparse")  # train.indexer_stage
WEIGHT_KINDS = ("auto", "float32", "bfloat16", "int8", "mxfp4")  # sample.weights (weights.py)
# data.sft (moe_jax/data/sft.py; preference: DPO's pairs, moe_jax/data/preference.py)
SFT_FORMATS = ("none", "prompt_completion", "chat", "preference", "prompts")  # prompts: GRPO's
DPO_LOSSES = ("sigmoid", "ipo", "simpo")  # train.dpo_loss (dpo.py)
OPTIMIZERS = ("adamw", "muon")  # train.optimizer (train/step.py, train/muon.py)
OBJECTIVES = (
    "lm",
    "dpo",
    "grpo",
)  # train.objective (train/step.py, posttrain/dpo.py, posttrain/rl/grpo.py)
# train.trackers (moe_jax/observe/trackers.py); "jsonl" is always on, and may be named
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# Logits divided by the temperature stay finite in float32 (|logit| < 1e30) inside this range.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
# The sampling values' ranges, (name, test, range): the sample section, the sampler's
# arguments (moe_jax/inference/sampling.py) and sample.py's flags all check these.
SAMPLING_RANGES = (
    (
        "temperature",
        lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
        f"must be 0 (greedy) or within [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
    ),
    ("top_k", lambda v: v >= 0, "must be >= 0 (0 = off)"),
    ("top_p", lambda v: 0 < v <= 1, "must be within (0, 1] (1 = off)"),
    ("seed", lambda v: 0 <= v < SEED_LIMIT, "must be within [0, 2^32)"),
)


def sampling_problem(values: dict, prefix: str = "") -> str | None:
    """The first of `values` (name -> value; those SAMPLING_RANGES name) out of its range, as
    a message naming it after `prefix` ("sample.": the key; "--": the flag), or None."""
    for name, ok, wanted in SAMPLING_RANGES:
        if name in values and not ok(values[name]):
            shown = name.replace("_", "-") if prefix == "--" else name
            return f"{prefix}{shown} {wanted}, got {values[name]}"
    return None


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None  # text file(s) or glob(s), comma separated; None: embedded corpus
    # byte | char | PATH: a directory with tokenizer.json (Hugging Face) or tokenizer.model
    # (SentencePiece), or such a file; a run keeps a copy of its files (RUN_DIR/tokenizer/)
    tokenizer: str = "byte"
    val_fraction: float = 0.1  # the corpus's tail held out for validation
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
    # preference: DPO's pairs (train.objective=dpo; moe_jax/data/preference.py), lines
    # {"prompt": ..., "chosen": ..., "rejected": ...} of text, or of messages lists.
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

    def check(self) -> None:
        # A path is read (and its existence checked) when a run starts: a saved config keeps
        # the path it was started with, and a moved run reads its own copy of the files.
        require(
            self.tokenizer.strip() != "",
            "data.tokenizer is empty; use byte, char, or the path of a tokenizer.json / "
            "tokenizer.model file or of a directory holding one",
        )
        require(
            0.0 < self.val_fraction < 1.0,
            f"data.val_fraction must be within (0, 1), got {self.val_fraction}",
        )
        non_negative(self, "data", ["num_workers"])
        positive(self, "data", ["embedded_max_bytes"])
        if self.mixture is not None:
            require(
                self.path is None,
                "data.mixture and data.path are both set; train on one prepared dataset with "
                "data.path=DIR or on several with data.mixture, and set the other to null",
            )
            paths = [path for path, _ in self.mixture_entries]  # ConfigError if malformed
            require(
                len(set(paths)) == len(paths),
                f"data.mixture names a directory twice ({self.mixture}); give each one entry "
                "with the sum of its weights",
            )
        require(
            self.document_mask or not self.document_positions,
            "data.document_positions=true needs data.document_mask=true: positions that "
            "restart while attention crosses documents give an earlier document's keys later "
            "positions than the query; set data.document_positions=false too",
        )
        one_of(self.sft, SFT_FORMATS, "data.sft")
        if self.sft != "none":
            require(
                self.path is not None and self.mixture is None,
                f"data.sft={self.sft} reads JSONL files: name them with data.path (and set "
                "data.mixture to null)",
            )
            require(
                self.document_mask,
                f"data.sft={self.sft} packs several examples into a window, which needs "
                "data.document_mask=true to keep them apart",
            )


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600  # optimizer steps of the run (the LR schedule's length)
    # Passes over a fine-tune's rows (data.sft: SFT windows, DPO pairs, GRPO prompts) instead
    # of train.steps: the run takes ceil(epochs x rows / batch_size) steps, counted once the
    # data is read (config/epochs.py; grad_accum splits a step's rows, it adds none). null:
    # train.steps. A config that sets both is refused (config/loading.py).
    epochs: float | None = None
    batch_size: int = 16  # sequences a step (over every device and micro-batch)
    seq_len: int = 128  # tokens a training sequence
    grad_accum: int = 1  # micro-batches per step; batch_size must divide by it
    lr: float = 3e-3  # the peak learning rate, reached after the warmup
    # The LR after warmup (moe_jax/train/step.py: lr_schedule): cosine | linear decay to
    # min_lr_ratio * lr at train.steps, or wsd (warmup-stable-decay: lr held, then a linear
    # decay over the last decay_fraction of the steps)
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd's decay phase, a fraction of train.steps
    min_lr_ratio: float = 0.1  # the schedule's end: min_lr_ratio * lr
    # Steps of linear warmup to lr; None: DEFAULT_WARMUP_STEPS, at most a tenth of the run
    # (see `warmup`), so that any train.steps works and a short run is not mostly warmup
    warmup_steps: int | None = None
    weight_decay: float = 0.1  # AdamW's decoupled decay of matrices (never norms or biases)
    decay_embeddings: bool = False  # decay the token embedding too
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    clip_norm: float = 1.0  # gradient clipping by global norm; 0 = off
    # adamw | muon: Muon (moe_jax/train/muon.py) on the matmul weights, each expert's and
    # layer's matrix apart, with Nesterov momentum muon_momentum, muon_ns_steps Newton-Schulz
    # steps and its update scaled to RMS muon_rms (Moonlight's 0.2: AdamW's train.lr and
    # weight_decay carry over); AdamW (b1, b2, eps) on the embedding, head, norms, biases, router
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # see optimizer
    muon_ns_steps: int = 5  # see optimizer
    muon_rms: float = 0.2  # see optimizer
    # MuonClip's QK-clip threshold tau (moe_jax/train/qk_clip.py; Kimi K2: 100): after each
    # step, each attention head whose largest pre-softmax logit over the batch exceeded tau
    # has its query and key projections scaled down to bring it to tau. 0 or null = off.
    qk_clip: float | None = None
    # dtype the Adam moments are stored in (float32 | bfloat16); the update is computed in
    # float32 either way. bfloat16 saves 4 of the 12 bytes per parameter of the train state.
    moments_dtype: str = "float32"
    logit_z_loss: float = 0.0  # weight of mean(logsumexp(output logits)^2) in the loss; 0 = off
    # Weight (lambda) of the multi-token prediction loss, lambda / model.mtp_depth times the
    # sum of the MTP depths' cross-entropies (moe_jax/model/mtp.py); DeepSeek-V3: 0.3 for its
    # first 10T tokens, then 0.1. Unused with model.mtp_depth=0.
    mtp_loss_weight: float = 0.3
    # Training DeepSeek sparse attention's indexer (attention.index_topk; DeepSeek-V3.2's two
    # stages): none | warmup (the attention dense, the indexer fitted to its distribution by
    # KL, every other weight frozen) | sparse (the attention over the selection; the LM loss
    # trains the model, the KL over the selected keys the indexer, each alone). The KL's
    # weight: indexer_loss_weight (the indexer's gradients are its alone, so it scales them).
    indexer_stage: str = "none"
    indexer_loss_weight: float = 1.0  # see indexer_stage
    # Positions per chunk of the output head in the loss (moe_jax/model/loss.py): the [B, T, V]
    # float32 logits are never held whole, for one more head matmul in the backward; must
    # divide train.seq_len. 0 = all positions at once; -1 = auto (moe_jax/backends.py: 0 on
    # CPU, up to 1024 on GPU / TPU).
    loss_chunk: int = -1
    eval_every: int = 100  # steps between validation losses (and one at the end)
    eval_batches: int = 8  # validation batches each time
    log_every: int = 10  # steps between metric lines (metrics.jsonl, trackers)
    peak_flops: float = 0.0  # FLOP/s of one device (one host on CPU) for MFU; 0 = measure
    # Where the metrics go besides RUN_DIR/metrics.jsonl (always written; observe/trackers.py):
    # tensorboard (RUN_DIR/tb) | wandb (its run id kept in RUN_DIR, so a resume continues the
    # same run; WANDB_MODE=offline works) | mlflow (tracker_uri, or a file store RUN_DIR/mlruns)
    trackers: tuple[str, ...] = ("tensorboard",)
    tracker_project: str = "moe_jax"  # the W&B project / MLflow experiment
    tracker_uri: str | None = None  # MLflow's tracking URI; None: file:RUN_DIR/mlruns
    # A jax.profiler trace of steps profile_start .. profile_start + profile_steps - 1 into
    # RUN_DIR/profile (observe/profile.py: TensorBoard, Perfetto, python -m moe_jax.profile);
    # profile_steps 0 = off
    profile_start: int = 5
    profile_steps: int = 0  # see profile_start
    # Without a terminal (SLURM, nohup) a progress line every this many seconds instead of
    # the bar (step, elapsed, ETA, device memory)
    progress_every_s: float = 60.0
    # Resume from this saved step instead of the latest (e.g. when the latest is damaged); the
    # checkpoints after it are moved to RUN_DIR/superseded. 0 = the latest. A one-off override.
    resume_step: int = 0
    # What the step minimises: lm (cross-entropy: pretraining and SFT) | dpo (Direct
    # Preference Optimization on data.sft=preference pairs, moe_jax/posttrain/dpo.py; the reference
    # is the base with the LoRA adapters off, or without LoRA a frozen copy of the initial
    # params in the optimizer state, moe_jax/posttrain/reference_policy.py) | grpo (GRPO / GSPO
    # on rollouts of data.sft=prompts, the rl section, moe_jax/posttrain/rl/)
    objective: str = "lm"
    dpo_beta: float = 0.1  # DPO's beta: the strength of the implicit KL to the reference
    # DPO's loss, TRL's loss_type (moe_jax/posttrain/dpo.py): sigmoid (DPO) | ipo (IPO, on per-token
    # log-ratios, as TRL's) | simpo (SimPO, TRL's CPOTrainer loss_type=simpo with
    # cpo_alpha=0: per-token log-probs, no reference, margin train.simpo_gamma)
    dpo_loss: str = "sigmoid"
    simpo_gamma: float = 0.5  # see dpo_loss

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

    def check(self) -> None:
        positive(self, "train", ["steps", "batch_size", "seq_len", "grad_accum", "lr", "log_every"])
        positive(self, "train", ["eval_every", "eval_batches"])
        one_of(self.moments_dtype, ("float32", "bfloat16"), "train.moments_dtype")
        one_of(self.objective, OBJECTIVES, "train.objective")
        one_of(self.dpo_loss, DPO_LOSSES, "train.dpo_loss")
        positive(self, "train", ["dpo_beta"])
        require(
            self.epochs is None or (math.isfinite(self.epochs) and self.epochs > 0),
            f"train.epochs must be positive (passes over the data) or null, got {self.epochs}",
        )
        require(
            self.batch_size % self.grad_accum == 0,
            f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum "
            f"({self.grad_accum})",
        )
        require(
            self.loss_chunk in (-1, 0)
            or (self.loss_chunk > 0 and self.seq_len % self.loss_chunk == 0),
            f"train.loss_chunk ({self.loss_chunk}) must be -1 (auto), 0 (off) or divide "
            f"train.seq_len ({self.seq_len})",
        )
        if self.warmup_steps is not None:
            require(
                self.warmup_steps >= 0,
                f"train.warmup_steps must be >= 0, got {self.warmup_steps}",
            )
            require(
                self.warmup_steps <= self.steps,
                f"train.warmup_steps ({self.warmup_steps}) exceeds train.steps ({self.steps}); "
                f"set it to at most {self.steps}, or to null for the default, "
                f"min({DEFAULT_WARMUP_STEPS}, train.steps // 10)",
            )
        require(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio must be within [0, 1]")
        one_of(self.schedule, SCHEDULES, "train.schedule")
        require(
            0.0 < self.decay_fraction <= 1.0,
            f"train.decay_fraction must be within (0, 1], got {self.decay_fraction}",
        )
        if self.schedule == "wsd":
            require(
                self.warmup + self.decay_steps <= self.steps,
                f"train.schedule=wsd: warmup ({self.warmup}) and decay ({self.decay_steps} = "
                f"decay_fraction {self.decay_fraction} x {self.steps} steps) exceed "
                "train.steps; lower train.decay_fraction or train.warmup_steps",
            )
        self._check_observers()
        require(
            self.resume_step >= 0,
            f"train.resume_step must be >= 0 (0 = the latest), got {self.resume_step}",
        )
        non_negative(self, "train", ["weight_decay", "clip_norm", "logit_z_loss"])
        non_negative(self, "train", ["mtp_loss_weight", "indexer_loss_weight"])
        one_of(self.indexer_stage, INDEXER_STAGES, "train.indexer_stage")
        for n in ("b1", "b2"):
            require(0.0 <= getattr(self, n) < 1.0, f"train.{n} must be within [0, 1)")
        positive(self, "train", ["eps"])
        self._check_optimizer()

    def _check_optimizer(self) -> None:
        """train.optimizer, Muon's settings and the QK-clip threshold."""
        one_of(self.optimizer, OPTIMIZERS, "train.optimizer")
        require(
            0.0 <= self.muon_momentum < 1.0,
            f"train.muon_momentum must be within [0, 1) (Moonlight: 0.95), got "
            f"{self.muon_momentum}",
        )
        positive(self, "train", ["muon_ns_steps", "muon_rms"])
        require(
            self.qk_clip is None or self.qk_clip >= 0,
            f"train.qk_clip must be >= 0 (a max-logit threshold, Kimi K2: 100; 0 = off), got "
            f"{self.qk_clip}",
        )

    def _check_observers(self) -> None:
        """The trackers, the profile window and the progress interval."""
        for name in self.trackers:
            one_of(name, TRACKERS, "train.trackers")
        require(
            len(set(self.trackers)) == len(self.trackers),
            f"train.trackers names a tracker twice: {list(self.trackers)}",
        )
        non_negative(self, "train", ["profile_steps"])
        positive(self, "train", ["profile_start", "progress_every_s"])
        require(
            self.profile_steps == 0 or self.profile_start <= self.steps,
            f"train.profile_start ({self.profile_start}) is past train.steps ({self.steps}); "
            "profile an earlier step or set train.profile_steps=0",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200  # steps between checkpoints (and one at the last step)
    keep: int = 3  # the newest this many checkpoints are kept
    async_save: bool = True  # write in the background while training goes on
    # A Hugging Face copy (RUN_DIR/hf/step_S: config.json, safetensors, tokenizer) of every
    # export_hf-th save and of the last step, in the run's compute dtype; 0 = none
    # (moe_jax/train/hf_exports.py)
    export_hf: int = 0

    def check(self) -> None:
        positive(self, "checkpoint", ["every", "keep"])
        require(
            self.export_hf >= 0,
            f"checkpoint.export_hf must be >= 0 (0 = no copies), got {self.export_hf}",
        )


@dataclass(frozen=True)
class SampleConfig:
    prompt: str = "\n"  # the prompt when none is given
    max_new_tokens: int = 200  # tokens generated per sample
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0  # the sampling key's seed: same seed, same text
    # Rows and prompt length of a batch: sample.py's --num-samples sets batch_size (its prompt
    # sets the length); `moe_jax.aot.command --step decode` compiles for both.
    batch_size: int = 1
    prompt_len: int = 128  # see batch_size
    # Form of the weights when sampling (moe_jax/inference/weights.py): auto (bfloat16 if
    # model.dtype is bfloat16, else float32: no result changes) | float32 | bfloat16 |
    # int8 (per channel) | mxfp4 (the routed experts in MXFP4, the rest bfloat16: gpt-oss as
    # released)
    weights: str = "auto"
    # Speculative decoding (moe_jax/inference/speculative.py): the model's MTP module
    # (model.mtp_depth >= 1) drafts up to draft_depth tokens a step (null: one per MTP depth;
    # at most model.mtp_depth, checked when the sampler is built) and the main model checks them in
    # one forward; the text has the plain sampler's distribution (greedy: its text, token for
    # token), in fewer steps.
    speculative: bool = False
    draft_depth: int | None = None  # see speculative

    def check(self) -> None:
        values = {name: getattr(self, name) for name, _, _ in SAMPLING_RANGES}
        problem = sampling_problem(values, "sample.")
        require(problem is None, problem)
        one_of(self.weights, WEIGHT_KINDS, "sample.weights")
        positive(self, "sample", ["max_new_tokens", "batch_size", "prompt_len"])
        require(
            self.draft_depth is None or self.draft_depth >= 1,
            f"sample.draft_depth must be >= 1 (MTP depths that draft) or null (all of them), "
            f"got {self.draft_depth}",
        )


@dataclass(frozen=True)
class EvalConfig:
    # lm-evaluation-harness tasks run on the params at eval steps (moe_jax/eval/in_training.py;
    # the `eval` extra): names comma-separated, e.g. "hellaswag,arc_easy"; "" = none. Their
    # metrics go to metrics.jsonl (kind "downstream"), TensorBoard and downstream.png.
    tasks: str = ""
    every: int = 0  # steps between task evals (and at the end); 0 = train.eval_every's
    limit: int | None = None  # documents per task; None = all
    num_fewshot: int | None = None  # None = each task's own
    batch_size: int = 8  # rows per compiled scoring / generation program
    include_path: str | None = None  # a directory of task YAML files of your own

    def check(self) -> None:
        names = [t.strip() for t in self.tasks.split(",")]
        require(
            self.tasks == "" or all(names),
            f"eval.tasks '{self.tasks}' has an empty name; give harness task names separated "
            'by commas, or "" for none',
        )
        non_negative(self, "eval", ["every"])
        positive(self, "eval", ["batch_size"])
        require(
            self.limit is None or self.limit > 0,
            f"eval.limit must be positive (documents per task) or null, got {self.limit}",
        )
        require(
            self.num_fewshot is None or self.num_fewshot >= 0,
            f"eval.num_fewshot must be >= 0 or null (each task's own), got {self.num_fewshot}",
        )
        require(
            self.include_path is None or self.include_path.strip() != "",
            "eval.include_path is empty; name a directory of task YAML files, or null",
        )
