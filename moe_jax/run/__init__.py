"""Run directories: their layout (`layout`), the one writer's lock (`lock`), Orbax checkpoints
(`checkpoints`), params-only checkpoints written and read a chunk at a time (`stream_save`),
what a training run may do with one (`policy`), every command's output whole or not at all
(`output`), the door every command's main goes through (`door`), and the jitted programs a
run builds, kept for a second run of the same model in the process (`programs`). Loading a run for
inference is `moe_jax.inference.load`, starting a run from one `moe_jax.train.init_from`."""
