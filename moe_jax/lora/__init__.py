"""LoRA: low-rank adapters on a frozen base (issue 53).

    params.py     the train state's side: which params train, the frozen base's dtype, fresh
                  adapters for a run started from a base, merging adapters into the base
    peft.py       PEFT's adapter format: export (adapter_model.safetensors +
                  adapter_config.json) and import onto a run or a Hugging Face directory

The model's side (a pair attached to a weight, its term in the forward, the routed experts'
merged weights) is `moe_jax.model.lora`: the model imports nothing outside its package but
the config and sharding. Nothing is imported here (no import circle through the interop
modules `peft` uses).
"""
