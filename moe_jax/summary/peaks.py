"""The peak FLOP/s MFU divides by: MFU = achieved model FLOP/s / the job's peak FLOP/s, where
model FLOPs per token come from `summary.counts.train_flops_per_token` (active experts only).
The peak of one compute unit is `train.peak_flops`, or when that is 0: on a TPU or GPU the
chip's dense bf16 peak (`BF16_PEAK_FLOPS`, the vendors' figures, as MaxText and the papers
quote MFU), on CPU one measured at start-up with a large jitted matmul (the most a dense fp32
kernel reaches on it). The job's peak is that times `compute_units()`: accelerators, or hosts
on CPU.
"""

from __future__ import annotations

import functools
import math
import socket
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

# Dense bf16 matmul FLOP/s of one device by the start of jax's `device_kind`, the first match
# wins (vendors' data sheets; H100 and H200 SXM without sparsity).
BF16_PEAK_FLOPS = (
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5", 459e12),  # v5p
    ("TPU v6 lite", 918e12),  # v6e
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100", 989e12),
    ("NVIDIA H200", 989e12),
)


def chip_peak_flops(device_kind: str) -> float | None:
    """The bf16 peak of an accelerator of this kind, or None for a kind not in the table."""
    return next((peak for kind, peak in BF16_PEAK_FLOPS if device_kind.startswith(kind)), None)


def unit_peak_flops(configured: float) -> tuple[float, str]:
    """-> (peak FLOP/s of one compute unit, where it comes from): `configured` if set, else
    the accelerator's bf16 peak from the table, else (CPU, or a chip the table lacks) measured.
    Call it outside `jax.set_mesh` (see measure_peak_flops)."""
    if configured:
        return configured, "train.peak_flops"
    kind = jax.devices()[0].device_kind
    if jax.default_backend() != "cpu" and (peak := chip_peak_flops(kind)):
        return peak, f"bf16 peak of a {kind}"
    return measure_peak_flops(), "measured jnp.dot peak"


def measure_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` jitted fp32 [n, n] @ [n, n] matmuls on one device.
    Call it outside `jax.set_mesh`: under a mesh the matmul runs replicated on every device.

    Every process of a multi-process run calls it and gets process 0's figure, measured while
    the others wait: processes sharing a host would each time only a share of its cores."""
    if not jax.sharding.get_abstract_mesh().empty:
        raise RuntimeError("measure_peak_flops() under a mesh would time every device at once")
    if jax.process_count() > 1:
        mine = _matmul_flops(n, repeats) if jax.process_index() == 0 else 0.0
        return float(multihost_utils.broadcast_one_to_all(np.float32(mine)))
    return _matmul_flops(n, repeats)


@functools.cache  # a process that trains again (a test, a sweep) times the same cores again
def _matmul_flops(n: int, repeats: int) -> float:
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(jnp.dot)
    matmul(a, a).block_until_ready()  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def compute_units() -> int:
    """How many peaks the job has: every accelerator is one, but the CPU devices of a host
    (many of them when simulated with --xla_force_host_platform_device_count, of one or more
    processes) share its cores, which one matmul already keeps busy, so a CPU job has one per
    host. Hosts are told apart by name (gathered from every process, which must all call it)."""
    if jax.default_backend() != "cpu":
        return jax.device_count()
    if jax.process_count() == 1:
        return 1
    name = np.uint32(zlib.crc32(socket.gethostname().encode()))
    return len(np.unique(multihost_utils.process_allgather(name)))
