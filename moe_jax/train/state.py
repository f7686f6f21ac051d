"""The train state, one dict however a run starts (fresh, resumed, or from another run's
params): {"step": int32 scalar, "params": the model's nnx.Param state, "opt_state": optax's}.
Below the train step and the run directory, so that both build it the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def make_state(step, params, opt_state, step_sharding=None) -> dict:
    """The train state: {"step": int32 scalar, "params", "opt_state"} (fresh, resumed or
    started from another run's params), the step placed by `step_sharding` when given."""
    step = jnp.asarray(step, jnp.int32)
    if step_sharding is not None:
        step = jax.device_put(step, step_sharding)
    return {"step": step, "params": params, "opt_state": opt_state}
