"""The architecture's sections (model, attention, moe), each checking its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_jax.backends import EXCHANGES, IMPLS
from moe_jax.config.attention_kinds import check_gqa, check_linear, check_mla, check_sparse
from moe_jax.config.checks import non_negative, one_of, positive, require

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
ROPE_STYLES = ("half", "interleaved")
QK_NORMS = ("none", "rms", "l2")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
ATTENTION_KINDS = ("gqa", "mla")
# The linear-attention layers a hybrid stack interleaves with full attention: none | the
# gated DeltaNet of Qwen3-Next and Qwen3.5 (moe_jax/model/gated_deltanet.py)
LINEAR_KINDS = ("none", "gated_deltanet")
SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
ROUTE_SCALES = ("output", "input")


@dataclass(frozen=True)
class RopeScalingConfig:
    # none | linear (positions divided by factor) | llama3 (Llama-3/4 frequency-band scaling)
    # | yarn (YaRN, arXiv:2309.00071: gpt-oss, DeepSeek-V3, Qwen long context)
    type: str = "none"
    factor: float = 8.0  # the context's scaling factor (linear, llama3, yarn)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn
    # yarn: the band of rotations (in turns over the original context) ramped from
    # interpolated to kept as they are
    beta_fast: float = 32.0
    beta_slow: float = 1.0  # yarn: the band's other end (see beta_fast)
    truncate: bool = True  # yarn: round the band's ends to whole dims (gpt-oss: false)
    # yarn: q and k are scaled by attention_factor (0 = 0.1 ln(factor) + 1, or from mscale
    # and mscale_all_dim when set: DeepSeek's ratio of the two)
    attention_factor: float = 0.0
    mscale: float = 0.0  # yarn: DeepSeek's mscale (see attention_factor)
    mscale_all_dim: float = 0.0  # yarn: DeepSeek's mscale_all_dim (see attention_factor)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # token ids 0 .. vocab_size - 1 (the tokenizer's size or more)
    d_model: int = 128  # the residual stream's width
    n_layers: int = 4  # decoder layers
    ffn_hidden: int = 512  # hidden width of the dense SwiGLU layers
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = False  # the output head shares the token embedding's weights
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
    remat_offload: str = ""  # see remat_save
    init_std: float = 0.02  # standard deviation of the weights' normal initialisation
    # Norm weights stored centred at zero and applied as (1 + w) (Qwen3-Next, Qwen3.5: every
    # RMSNorm of the stack, QK-norms included, but not the linear layers' gated output norm);
    # false: applied as w, initialised to ones
    zero_centered_norm: bool = False
    # Width of precomputed image embeddings the model accepts (`model(tokens, images=...,
    # image_mask=...)`, projected to d_model); 0 = text only, no projection parameter.
    vision: int = 0
    # DeepSeek-V3's multi-token prediction (moe_jax/model/mtp.py): this many extra modules,
    # module k predicting the token k+1 ahead from the main model's (or module k-1's) hidden
    # state and token t+k, trained with train.mtp_loss_weight; depth 1 also drafts for
    # speculative decoding (sample.speculative). 0 = none (DeepSeek-V3: 1).
    mtp_depth: int = 0
    # DeepSeek-V4's manifold-constrained hyper-connections (mHC, in
    # moe_jax/model/hyper_connections.py): the residual is hc_mult streams, each block's
    # input a learned mix of them and its output spread back over them, the streams
    # themselves mixed by a doubly-stochastic matrix (Sinkhorn-Knopp); a learned head merges
    # them before the final norm. 0 = the one plain residual stream (V4: 4)
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20  # see hc_mult: the Sinkhorn-Knopp iterations (V4: 20)
    hc_eps: float = 1e-6  # see hc_mult: the floor added to the mixing weights and their sums

    @property
    def remat_saved(self) -> tuple[str, ...]:
        """model.remat_save as names."""
        return _names(self.remat_save)

    @property
    def remat_offloaded(self) -> tuple[str, ...]:
        """model.remat_offload as names."""
        return _names(self.remat_offload)

    def check(self) -> None:
        positive(self, "model", ["vocab_size", "d_model", "n_layers", "max_seq_len", "norm_eps"])
        positive(self, "model", ["init_std"])
        one_of(self.dtype, DTYPES, "model.dtype")
        one_of(self.remat, REMAT_POLICIES, "model.remat")
        require(
            self.remat == "none" or self.scan_layers,
            f"model.remat={self.remat} needs model.scan_layers=true (unrolled layers give XLA "
            "freedom to recompute in the forward, which saves no memory); set both or remat=none",
        )
        save, offload = self.remat_saved, self.remat_offloaded
        for key, listed in (("model.remat_save", save), ("model.remat_offload", offload)):
            for name in listed:
                require(
                    name in REMAT_NAMES,
                    f"{key} names '{name}', which the model does not name; choose from "
                    f"{', '.join(REMAT_NAMES)}",
                )
        both = sorted(set(save) & set(offload))
        require(
            not both,
            f"{', '.join(both)} is in both model.remat_save and model.remat_offload; "
            "keep each name in one of them",
        )
        require(
            self.remat != "none" or not (save or offload),
            "model.remat_save / remat_offload choose what remat dots or full keeps; with "
            "remat=none everything is kept: set model.remat=full (or dots) too",
        )
        require(
            self.vision >= 0, f"model.vision must be >= 0 (0 = no image inputs), got {self.vision}"
        )
        require(
            self.mtp_depth >= 0,
            f"model.mtp_depth must be >= 0 (0 = no multi-token prediction), got {self.mtp_depth}",
        )
        non_negative(self, "model", ["hc_mult"])
        if self.hc_mult:
            positive(self, "model", ["hc_sinkhorn_iters", "hc_eps"])
            require(
                self.mtp_depth == 0,
                "model.hc_mult > 0 (hyper-connections) does not compose with multi-token "
                "prediction yet (the MTP layers keep one residual stream); set "
                "model.mtp_depth=0 or model.hc_mult=0",
            )


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list -> its names."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


@dataclass(frozen=True)
class AttentionConfig:
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key / value heads (GQA; divides n_heads; 1 = MQA)
    head_dim: int | None = None  # None: d_model // n_heads
    rope_theta: float = 10000.0  # RoPE's base
    # half: rotate split halves (Llama/Mixtral/Qwen); interleaved: rotate pairs (Llama 4)
    rope_style: str = "half"
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    qk_norm: str = "none"  # none | rms (learned, before RoPE) | l2 (weightless, after RoPE)
    # RoPE on the first int(head_dim x this) dims of each head only, the rest carrying no
    # position (GLM-4.5: 0.5); 1 = every dim
    partial_rotary_factor: float = 1.0
    nope_interval: int = 0  # every nope_interval-th layer has no RoPE; 0 = none
    temperature_tuning: bool = False  # Llama 4 attention temperature on NoPE layers
    floor_scale: float = 8192.0  # temperature_tuning: positions per step of the scale
    attn_scale: float = 0.1  # temperature_tuning: the scale's slope
    chunk_size: int = 0  # chunked local attention on RoPE layers; 0 = off
    sliding_window: int = 0  # attend to the last `sliding_window` positions; 0 = off
    # with sliding_window: every full_attention_interval-th layer attends to the whole
    # context instead (gpt-oss: 2, layers 1, 3, ...); 0 = the window on every layer.
    # With attention.linear: every full_attention_interval-th layer is full attention, the
    # others linear (Qwen3-Next, Qwen3.5: 4, layers 3, 7, ...); 0 = every layer linear
    full_attention_interval: int = 0
    # Linear-attention layers in place of attention (LINEAR_KINDS; hybrid stacks): their key
    # and value heads (value heads a multiple of key heads), head widths and the causal
    # convolution's kernel; the full-attention layers keep the fields above
    linear: str = "none"
    linear_key_heads: int = 0  # see linear
    linear_value_heads: int = 0  # see linear
    linear_key_dim: int = 0  # see linear
    linear_value_dim: int = 0  # see linear
    linear_conv_kernel: int = 4  # see linear
    # The output gate of Qwen3-Next's attention: the q projection also makes a gate per head
    # and dim, and the attention's output is multiplied by sigmoid(gate) before wo
    output_gate: bool = False
    # DeepSeek-V4's grouped low-rank output projection (gqa), in place of wo: the heads in
    # o_groups consecutive groups, each group's outputs projected to o_lora_rank dims by its
    # own wo_a, the groups' together to d_model by wo_b (V4-Flash: 8 groups of rank 1024);
    # 0 = wo
    o_groups: int = 0
    o_lora_rank: int = 0  # see o_groups
    sinks: bool = False  # a learned sink logit per query head in each softmax (gpt-oss)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2, gpt-oss)
    o_bias: bool = False  # a bias on the output projection (gpt-oss)
    # Kernel (moe_jax/backends.py): auto (the backend's own) | blocked (blocked softmax with a
    # hand-written backward, XLA:CPU's) | cudnn (GPU fused attention) | splash (TPU Pallas)
    impl: str = "auto"
    # gqa: grouped-query attention (the fields above) | mla: DeepSeek-V2/V3's multi-head
    # latent attention (moe_jax/model/mla.py): every head's keys and values are expanded from
    # one low-rank latent per token, and the KV cache holds that latent and one shared RoPE
    # key (kv_lora_rank + qk_rope_head_dim values a token). mla takes no n_kv_heads (every
    # head has its own keys, from the latent) nor head_dim (the three sizes below instead),
    # and none of the sliding window, chunks, sinks, QK-norm, NoPE layers or biases.
    kind: str = "gqa"
    # mla: the queries' low-rank bottleneck, q = W_qb RMSNorm(W_qa x) (DeepSeek-V3: 1536);
    # 0 = none, q = W_q x (DeepSeek-V2-Lite)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0  # mla: width of the latent the keys and values come from (V3: 512)
    qk_nope_head_dim: int = 0  # mla: each head's query/key dims without RoPE (V3: 128)
    qk_rope_head_dim: int = 0  # mla: the query/key dims with RoPE; one key for all heads (V3: 64)
    v_head_dim: int = 0  # mla: each head's value dims (V3: 128)
    # DeepSeek Sparse Attention on mla (DeepSeek-V3.2, GLM-5; moe_jax/model/sparse_attention.py):
    # a lightning indexer scores the past tokens and each query attends to its index_topk best
    # only (V3.2: 2048); 0 = dense mla. The indexer's heads and width (V3.2: 64 x 128, GLM-5:
    # 32 x 128), its first qk_rope_head_dim dims rotated half (V3.2) or interleaved (GLM-5).
    index_topk: int = 0
    index_n_heads: int = 0  # see index_topk
    index_head_dim: int = 0  # see index_topk
    index_rope_style: str = "half"  # see index_topk
    # GLM's index sharing: layer i runs its own indexer where max(i - index_skip_topk_offset
    # + 1, 0) is a multiple of index_topk_freq, else reuses the last such layer's selection
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2  # see index_topk_freq

    def check(self) -> None:
        positive(self, "attention", ["n_heads", "n_kv_heads", "rope_theta"])
        one_of(self.rope_style, ROPE_STYLES, "attention.rope_style")
        one_of(self.qk_norm, QK_NORMS, "attention.qk_norm")
        one_of(self.rope_scaling.type, ROPE_SCALINGS, "attention.rope_scaling.type")
        one_of(self.impl, IMPLS["attention"], "attention.impl")
        one_of(self.kind, ATTENTION_KINDS, "attention.kind")
        require(
            0 < self.partial_rotary_factor <= 1,
            "attention.partial_rotary_factor is the fraction of each head's dims RoPE rotates: "
            f"it must be in (0, 1] (1 = all), got {self.partial_rotary_factor}",
        )
        if self.kind == "mla":
            check_mla(self)
        else:
            check_gqa(self)
        check_sparse(self)
        if self.o_groups or self.o_lora_rank:
            self._check_grouped_output()
        non_negative(self, "attention", ["nope_interval", "full_attention_interval"])
        one_of(self.linear, LINEAR_KINDS, "attention.linear")
        if self.linear != "none":
            check_linear(self)
        require(
            self.full_attention_interval == 0 or self.sliding_window > 0 or self.linear != "none",
            "attention.full_attention_interval picks the layers without the sliding window (or "
            "the full-attention layers among linear ones); set attention.sliding_window or "
            "attention.linear too, or full_attention_interval=0",
        )
        require(
            self.chunk_size >= 0,
            f"attention.chunk_size must be >= 0 (0 = off), got {self.chunk_size}",
        )
        require(
            self.sliding_window >= 0,
            f"attention.sliding_window must be >= 0 (0 = off), got {self.sliding_window}",
        )
        if self.temperature_tuning:
            positive(self, "attention", ["floor_scale"])
        scaling = self.rope_scaling
        if scaling.type != "none":
            positive(scaling, "attention.rope_scaling", ["factor"])
        if scaling.type == "llama3":
            require(
                scaling.high_freq_factor >= scaling.low_freq_factor,
                "attention.rope_scaling.high_freq_factor must be >= low_freq_factor",
            )

    def _check_grouped_output(self) -> None:
        positive(self, "attention", ["o_groups", "o_lora_rank"])
        require(
            self.kind == "gqa" and self.n_heads % self.o_groups == 0,
            f"attention.o_groups ({self.o_groups}) groups grouped-query attention's heads: "
            f"it needs attention.kind=gqa and must divide attention.n_heads ({self.n_heads})",
        )


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 4  # routed experts per MoE layer
    top_k: int = 2  # experts each token is routed to
    expert_hidden: int = 256  # each expert's SwiGLU hidden width
    interleave_step: int = 1  # MoE on every interleave_step-th layer, dense SwiGLU elsewhere
    # The three routing switches are independent: Llama 4 is score=sigmoid, renormalize=false,
    # route_scale=input (configs/llama4_scout_17b_16e.yaml); sigmoid alone keeps the others.
    # softmax | sigmoid | sqrtsoftplus (DeepSeek-V4: sqrt(softplus(logit)), as sigmoid an
    # expert's own score, its top-k chosen by the scores plus any correction_bias, its
    # weights the picked scores renormalised (V4: renormalize=true) times routed_scaling_factor)
    score: str = "softmax"
    # renormalise the top-k weights to sum to 1 (top-1: always 1, so the router then learns
    # from the aux losses only)
    renormalize: bool = True
    route_scale: str = "output"  # output (Mixtral/Qwen) | input (Llama 4: scales expert input)
    shared_expert_hidden: int = 0  # 0 = no shared expert
    # The shared expert's output times sigmoid(x . w_gate), a learned scalar gate per token
    # (Qwen3-Next, Qwen3.5: shared_expert_gate); false: added as it is
    shared_expert_gate: bool = False
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases in the experts' projections (gpt-oss)
    # DeepSeek-V3's routing (moe_jax/model/routing.py). Group-limited: the experts in n_group
    # equal groups, each token choosing among the topk_group groups with the best sum of
    # their top-2 scores only (n_group 1: off).
    n_group: int = 1
    topk_group: int = 1  # see n_group
    # A per-expert bias added to the scores to choose the top-k only, never to the weights
    # (`correction_bias`, HF's e_score_correction_bias), trained without a gradient: after
    # each step it moves by bias_update_rate * sign(mean load - load), auxiliary-loss-free
    # balancing (DeepSeek-V3 sec. 2.1.2: gamma 0.001, the default, so that a bias imported or
    # switched on balances). 0 freezes the bias: training then needs a balance loss
    # (`check_training`). Without a correction bias the rate is unused.
    correction_bias: bool = False
    bias_update_rate: float = 0.001  # see correction_bias
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (V3: 2.5)
    # The first this many layers dense (HF first_k_dense_replace; DeepSeek-V3: 3).
    first_dense_layers: int = 0
    # DeepSeek-V4's hash routing: the first this many MoE layers (after first_dense_layers;
    # HF mlp_layer_types "hash_moe", V4: 3) take the experts a fixed token-id table `tid2eid`
    # [vocab_size, top_k] names (never trained; drawn at random, distinct experts per token),
    # weighted by their router's scores as a top-k layer weighs its picks, and
    # no correction_bias. Like the dense prefix they run outside the layer scan.
    hash_layers: int = 0
    # > 0: DeepSeek-V3's sequence-wise balance loss, the load-balance loss of each sequence
    # (a batch row) averaged over them, at this weight (V3's alpha: 1e-4) per MoE layer: summed
    # over the layers as DeepSeek's code adds each layer's (the Switch loss is averaged).
    seq_aux_loss_weight: float = 0.0
    # > 0: gpt-oss's clamped SwiGLU in the experts (moe_jax/model/glu.py): gate clamped from
    # above and up on both sides at this limit, h = gate * sigmoid(alpha gate) * (up + 1);
    # 0: plain SwiGLU
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702  # see swiglu_limit
    capacity_factor: float = 1.25  # <= 0: no token is ever dropped
    lb_loss_weight: float = 0.01  # Switch load-balance loss, averaged over the MoE layers
    z_loss_weight: float = 1e-3  # router z-loss mean(logsumexp(logits)^2), averaged likewise
    # Expert kernel (moe_jax/backends.py): auto (the backend's own) | buckets (capacity buffers,
    # filled rows by lax.switch: XLA:CPU's) | batched (every buffer slot in one batched matmul:
    # GPU's) | ragged (rows sorted by expert, jax.lax.ragged_dot) | megablox (TPU Pallas
    # grouped matmul) | mosaic (rows sorted by expert, jax's Pallas Mosaic GPU grouped
    # matmuls, Hopper). Every one computes the same routing and drops.
    impl: str = "auto"
    # Decoding's picked experts (few tokens in flight: batch x top_k < n_experts): auto (the
    # backend's own: gather everywhere for now) | gather (XLA gathers the picked weights,
    # then multiplies) | triton (NVIDIA GPUs: a Pallas Triton kernel reads each picked weight
    # where it lies; moe_jax/kernels/picked_matmul.py). Both compute the same products.
    decode_impl: str = "auto"
    # How expert-parallel layers with moe.impl=ragged or mosaic move tokens (backends.py):
    # auto (ragged on GPU/TPU, buffers on CPU) | ragged (only the routed rows, by
    # jax.lax.ragged_all_to_all) | buffers (the fixed [E, C] capacity buffers by all_to_all).
    exchange: str = "auto"
    # The grouped impls (ragged, megablox, mosaic) run the sorted rows in this many
    # consecutive chunks, forward and backward, so their [rows, expert_hidden] intermediates
    # exist for one chunk at a time; the backward recomputes each chunk's gate/up products
    # (moe_jax/model/grouped.py).
    # Dropless through the ragged exchange, a shard's tokens also go through the exchange in
    # that many slices, one after another, each recomputed in the backward: the buffers of k x
    # the tokens' rows exist for one slice at a time (exchange.chunked_exchange).
    row_chunks: int = 1
    # The ragged exchange's receive buffer, in rows: this factor times the rows a shard sends
    # (the average it receives). Rows past it go in further rounds, never dropped
    # (moe_jax/model/exchange_rounds.py); <= 0: the worst case (every token of every shard
    # to one shard), one round always.
    recv_factor: float = 1.25

    def check(self) -> None:
        one_of(self.score, SCORES, "moe.score")
        one_of(self.route_scale, ROUTE_SCALES, "moe.route_scale")
        one_of(self.impl, IMPLS["moe"], "moe.impl")
        one_of(self.decode_impl, IMPLS["decode"], "moe.decode_impl")
        one_of(self.exchange, EXCHANGES, "moe.exchange")
        require(self.row_chunks >= 1, f"moe.row_chunks must be >= 1, got {self.row_chunks}")
        require(
            self.row_chunks == 1 or self.impl in ("auto", "ragged", "megablox", "mosaic"),
            f"moe.row_chunks={self.row_chunks} chunks the grouped experts' rows; "
            f"moe.impl={self.impl} has none: use moe.impl=ragged, megablox, mosaic or auto, or "
            "moe.row_chunks=1",
        )
        require(
            self.n_experts >= 0,
            f"moe.n_experts must be >= 0 (0 = dense model), got {self.n_experts}",
        )
        require(
            self.interleave_step >= 1,
            f"moe.interleave_step must be >= 1, got {self.interleave_step}",
        )
        if self.n_experts > 0:
            require(
                1 <= self.top_k <= self.n_experts,
                f"moe.top_k ({self.top_k}) must be between 1 and moe.n_experts ({self.n_experts})",
            )
            positive(self, "moe", ["expert_hidden"])
            non_negative(self, "moe", ["shared_expert_hidden"])
            require(
                not self.shared_expert_gate or self.shared_expert_hidden > 0,
                "moe.shared_expert_gate gates the shared expert, and moe.shared_expert_hidden=0 "
                "leaves none; set moe.shared_expert_hidden or shared_expert_gate=false",
            )
        non_negative(self, "moe", ["lb_loss_weight", "z_loss_weight", "swiglu_limit"])
        non_negative(self, "moe", ["bias_update_rate", "seq_aux_loss_weight", "first_dense_layers"])
        non_negative(self, "moe", ["hash_layers"])
        positive(self, "moe", ["n_group", "topk_group", "routed_scaling_factor"])
        if self.n_experts > 0:
            self._check_deepseek_routing()
        if self.swiglu_limit > 0:
            positive(self, "moe", ["swiglu_alpha"])

    def _check_deepseek_routing(self) -> None:
        E, G = self.n_experts, self.n_group
        require(
            E % G == 0 and (G == 1 or E // G >= 2),
            f"moe.n_group ({G}) must divide moe.n_experts ({E}) into groups of at least 2 "
            "experts (a group's score is its top-2's sum); change moe.n_group",
        )
        require(
            self.topk_group <= G,
            f"moe.topk_group ({self.topk_group}) must be at most moe.n_group ({G})",
        )
        require(
            self.top_k <= self.topk_group * (E // G),
            f"moe.top_k ({self.top_k}) picks from the topk_group best groups' "
            f"{self.topk_group * (E // G)} experts only; raise moe.topk_group or lower moe.top_k",
        )

    def check_training(self) -> None:
        """What training needs of the MoE beyond a valid config: a router with a correction
        bias is balanced by the bias's update or by a balance loss (ConfigError otherwise)."""
        losses = self.lb_loss_weight + self.seq_aux_loss_weight
        require(
            not (self.n_experts > 0 and self.correction_bias)
            or self.bias_update_rate > 0
            or losses > 0,
            "moe.correction_bias with moe.bias_update_rate=0 and no balance loss leaves the "
            "routing unbalanced: set moe.bias_update_rate=0.001 (DeepSeek-V3's), or "
            "moe.seq_aux_loss_weight or moe.lb_loss_weight > 0",
        )
