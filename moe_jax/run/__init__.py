"""Run directories: their layout (`layout`), the one writer's lock (`lock`), Orbax checkpoints
(`store`) and what a training run may do with one (`policy`). Loading a run for inference is
`moe_jax.inference.load`, above the model."""
