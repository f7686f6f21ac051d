"""The console scripts (`moe-jax-train`, `moe-jax-sample`) and what they share: the shipped
configs by name (`configs.py`). `train.py` and `sample.py` in a clone call the same mains."""
