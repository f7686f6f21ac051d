"""The lora section: low-rank adapters on a frozen base (moe_jax/posttrain/lora.py)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_jax.config.checks import non_negative, require

# lora.targets: the layer groups that get adapters (moe_jax/model/lora.py names each
# group's weights)
LORA_TARGETS = ("attention", "mlp", "shared", "experts")
LORA_BASE_DTYPES = ("bfloat16", "float32", "int8", "mxfp4")


@dataclass(frozen=True)
class LoRAConfig:
    # Rank r of every adapter; 0 = no adapters (full fine-tuning). With r > 0 only the
    # adapters train: the base weights are frozen, stored in lora.base_dtype, and the
    # optimizer holds state for the adapters alone.
    rank: int = 0
    # The update is (alpha / r) * x A B, PEFT's scaling (not rsLoRA's alpha / sqrt(r)).
    alpha: float = 16.0
    # Dropout on an adapter's input (PEFT's lora_dropout), training steps only; the routed
    # experts' adapters are merged into their weights, so it cannot apply to them.
    dropout: float = 0.0
    # Which layers get adapters: attention (every projection), mlp (the dense SwiGLU
    # layers), shared (the MoE layers' shared expert), experts (each routed expert its own
    # pair, stacked over the experts).
    targets: tuple[str, ...] = ("attention",)
    # The frozen base's matmul weights are stored in this dtype (vectors, like norms,
    # biases and the router's correction bias, stay float32). int8 (QLoRA-style): every
    # matmul weight but the router's and the embedding's int8 with one scale per output
    # channel (moe_jax/model/int8.py), dequantised as each layer reads it; mxfp4: the routed
    # experts' weights MXFP4 (model.d_model and moe.expert_hidden multiples of 32). Beside
    # either, the other matmul weights are bfloat16. Use model.remat=full or dots with
    # these: without remat the backward keeps each layer's dequantised weights.
    base_dtype: str = "bfloat16"
    # A PEFT adapter directory (adapter_model.safetensors + adapter_config.json) whose pairs
    # a run started with init_from takes instead of new adapters (its r and alpha must be
    # lora.rank and lora.alpha; moe_jax/interop/peft.py). null: new adapters.
    init_adapter: str | None = None

    def check(self) -> None:
        non_negative(self, "lora", ["rank", "alpha", "dropout"])
        require(self.dropout < 1, f"lora.dropout must be < 1, got {self.dropout}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        require(
            not bad,
            f"lora.targets has {bad}; choose among {', '.join(LORA_TARGETS)}",
        )
        require(
            self.rank == 0 or len(self.targets) > 0,
            "lora.rank > 0 with no lora.targets; name the layers to adapt, e.g. "
            "lora.targets=[attention,mlp]",
        )
        require(
            self.base_dtype in LORA_BASE_DTYPES,
            f"lora.base_dtype='{self.base_dtype}' is not supported; use one of "
            f"{', '.join(LORA_BASE_DTYPES)}",
        )
        require(
            self.init_adapter is None or self.rank > 0,
            "lora.init_adapter is set but lora.rank is 0; set lora.rank (the adapter's r)",
        )
        require(
            self.dropout == 0 or "experts" not in self.targets,
            "lora.dropout > 0 with lora.targets naming experts: the routed experts' adapters "
            "are merged into their weights, where no input dropout applies; set lora.dropout=0 "
            "or drop experts from lora.targets",
        )
