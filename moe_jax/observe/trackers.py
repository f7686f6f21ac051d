"""Experiment trackers behind the metric writer: `train.trackers` lists them, beside
RUN_DIR/metrics.jsonl (always written, the source of truth; `moe_jax.observe.writers`).

- `tensorboard`: event files in RUN_DIR/tb (`metrics.TensorBoardTracker`).
- `wandb`: a Weights & Biases run in project `train.tracker_project`, files under RUN_DIR/wandb.
  Its id is kept in RUN_DIR/wandb_id, so a resumed run continues the same W&B run.
  WANDB_MODE=offline writes it locally (`wandb sync RUN_DIR/wandb/offline-run-*` later).
- `mlflow`: an MLflow run in experiment `train.tracker_project` at `train.tracker_uri`, or a
  local file store RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`); its id is
  kept in RUN_DIR/mlflow_id, so a resume continues the same run.

Each gets the same scalars (`metrics.scalars`) at the record's step and, when its run is
created, the resolved config as hyperparameters (dotted keys). wandb and mlflow are the
`trackers` extra: a tracker whose package is missing is refused in one line before anything
is written (`check_trackers`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import time
from pathlib import Path

from moe_jax.config import Config, ConfigError
from moe_jax.observe.writers import scalars

EXTRA = "pip install 'moe-jax[trackers]'"
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
WANDB_ID_FILE, MLFLOW_ID_FILE = "wandb_id", "mlflow_id"


def check_trackers(cfg: Config) -> None:
    """ConfigError naming the extra to install if a tracker's package is missing."""
    for name in cfg.train.trackers:
        package = PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"train.trackers names {name}, but the {package} package is not installed; "
                f"install it with {EXTRA}, or drop {name} from train.trackers"
            )


def open_trackers(cfg: Config) -> list:
    """The trackers of `train.trackers` other than TensorBoard (MetricsWriter opens that)."""
    makers = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [makers[name](cfg) for name in cfg.train.trackers if name in makers]


def flat_config(cfg: Config) -> dict[str, object]:
    """The config as dotted keys -> values (lists for tuples), for hyperparameter tables."""
    out = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v

    walk(dataclasses.asdict(cfg), "")
    return out


def _kept_id(run_dir: str, file: str, new) -> tuple[str, bool]:
    """-> (the run id kept in RUN_DIR/file, or `new()` written there; whether it is new)."""
    path = Path(run_dir) / file
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip(), False
    run_id = new()
    path.write_text(run_id + "\n")
    return run_id, True


class WandbTracker:
    def __init__(self, cfg: Config):
        import wandb

        run_dir = Path(cfg.run_dir)
        run_id, _ = _kept_id(cfg.run_dir, WANDB_ID_FILE, lambda: secrets.token_hex(4))
        self.run = wandb.init(
            project=cfg.train.tracker_project,
            name=run_dir.resolve().name,
            id=run_id,
            resume="allow",  # the same run again after a resume
            dir=str(run_dir),
            config=flat_config(cfg),
            allow_val_change=True,  # a resume may change training keys (train.steps, ...)
        )

    def write(self, record: dict) -> None:
        if values := scalars(record):
            self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg: Config):
        from mlflow.tracking import MlflowClient

        run_dir = Path(cfg.run_dir).resolve()
        uri = cfg.train.tracker_uri
        if uri is None:  # the local file store, which MLflow 3 refuses unless this is set
            uri = (run_dir / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=uri)
        name = cfg.train.tracker_project
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else client.create_experiment(name)
        new = lambda: client.create_run(experiment, run_name=run_dir.name).info.run_id
        self.run_id, created = _kept_id(cfg.run_dir, MLFLOW_ID_FILE, new)
        if created:  # a resumed run keeps the hyperparameters it started with
            self._log_params(flat_config(cfg))
        else:
            client.update_run(self.run_id, "RUNNING")

    def _log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:500]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["step"])
        metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
