"""The console scripts (`moe-jax-train`, `moe-jax-sample`) and what they share: the shipped
configs by name (`configs.py`) and the one door every command of moe_jax goes through
(`entry.py`: its errors and signals as one line and an exit status). `train.py` and
`sample.py` in a clone call the same mains."""
