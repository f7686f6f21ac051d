"""What a run shows of itself: its metric writers (metrics.jsonl, TensorBoard), the trackers
(W&B, MLflow), plots of a run and step profiles (`python -m moe_jax.plot`, `python -m
moe_jax.profile`). The named scopes the profiles read are `moe_jax.named_scopes`, a base
module, since the model carries them; the FLOP accounting is `moe_jax.summary`.
"""
