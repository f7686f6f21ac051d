"""The metric writers: JSONL always; TensorBoard, W&B, MLflow as trackers beside it
(`train.trackers`, observe/trackers.py).

Records are flat dicts with a "kind" ("info", "train", "eval", or "downstream": the harness
tasks' metrics named "<task>/<metric>", moe_jax/eval/in_training.py) and a "step". The JSONL file
`RUN_DIR/metrics.jsonl` is the source of truth (read by `observe.plot`); a resumed run appends
to it, and readers keep the *last* record of each (kind, step), so steps repeated after a crash
between two checkpoints are superseded by the rerun. TensorBoard event files go to `RUN_DIR/tb`;
every tracker gets the same scalars (`scalars`). The MFU the train records carry is
accounted in `moe_jax.summary` (counts: FLOPs per token; peaks: the peak FLOP/s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"

# Per-MoE-layer series of a train record -> their TensorBoard group (one scalar a layer).
LAYER_SERIES = {
    "dropped_frac": "moe_dropped",
    "exchange_rounds": "moe_exchange_rounds",
    "overflow_frac": "moe_exchange_overflow",
    "max_logit": "attn_max_logit",  # train.qk_clip: every layer's largest attention logit
}


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
