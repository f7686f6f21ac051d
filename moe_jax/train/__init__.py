"""Training: the loop (`loop.Training`, `train`), its step (`step`: optimizer, loss and grads,
the jitted step), the train state (`state`), the console lines (`console`), the kernel checks
before a run (`preflight`), a run started from a checkpoint or an HF directory (`init_from`)
and the HF exports a run writes as it goes (`hf_exports`). The loss itself is the model's
(`moe_jax.model.loss`), shared with post-training.
"""
