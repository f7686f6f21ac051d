"""LoRA: low-rank adapters on a frozen base (issue 53).

    adapters.py   the model's side: attach a pair to a weight, its term in the forward, the
                  routed experts' merged weights
    params.py     the train state's side: which params train, the frozen base's dtype, fresh
                  adapters for a run started from a base, merging adapters into the base
    peft.py       PEFT's adapter format: export (adapter_model.safetensors +
                  adapter_config.json) and import onto a run or a Hugging Face directory

Nothing is imported here: the model imports `adapters` alone (no import circle through
the interop modules `peft` uses).
"""
