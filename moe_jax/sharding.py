"""Logical-axis annotations for parameters and the one table mapping them to mesh axes.

Every parameter is created with a tuple of *logical* axis names (`("embed", "mlp")`); the table
below says which mesh axis (`data`, `fsdp`, `expert`, `tensor`) shards each logical axis, as
fixed in DESIGN.md. Each logical name appears once (NNX rules are last-write-wins).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

MESH_AXES = ("data", "fsdp", "expert", "tensor")

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("layers", None),
)


def mesh_is_set() -> bool:
    """True inside `jax.set_mesh(mesh)`: then parameters are created already sharded."""
    return not jax.sharding.get_abstract_mesh().empty


def param(
    rngs: nnx.Rngs,
    init: Callable,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
) -> nnx.Param:
    """A float32 parameter initialised by `init` and annotated with logical `axes`."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(
        init(rngs.params(), shape, jnp.float32),
        out_sharding=axes,
        sharding_rules=LOGICAL_RULES,
        eager_sharding=mesh_is_set(),
    )
