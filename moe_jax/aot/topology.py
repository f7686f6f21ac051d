"""Accelerator slices by name, as compile-only JAX devices on this machine.

    topo = get_topology("v5p-128")     # 64 TPU v5p chips on a 4x4x4 torus, 16 hosts
    topo = get_topology("h100:4x8")    # 4 hosts of 8 H100 GPUs
    mesh = make_mesh(cfg, topo.devices)

JAX compiles for a TPU slice with the PyPI `libtpu` wheel and for NVIDIA GPUs with the CUDA
plugin on a machine that has neither (`pip install -e '.[aot]'`):
`jax.experimental.topologies.get_topology_desc` returns devices that programs can be compiled
for but not run on. `moe_jax.aot.command` builds its meshes over them.

Names follow the cloud's: `v4-N` and `v5p-N` count TensorCores (two per chip, so v5p-128 is 64
chips), `v5e-N` and `v6e-N` count chips. The torus shapes and hosts are the ones the cloud
provisions (MaxText's table of them agrees for every shape listed there). A GPU cluster is
`h100:HOSTSxGPUS` or `h200:HOSTSxGPUS`: GPUs within a host share NVLink, hosts talk over the
network. `num_slices` > 1 asks for that many identical slices joined by the data-center network
(multi-slice; `mesh.slices`).

HBM per device is what the compiler checks a program against: libtpu refuses one that does not
fit and names the figure (v4 30.75 GiB of its 32, v5p 95.74, v5e 15.75, v6e 31.25, checked with
libtpu 0.0.42); for GPUs it is the card's memory from XLA's device description (JAX's allocator
takes 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass

from moe_jax.errors import MoeJaxError

GIB = 1 << 30


class TopologyError(MoeJaxError, ValueError):
    """An unknown or unusable topology name; the message lists the valid ones."""


@dataclass(frozen=True)
class TpuChip:
    generation: str  # libtpu's name for the topology string: "v4", "v5", "v5e", "v6e"
    dims: int  # torus dimensions
    cores_per_chip: int  # how many TensorCores the name's N counts per chip
    chip_config: str  # "megacore" (two cores act as one device) or "default"
    hbm_bytes: int  # what libtpu checks a program against


TPU_CHIPS = {
    "v4": TpuChip("v4", 3, 2, "megacore", int(30.75 * GIB)),
    "v5p": TpuChip("v5", 3, 2, "megacore", int(95.74 * GIB)),
    "v5e": TpuChip("v5e", 2, 1, "default", int(15.75 * GIB)),
    "v6e": TpuChip("v6e", 2, 1, "default", int(31.25 * GIB)),
}
# Chip counts -> 2D torus (v5e, v6e) and its wrap-around links, as provisioned.
TORUS_2D = {
    1: ((1, 1), (False, False)),
    4: ((2, 2), (False, False)),
    8: ((2, 4), (False, False)),
    16: ((4, 4), (False, False)),
    32: ((4, 8), (False, False)),
    64: ((8, 8), (False, False)),
    128: ((8, 16), (False, True)),
    256: ((16, 16), (True, True)),
}
SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
MAX_3D_CHIPS = 4096  # v5p-8192


@dataclass(frozen=True)
class GpuCard:
    name: str  # XLA's device description
    hbm_bytes: int
    memory_bandwidth: int  # bytes/s
    clock_ghz: float
    cores: int  # streaming multiprocessors


# Facts from XLA's GPU target specs (xla/backends/gpu/target_config/specs/*.txtpb).
GPU_CARDS = {
    "h100": GpuCard("NVIDIA H100 80GB HBM3", 84942979072, 3352320000000, 1.98, 132),
    "h200": GpuCard("NVIDIA H200 141GB HBM3e", 151397597184, 4800000000000, 1.98, 132),
}
MAX_GPUS_PER_HOST = 8


@dataclass(frozen=True)
class Topology:
    name: str
    platform: str  # "tpu" | "gpu"
    devices: tuple  # compile-only jax devices, in the topology's order
    hbm_bytes: int  # per device
    n_hosts: int  # processes that would run the program
    shape: str  # the torus or HOSTSxGPUS, for reports

    @property
    def n_devices(self) -> int:
        return len(self.devices)


def valid_names() -> str:
    return (
        "v4-N / v5p-N (N TensorCores, 2 per chip: 8, 16, 32, 64, then multiples of 128 up to "
        "8192), v5e-N / v6e-N (N chips: 1, 4, 8, 16, 32, 64, 128, 256), h100:HOSTSxGPUS / "
        f"h200:HOSTSxGPUS (1-{MAX_GPUS_PER_HOST} GPUs a host, e.g. h100:1x8, h100:4x8)"
    )


def _unknown(name: str, why: str = "") -> TopologyError:
    detail = f" ({why})" if why else ""
    return TopologyError(f"unknown topology '{name}'{detail}; valid: {valid_names()}")


def torus_3d(chips: int) -> tuple[tuple[int, int, int], tuple[bool, bool, bool]] | None:
    """The provisioned 3D torus of `chips` v4/v5p chips: full 4x4x4 cubes and up have every
    dimension a multiple of 4 with wrap-around links, the squarest such shape; smaller slices
    are fixed shapes without wrap-around."""
    if chips in SMALL_3D:
        return SMALL_3D[chips], (False, False, False)
    if chips <= 0 or chips % 64 or chips > MAX_3D_CHIPS:  # v5p-0 is no slice
        return None
    n = chips // 64
    shapes = itertools.combinations_with_replacement(range(1, n + 1), 3)
    best = min((d for d in shapes if math.prod(d) == n), key=lambda d: (max(d), -min(d)))
    return tuple(4 * x for x in sorted(best)), (True, True, True)


def _tpu_spec(name: str) -> tuple[TpuChip, tuple[int, ...], tuple[bool, ...]]:
    m = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name)
    if not m:
        raise _unknown(name)
    chip, n = TPU_CHIPS[m.group(1)], int(m.group(2))
    if n % chip.cores_per_chip:
        raise _unknown(name, f"{m.group(1)} counts {chip.cores_per_chip} cores a chip")
    chips = n // chip.cores_per_chip
    found = torus_3d(chips) if chip.dims == 3 else TORUS_2D.get(chips)
    if found is None:
        raise _unknown(name, f"no {m.group(1)} slice has {chips} chips")
    return chip, *found


def get_topology(name: str, num_slices: int = 1) -> Topology:
    """Compile-only devices of the slice `name` (times `num_slices`). Needs the `aot` extra."""
    # libtpu refuses to load in a second process at once unless told that is fine, as it is
    # when nothing runs on a TPU (a test worker beside an `aot` command, say).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    name = name.strip().lower()
    if num_slices < 1:
        raise TopologyError(f"num_slices must be >= 1, got {num_slices}")
    if ":" in name:
        card_name, _, layout = name.partition(":")
        m = re.fullmatch(r"(\d+)x(\d+)", layout)
        if card_name not in GPU_CARDS or not m:
            raise _unknown(name)
        hosts, gpus = int(m.group(1)), int(m.group(2))
        if not (hosts >= 1 and 1 <= gpus <= MAX_GPUS_PER_HOST):
            raise _unknown(name, f"1-{MAX_GPUS_PER_HOST} GPUs a host, at least one host")
        card = GPU_CARDS[card_name]
        # Hosts of the slices in order: a multi-slice GPU job is just more hosts.
        topo = _with_plugin_check(
            "gpu",
            lambda: topologies.get_topology_desc(
                platform="cuda",
                topology_name=card_name,
                target_config=gpu_target_config(card),
                topology=f"1x{hosts * num_slices}x{gpus}",
            ),
        )
        return Topology(
            name, "gpu", tuple(topo.devices), card.hbm_bytes, hosts * num_slices, f"{hosts}x{gpus}"
        )
    chip, torus, wrap = _tpu_spec(name)
    host_bounds = (1, 1, 1) if math.prod(torus) == 1 else (2, 2, 1)
    topo = _with_plugin_check(
        "tpu",
        lambda: topologies.get_topology_desc(
            platform="tpu",
            topology_name=f"{chip.generation}:{'x'.join(map(str, torus))}",
            chip_config_name=chip.chip_config,
            chips_per_host_bounds=host_bounds,
            num_slices=num_slices,
            wrap=tuple(wrap) + (False,) * (3 - len(wrap)),
        ),
    )
    devices = tuple(topo.devices)
    n_hosts = len({d.process_index for d in devices})
    return Topology(name, "tpu", devices, chip.hbm_bytes, n_hosts, "x".join(map(str, torus)))


def _with_plugin_check(platform: str, make):
    """`make()`, with a missing compiler plugin named along with the install that brings it."""
    try:
        return make()
    except Exception as e:  # jax raises RuntimeError/ValueError/NotImplementedError here
        text = " ".join(str(e).split())
        what = "libtpu" if platform == "tpu" else "the jax CUDA plugin"
        raise TopologyError(
            f"cannot compile for {platform.upper()} here: {what} is not installed or did not "
            f"load ({text[:200]}); install it with `pip install -e '.[aot]'` and run with "
            "JAX_PLATFORMS=cpu"
        ) from None


def gpu_target_config(card: GpuCard) -> str:
    """XLA's GpuTargetConfigProto text for `card` (what the compiler needs to know of it)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {card.cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {card.memory_bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: {card.clock_ghz}
  device_memory_size: {card.hbm_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{card.name}"
"""
