"""How a run spans devices: the mesh section, checking its own fields."""

from __future__ import annotations

from dataclasses import dataclass

from moe_jax.backends import WEIGHT_GATHERS
from moe_jax.config.checks import one_of, require

# The axes a mesh.* size names, outermost first: `context` (sequence shards) sits beside
# `tensor`, inside the batch axes, as its collectives move activations every layer.
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
CONTEXT_STRATEGIES = ("all_gather", "ring")  # mesh.context_strategy (model/context_parallel.py)


@dataclass(frozen=True)
class MeshConfig:
    # The mesh's axes: devices along each (their product: every device; -1 on one axis: the
    # rest). data: batch replicas; fsdp: batch and params' embed dim; expert: batch and experts
    data: int = 1
    fsdp: int = 1  # see data
    expert: int = 1  # see data
    # Context parallelism: every sequence split into `context` shards through the whole layer
    # stack, in the load-balanced causal layout (moe_jax/model/context_parallel.py).
    context: int = 1
    tensor: int = 1  # heads and MLP hidden dims split over it
    # How attention sees the other shards' keys: all_gather (each shard gathers K/V) | ring
    # (K/V blocks passed round the axis, one step per shard, merged by log-sum-exp).
    context_strategy: str = "all_gather"
    # Multi-slice (TPU slices, or GPU hosts, joined by the data-center network): the data axis
    # spans `slices` slices, each holding data/slices of it; the other axes stay in a slice.
    slices: int = 1
    # Let a mesh axis take part of a physical torus axis (e.g. fsdp=8 x expert=8 on v5p-128's
    # 4x4x4): jax refuses such layouts by default, as their collectives may share links.
    split_physical_axes: bool = False
    # How training gathers the attention weights and the head, split over the batch axes, and
    # reduces their gradients (moe_jax/backends.py): auto | partitioner (XLA's) | steps
    # (inside a shard_map, one batch axis at a time: reduce-scatters over one axis each; TPU's)
    weight_gather: str = "auto"
    # With the steps: the most devices one of their collectives spans (-1 = auto: 8 on TPU,
    # 0 elsewhere; 0 = a whole axis). A longer batch axis is gathered in steps of at most this
    # many devices: the rest that groups of it do not tile first (consecutive devices), then
    # the groups across them (fsdp 64: 8 x 8; fsdp 256: 4, 8, 8; expert 16: 2, 8;
    # moe_jax/model/weight_gather.py).
    gather_group: int = -1
    # multi-host (jax.distributed): on with `distributed` or when a coordinator / more than one
    # process is given; unset fields come from JAX_COORDINATOR_ADDRESS or the cluster's env
    distributed: bool = False
    coordinator_address: str = ""  # host:port of process 0; "": from the environment
    num_processes: int = 0  # 0: from the environment
    process_id: int = -1  # -1: from the environment

    def check(self) -> None:
        one_of(self.weight_gather, WEIGHT_GATHERS, "mesh.weight_gather")
        one_of(self.context_strategy, CONTEXT_STRATEGIES, "mesh.context_strategy")
        require(
            self.gather_group >= -1,
            f"mesh.gather_group must be -1 (auto), 0 (whole axes) or a group size, got "
            f"{self.gather_group}",
        )
        for axis in MESH_AXES:
            v = getattr(self, axis)
            require(v >= 1 or v == -1, f"mesh.{axis} must be >= 1 or -1 (the rest), got {v}")
        require(
            sum(getattr(self, ax) == -1 for ax in MESH_AXES) <= 1,
            "at most one mesh axis may be -1",
        )
        require(self.slices >= 1, f"mesh.slices must be >= 1, got {self.slices}")
        require(
            self.num_processes >= 0,
            f"mesh.num_processes must be >= 0 (0 = from the environment), got {self.num_processes}",
        )
        require(
            self.process_id >= -1
            and (self.num_processes == 0 or self.process_id < self.num_processes),
            f"mesh.process_id ({self.process_id}) must be within [0, mesh.num_processes) "
            f"(num_processes {self.num_processes}), or -1 for the environment's",
        )
