"""The console scripts (`moe-jax-train`, `moe-jax-sample`) and what they share: the shipped
configs by name (`configs.py`) and the launchers' storage check (`shared_storage.py`). The
one door every command of moe_jax goes through is `moe_jax.run.door`. `train.py` and
`sample.py` in a clone call the same mains."""
