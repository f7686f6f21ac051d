"""Logical-axis annotations for parameters and the one table mapping them to mesh axes.

Every parameter is created with a tuple of *logical* axis names (`("embed", "mlp")`); the table
below says which mesh axis (`data`, `fsdp`, `expert`, `tensor`) shards each logical axis, as
fixed in DESIGN.md. Each logical name appears once (NNX rules are last-write-wins).

The `context` axis splits no parameter: it splits the sequence dim of the activations
(`at_block_boundary`, the expert-parallel map, context-parallel attention), so every weight
is replicated over it and its gradient summed over it, as over `data`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import MESH_AXES, Config, ConfigError, check_context
from moe_jax.process_setup import drop_gloo_noise

BATCH_AXES = ("data", "fsdp", "expert")  # the batch is split over all of these
CONTEXT_AXIS = "context"  # the sequence of every row is split over this one

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    # ZeRO-3: every weight is split over each batch axis that does not split it already
    # (`data` replicates): a non-expert weight's model dim over fsdp x expert; an expert
    # weight (its experts split over `expert`) over fsdp, on its minor dim: the down
    # projection's model dim, the gate/up projections' hidden dim after tensor's split.
    # XLA:TPU turns the reduce-scatter of a gradient along a non-minor dim into an all-reduce
    # of the whole gradient and a slice (seen for Mixtral's [1, 4096, 14336]).
    ("embed", ("fsdp", "expert")),
    ("expert_embed", "fsdp"),
    # MLA's low-rank dim of its up-projections [rank, H, dh] (moe_jax/model/mla.py): kept
    # whole, they and their moments replicated 0.6 GiB a layer on every chip (DeepSeek-V3:
    # 38 GiB over 62 layers); split over fsdp, the partitioner gathers them.
    ("latent", "fsdp"),
    ("expert_mlp_fsdp", ("tensor", "fsdp")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("layers", None),
)
# The config values that size the "latent" dim of MLA's weights (q_lora_rank 0: no such weight)
MLA_RANKS = ("q_lora_rank", "kv_lora_rank")
# Sampling reads every weight at every decode step, so a weight split over an axis that does
# not split its compute is gathered at every step: there the non-expert weights' model dim is
# split over fsdp only (a sampling mesh with fsdp > 1 gathers them, memory for bandwidth), never
# over `expert`, whose devices each run the same tokens through those weights.
INFERENCE_RULES = tuple((k, "fsdp" if k == "embed" else v) for k, v in LOGICAL_RULES)


def rollout_mesh(mesh: Mesh) -> Mesh:
    """`mesh`'s devices with its fsdp axis folded into `data` (fsdp 1), on which GRPO's sampler
    lays the train state's weights out by INFERENCE_RULES once a step (`rl.collect`): no weight
    split over fsdp (nor `expert`), the experts over `expert` (and `tensor`) only, so the
    decode loop gathers no weight, where the training layout all-gathered every fsdp-split
    weight at every decode step (Qwen3-30B-A3B at fsdp 4 x expert 8: ~9 GiB a chip a step).
    The batch axes split the rows device for device as on `mesh` (row block d F E + f E + e
    either way), so each fsdp group samples its own rows. A mesh rather than a rules table:
    the expert-parallel layer reads whether its weights are split over fsdp from the mesh
    (`exchange.mesh_axes`)."""
    assert tuple(mesh.axis_names) == MESH_AXES, mesh.axis_names
    s = mesh.shape
    devices = mesh.devices.reshape(s["data"] * s["fsdp"], 1, s["expert"], s["context"], s["tensor"])
    return Mesh(devices, MESH_AXES, axis_types=mesh.axis_types)


def param(
    rngs: nnx.Rngs,
    init: Callable,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
) -> nnx.Param:
    """A float32 parameter initialised by `init` and annotated with logical `axes`."""
    assert len(axes) == len(shape), (shape, axes)
    # The rules travel with the param so Flax's own sharding helpers (nnx.eval_shape under a
    # mesh, nnx.get_partition_spec) resolve the logical names the same way we do.
    return nnx.Param(
        init(rngs.params(), shape, jnp.float32),
        out_sharding=axes,
        sharding_rules=LOGICAL_RULES,
        eager_sharding=False,
    )


# ----------------------------------------------------------------------------- the mesh


def mesh_shape(cfg: Config, n_devices: int, inference: bool = False) -> dict[str, int]:
    """Resolve `-1` and check the mesh against the devices and the model's shapes (for
    training, or with `inference` for sampling: INFERENCE_RULES, no train batch)."""
    sizes = {ax: getattr(cfg.mesh, ax) for ax in MESH_AXES}
    known = math.prod(v for v in sizes.values() if v != -1)
    for ax, v in sizes.items():
        if v == -1:
            if n_devices % known:
                raise ConfigError(
                    f"mesh.{ax}=-1: {n_devices} devices do not divide by the other axes ({known})"
                )
            sizes[ax] = n_devices // known
    total = math.prod(sizes.values())
    if total != n_devices:
        shape = " x ".join(f"{ax}={v}" for ax, v in sizes.items())
        raise ConfigError(
            f"mesh {shape} has {total} devices but {n_devices} are available; "
            "make the product of mesh.data/fsdp/expert/context/tensor equal the device count "
            "(or use -1)"
        )
    _check_divisible(cfg, sizes, inference)
    if sizes["context"] > 1:
        check_context(cfg, sizes["context"], inference)
    return sizes


def _check_divisible(cfg: Config, sizes: dict[str, int], inference: bool) -> None:
    m, a, e, t = cfg.model, cfg.attention, cfg.moe, cfg.train
    checks = [
        ("moe.n_experts", e.n_experts, "expert"),
        ("attention.n_heads", a.n_heads, "tensor"),
        # mla has no key/value heads (its latent cache is not split over tensor)
        *([("attention.n_kv_heads", a.n_kv_heads, "tensor")] if a.kind == "gqa" else []),
        ("model.vocab_size", m.vocab_size, "tensor"),
    ]
    if any(not cfg.is_moe(i) for i in range(m.n_layers)):
        checks.append(("model.ffn_hidden", m.ffn_hidden, "tensor"))
    if e.n_experts > 0:
        checks.append(("moe.expert_hidden", e.expert_hidden, "tensor"))
        if e.shared_expert_hidden:
            checks.append(("moe.shared_expert_hidden", e.shared_expert_hidden, "tensor"))
    for key, value, ax in checks:
        if value % sizes[ax]:
            raise ConfigError(f"{key} ({value}) must be divisible by mesh.{ax} ({sizes[ax]})")
    # ZeRO's splits (LOGICAL_RULES: "embed", "expert_mlp_fsdp") over two axes at once
    products = [("model.d_model", m.d_model, ("fsdp",) if inference else ("fsdp", "expert"))]
    if a.kind == "mla":  # the "latent" dim
        products += [(f"attention.{k}", getattr(a, k), ("fsdp",)) for k in MLA_RANKS]
    if e.n_experts > 0:
        products.append(("moe.expert_hidden", e.expert_hidden, ("tensor", "fsdp")))
    for key, value, axes in products:
        n = math.prod(sizes[ax] for ax in axes)
        if value % n:
            raise ConfigError(
                f"{key} ({value}) must be divisible by mesh.{'*'.join(axes)} ({n}), the axes "
                "the weights split it over"
            )
    if inference:  # a sampling batch that does not divide runs replicated
        return
    group = cfg.mesh.gather_group
    for ax in ("fsdp", "expert"):  # the axes that split weights
        if group > 0 and sizes[ax] > group and sizes[ax] % group:
            raise ConfigError(
                f"mesh.gather_group ({group}) must divide mesh.{ax} ({sizes[ax]}), which is "
                "gathered in groups of that many devices; choose a divisor, or 0 for whole axes"
            )
    n_batch = math.prod(sizes[ax] for ax in BATCH_AXES)
    micro = t.batch_size // t.grad_accum
    if micro % n_batch:
        raise ConfigError(
            f"micro-batch train.batch_size/train.grad_accum ({micro}) must be divisible by "
            f"mesh.data*fsdp*expert ({n_batch}), the axes the batch is split over"
        )


def make_mesh(cfg: Config, devices: list | None = None, inference: bool = False) -> Mesh:
    """The device mesh of `cfg.mesh`. All axes 1 means one device (the first); any other
    shape must use every device (of every process). `inference`: a mesh for sampling, checked
    against INFERENCE_RULES and no training batch.

    The devices are laid out by jax's mesh utilities, which follow the physical interconnect:
    on a TPU torus each mesh axis gets whole torus axes (or, with `mesh.split_physical_axes`,
    parts of them), and with `mesh.slices` > 1 the data axis runs across the slices (TPU
    slices, or hosts where devices name no slice) so that only its collectives cross the
    data-center network."""
    devices = list(devices if devices is not None else jax.devices())
    if all(getattr(cfg.mesh, ax) == 1 for ax in MESH_AXES) and cfg.mesh.slices == 1:
        devices = devices[:1]
    sizes = mesh_shape(cfg, len(devices), inference)
    shape = tuple(sizes[ax] for ax in MESH_AXES)
    split, slices = cfg.mesh.split_physical_axes, cfg.mesh.slices
    try:
        if slices > 1:
            if sizes["data"] % slices:
                raise ConfigError(
                    f"mesh.data ({sizes['data']}) must be divisible by mesh.slices ({slices}): "
                    "the data axis is the one that spans the slices"
                )
            per_slice = (sizes["data"] // slices, *shape[1:])
            array = mesh_utils.create_hybrid_device_mesh(
                per_slice,
                (slices,) + (1,) * (len(shape) - 1),
                devices,
                # GPUs (and CPUs) name no slices: each host (process) is one
                process_is_granule=len({getattr(d, "slice_index", 0) for d in devices}) == 1,
                allow_split_physical_axes=split,
            )
        else:
            array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
    except (ValueError, NotImplementedError, AssertionError) as e:
        raise _mesh_error(cfg, sizes, e) from None
    return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _mesh_error(cfg: Config, sizes: dict[str, int], e: Exception) -> ConfigError:
    shape = " x ".join(f"{ax}={v}" for ax, v in sizes.items())
    detail = " ".join(str(e).split())
    if isinstance(e, ConfigError):
        return e
    if "allow_split_physical_axes" in detail or "split" in detail.lower():
        return ConfigError(
            f"mesh {shape} does not map onto the devices' physical axes without splitting one "
            "between two mesh axes; set mesh.split_physical_axes=true (collectives of the two "
            "axes may then share links), or choose axis sizes that are products of the torus's"
        )
    if cfg.mesh.slices > 1:
        return ConfigError(
            f"mesh {shape} cannot span mesh.slices={cfg.mesh.slices} ({detail[:200]}); the "
            "devices must come in that many equal slices (or hosts), each holding "
            "mesh.data/slices x fsdp x expert x context x tensor of them"
        )
    return ConfigError(f"mesh {shape} cannot be laid out over the devices: {detail[:300]}")


def init_distributed(cfg: Config) -> None:
    """Join a multi-process run through JAX's own runtime (before any other JAX call).

    Enabled by `mesh.distributed=true`, or implied by `mesh.coordinator_address` /
    `mesh.num_processes > 1`. Unset fields come from JAX_COORDINATOR_ADDRESS or the cluster's
    environment (SLURM, Open MPI, TPU pods...), as `jax.distributed.initialize` detects them.
    """
    m = cfg.mesh
    if not (m.distributed or m.coordinator_address or m.num_processes > 1):
        return
    gloo = jax.config.jax_platforms in (None, "", "cpu")
    if gloo:  # XLA:CPU needs a collectives backend to reduce across processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=m.coordinator_address or None,
            num_processes=m.num_processes or None,
            process_id=m.process_id if m.process_id >= 0 else None,
        )
    except (ValueError, RuntimeError) as e:  # nothing given or detected, no coordinator, ...
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"cannot join the multi-process run ({detail}); set mesh.coordinator_address "
            "(host:port of process 0), mesh.num_processes and mesh.process_id, or run under "
            "a cluster manager JAX detects (SLURM, Open MPI)"
        ) from None
    if gloo:
        drop_gloo_noise()


def n_batch_shards(mesh: Mesh | None = None) -> int:
    """How many routing groups the batch forms: one per batch shard of the active mesh."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return math.prod(mesh.shape[ax] for ax in BATCH_AXES)


def split_batch_axes(mesh) -> tuple[str, ...]:
    """The batch axes that split anything on `mesh` (size > 1): only these are named in a
    spec, as a size-1 axis named there would still make JAX sum gradients over it."""
    return tuple(ax for ax in BATCH_AXES if mesh.shape[ax] > 1)


def context_size(mesh=None) -> int:
    """How many shards the `context` axis of `mesh` (default: the active one) cuts every
    sequence into; 1 without a mesh or such an axis."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def seq_axis(mesh, T: int) -> str | None:
    """The mesh axis that splits a sequence dim of length `T`: `context` where it is > 1 and
    divides T (a decode step's one token is not split), else None."""
    n = context_size(mesh)
    return CONTEXT_AXIS if n > 1 and T % n == 0 else None


def at_block_boundary(x_B: jax.Array) -> jax.Array:
    """`x_B` [B, T, ...] laid out as between two decoder layers under the mesh set by
    `jax.set_mesh`: rows over the batch axes, the sequence over `context` (when > 1), the
    rest whole on each device. Left to the partitioner otherwise: no mesh, or a batch the
    batch axes do not divide (one sequence decoding runs replicated, see moe.MoE)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or x_B.shape[0] % n_batch_shards(mesh):
        return x_B
    seq = seq_axis(mesh, x_B.shape[1]) if x_B.ndim > 1 else None
    spec = P(split_batch_axes(mesh) or None, *((seq,) if seq else ()))
    return jax.lax.with_sharding_constraint(x_B, spec)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, ...] arrays: batch over (data, fsdp, expert), everything else replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def logical_to_spec(axes: tuple[str | None, ...], rules=LOGICAL_RULES) -> P:
    rules = dict(rules)
    return P(*(rules.get(a) if a is not None else None for a in axes))


def state_shardings(tree, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings mirroring `tree`: Variables by their logical `out_sharding` axes (an
    optimizer state built from params carries them too), any other array replicated.
    `rules`: LOGICAL_RULES (training) or INFERENCE_RULES (sampling)."""

    def one(x):
        if isinstance(x, nnx.Variable):
            axes = x.get_metadata().get("out_sharding")
            spec = logical_to_spec(tuple(axes), rules) if axes else P()
            value = x.get_raw_value()
            if not jax.tree.leaves(value):  # no array: a param whose state another transform
                return x  # of optax.partition keeps (Muon's / AdamW's), an empty MaskedNode
            if isinstance(value, dict):  # a quantised weight's arrays (moe_jax.model.int8)
                specs = x.raw_specs(spec, value)
                return x.replace({k: NamedSharding(mesh, specs[k]) for k in value})
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_shardings(abstract_tree, shardings):
    """Restore target: each abstract leaf's shape and dtype with its sharding."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_tree, shardings
    )


def _row_blocks(mesh: Mesh, batch: int, process_of) -> tuple[dict, dict]:
    """-> (first rows of the row blocks each process's devices hold, ascending; the processes
    holding each block)."""
    blocks: dict[int, set[int]] = {}
    holders: dict[int, set[int]] = {}
    for device, index in batch_sharding(mesh).devices_indices_map((batch,)).items():
        start, p = index[0].start or 0, process_of(device)
        blocks.setdefault(p, set()).add(start)
        holders.setdefault(start, set()).add(p)
    return {p: sorted(b) for p, b in blocks.items()}, holders


def check_batch_split(mesh: Mesh, batch: int, process_of=None, n_processes=None) -> None:
    """Each process feeds B/P rows of every batch (the data pipeline's split) into the row
    blocks its devices hold (`global_batch`): every process must hold as many blocks as the
    others, and no block may sit on two processes' devices, whose rows would disagree. On a
    TPU torus the blocks of one host are seldom adjacent rows, and need not be. `process_of`
    and `n_processes` (default: the devices' own process and the process count) are for
    tests and for compiling for other machines (`moe_jax.aot.command`)."""
    process_of = process_of or (lambda d: d.process_index)
    P = n_processes or jax.process_count()
    if P == 1:
        return
    blocks, holders = _row_blocks(mesh, batch, process_of)
    counts = {len(blocks.get(p, ())) for p in range(P)}
    if len(counts) > 1 or 0 in counts or any(len(h) > 1 for h in holders.values()):
        raise ConfigError(
            f"mesh {dict(mesh.shape)} does not split the batch over the {P} processes, each "
            f"holding its own rows; split it over them with the batch axes, e.g. "
            f"mesh.data={P} (or -1), and keep mesh.tensor within a process"
        )


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows of a batch -> the global batch array, split over the batch axes.

    The process's devices hold some row blocks of the global batch (`check_batch_split`),
    not always adjacent ones; its rows fill them in order. Which global row a window lands
    on changes nothing a step computes: each device's block is still a run of the process's
    stream, and the loss is a mean over rows."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.make_array_from_process_local_data(sharding, local_rows)
    shape = (local_rows.shape[0] * jax.process_count(), *local_rows.shape[1:])
    index_of = sharding.addressable_devices_indices_map(shape)
    shards = [
        jax.device_put(local_rows[rows], device)
        for device, rows in local_blocks(index_of, local_rows.shape[0]).items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def local_blocks(index_of: dict, n_local: int) -> dict:
    """device -> the slice of this process's `n_local` rows it holds: the process's row
    blocks (by their global index, `index_of`) take its rows in order."""
    starts = sorted({index[0].start or 0 for index in index_of.values()})
    size = n_local // len(starts)
    first = {device: starts.index(index[0].start or 0) * size for device, index in index_of.items()}
    return {device: slice(row, row + size) for device, row in first.items()}


def create_sharded(make: Callable[[], nnx.Module], mesh: Mesh | None) -> nnx.Module:
    """Build `make()` with every parameter born sharded over `mesh`: initialisation runs under
    jit with the target out_shardings, so no device ever holds a full unsharded copy."""
    if mesh is None:
        return make()
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = state_shardings(abstract, mesh)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)
