"""The step after pretraining: LoRA's train-state side (`lora`), DPO (`dpo`) against a frozen
reference policy (`reference_policy`, also GRPO's KL reference), and RL (`rl/`: GRPO / GSPO
with rollout routing replay). The model's side of LoRA is `moe_jax.model.lora`, PEFT's adapter
format `moe_jax.interop.peft`; the train step (`moe_jax.train.step`) calls these by objective.
"""
