"""The console scripts: `moe-jax SUBCOMMAND` (`main.py`, every command) and the older
`moe-jax-train` / `moe-jax-sample` (`train.py`, `sample.py`), and the launchers' storage check
(`shared_storage.py`). The shipped configs by name are `moe_jax.config.shipped`. The one door
every command of moe_jax goes through is `moe_jax.run.door`. `train.py` and `sample.py` in a
clone call the same mains."""
