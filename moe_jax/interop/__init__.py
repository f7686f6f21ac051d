"""Hugging Face interop: import and export safetensors checkpoints with logit parity.

    from moe_jax.interop import load_hf, save_hf
    cfg, model = load_hf("path/to/hf_model")          # config.json + *.safetensors -> ours
    save_hf(cfg, model, "path/to/out")                 # -> a directory transformers loads

Families: Llama4ForCausalLM (and the text part of Llama4ForConditionalGeneration),
MixtralForCausalLM, Qwen3MoeForCausalLM, GptOssForCausalLM (its MXFP4 experts dequantised on
import), DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2: latent attention; its multi-token
prediction layers too; their released FP8 weights dequantised block by block, `fp8.py`),
Glm4MoeForCausalLM (GLM-4.5: partial rotary), DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM
(DeepSeek-V3.2, GLM-5: sparse attention's indexer, `dsa.py`), Qwen3NextForCausalLM /
Qwen3_5MoeForCausalLM (hybrid stacks), and the dense LlamaForCausalLM /
Qwen3ForCausalLM (`moe.n_experts = 0`). A setting that changes the math and that our
model lacks is refused with an `InteropError` naming it.
Imported MoE models never drop tokens (`moe.capacity_factor = 0`), like transformers.
Import streams (`stream.py`): each tensor memory-mapped in its own dtype and converted a
slice at a time onto its devices or into a run's checkpoint. A HF directory also loads
wherever a run does (`as_run.py`). CLI: `python -m moe_jax.interop --help`.
"""

from moe_jax.interop.convert import FAMILIES, config_from_hf, load_hf, pick_family, save_hf
from moe_jax.interop.safetensors_io import InteropError

__all__ = ["FAMILIES", "InteropError", "config_from_hf", "load_hf", "pick_family", "save_hf"]
