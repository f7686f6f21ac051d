"""FLOPs / MFU accounting and the metric writers (JSONL always; TensorBoard, W&B, MLflow as
trackers beside it: `train.trackers`, moe_jax/observe/trackers.py).

Records are flat dicts with a "kind" ("info", "train", "eval", or "downstream": the harness
tasks' metrics named "<task>/<metric>", moe_jax/eval/in_training.py) and a "step". The JSONL file
`RUN_DIR/metrics.jsonl` is the source of truth (read by `observe.plot`); a resumed run appends
to it, and readers keep the *last* record of each (kind, step), so steps repeated after a crash
between two checkpoints are superseded by the rerun. TensorBoard event files go to `RUN_DIR/tb`;
every tracker gets the same scalars (`scalars`).

MFU = achieved model FLOP/s / the job's peak FLOP/s, where model FLOPs per token come from
`summary.counts.train_flops_per_token` (active experts only). The peak of one compute unit is
`train.peak_flops`, or when that is 0: on a TPU or GPU the chip's dense bf16 peak
(`BF16_PEAK_FLOPS`, the vendors' figures, as MaxText and the papers quote MFU), on CPU one
measured at start-up with a large jitted matmul (the most a dense fp32 kernel reaches on it).
The job's peak is that times `compute_units()`: accelerators, or hosts on CPU.
"""

from __future__ import annotations

import functools
import json
import math
import socket
import sys
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

METRICS_FILE = "metrics.jsonl"

# Per-MoE-layer series of a train record -> their TensorBoard group (one scalar a layer).
LAYER_SERIES = {
    "dropped_frac": "moe_dropped",
    "exchange_rounds": "moe_exchange_rounds",
    "overflow_frac": "moe_exchange_overflow",
}

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


def _jsonable(v):
    if isinstance(v, np.ndarray | jax.Array):
        return np.asarray(v).tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _ends_a_line(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def scalars(record: dict) -> dict[str, float]:
    """A train / eval / downstream record as the trackers' scalars, "<kind>/<key>" (per-layer
    series one a layer, LAYER_SERIES; each layer's busiest expert's load relative to an even
    split, 1 = balanced, as moe_max_load/layerN). An info record has none."""
    if record["kind"] == "info":
        return {}
    out, prefix = {}, record["kind"]
    for key, value in record.items():
        if key in ("kind", "step") or value is None:
            continue
        if isinstance(value, int | float):
            out[f"{prefix}/{key}"] = float(value)
        elif key in LAYER_SERIES:
            for layer, v in enumerate(value):
                out[f"{LAYER_SERIES[key]}/layer{layer}"] = float(v)
        elif key == "expert_load":
            for layer, loads in enumerate(value):
                out[f"moe_max_load/layer{layer}"] = float(max(loads) * len(loads))
    return out


def summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch where torch is not yet imported:
    tensorboardX imports it when it is installed (4 s at a run's start, measured) only to
    accept torch tensors, and a run writes floats."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardTracker:
    """Scalars to TensorBoard event files in RUN_DIR/tb."""

    def __init__(self, run_dir: str | Path):
        self._tb = summary_writer()(str(Path(run_dir) / "tb"), flush_secs=30)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self._tb.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self._tb.close()


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl, the source of truth, and hands each to the
    trackers (`moe_jax.observe.trackers`: objects with write(record) and close()), TensorBoard's
    (RUN_DIR/tb) unless `tensorboard` is False."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, trackers: tuple = ()):
        path = Path(run_dir) / METRICS_FILE
        cut_off = path.is_file() and path.stat().st_size > 0 and not _ends_a_line(path)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if cut_off:  # a killed writer left half a record: start the next one on its own line
            self._jsonl.write("\n")
        self.trackers = [TensorBoardTracker(run_dir)] if tensorboard else []
        self.trackers += list(trackers)

    def write(self, record: dict) -> None:
        record = {k: _jsonable(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for tracker in self.trackers:
            tracker.write(record)

    def close(self) -> None:
        self._jsonl.close()
        for tracker in self.trackers:
            tracker.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Records of RUN_DIR/metrics.jsonl in step order, the last one winning per (kind, step).
    A line that is not a whole record (a write cut off when the process was killed) is
    skipped: the steps after it were rerun from a checkpoint and logged again."""
    latest: dict[tuple[str, int], dict] = {}
    path = Path(run_dir) / METRICS_FILE
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
            latest[(r["kind"], r["step"])] = r
        except (ValueError, TypeError, KeyError):
            continue
    return sorted(latest.values(), key=lambda r: (r["step"], r["kind"]))
