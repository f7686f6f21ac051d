"""Plots of a training run from RUN_DIR/metrics.jsonl.

    python -m moe_jax.plot RUN_DIR [--out DIR]

writes DIR/loss.png (train loss and cross-entropy, validation loss, the validation unigram
baseline) and DIR/expert_load.png (per MoE layer, the fraction of top-k assignments each
expert received over training; a balanced router is a flat 1/E), DIR defaulting to RUN_DIR.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax.metrics import METRICS_FILE, read_metrics  # noqa: E402


def plot_loss(records: list[dict], out: Path) -> Path:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    infos = [r for r in records if r["kind"] == "info"]
    fig, ax = plt.subplots(figsize=(8, 5))
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["loss"] for r in train], label="train loss (CE + aux)", lw=1)
    ax.plot(steps, [r["ce"] for r in train], label="train cross-entropy", lw=1, alpha=0.7)
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["val_loss"] for r in evals],
            "o-",
            label="validation loss",
        )
    if infos:
        ax.axhline(
            infos[-1]["val_unigram_entropy"],
            color="gray",
            ls="--",
            label="validation unigram entropy",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "loss.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_expert_load(records: list[dict], out: Path) -> Path | None:
    """One heatmap per MoE layer: experts (rows) x logged steps (columns), colour = load."""
    train = [r for r in records if r["kind"] == "train" and np.size(r["expert_load"])]
    if not train:
        return None
    steps = np.array([r["step"] for r in train])
    load_SLE = np.array([r["expert_load"] for r in train])  # [logged steps, MoE layers, E]
    n_layers, n_experts = load_SLE.shape[1:]
    infos = [r for r in records if r["kind"] == "info"]
    layer_ids = infos[-1]["moe_layers"] if infos else list(range(n_layers))
    fig, axes = plt.subplots(
        n_layers, 1, figsize=(9, 1.2 + 0.35 * n_experts * n_layers), sharex=True, squeeze=False
    )
    for layer, ax in enumerate(axes[:, 0]):
        image = ax.imshow(
            load_SLE[:, layer, :].T,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=float(load_SLE.max()),
            extent=(steps[0], steps[-1], n_experts - 0.5, -0.5),
        )
        ax.set_ylabel(f"layer {layer_ids[layer] + 1}\nexpert")  # 1-based, as in the docs
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(
        image, ax=axes[:, 0].tolist(), label=f"fraction of assignments (even = {1 / n_experts:.3f})"
    )
    fig.suptitle("expert load")
    path = out / "expert_load.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.plot", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dir")
    parser.add_argument("--out", help="directory for the PNG files (default: RUN_DIR)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        print(
            f"error: no {METRICS_FILE} in '{run_dir}'; pass a run directory that "
            "train.py has written to",
            file=sys.stderr,
        )
        return 2
    records = read_metrics(run_dir)
    if not any(r["kind"] == "train" for r in records):
        print(
            f"error: '{run_dir}/{METRICS_FILE}' has no training records yet; train longer "
            "than train.log_every steps",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else run_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = "a file of that name is in the way" if out.is_file() else e.strerror
        print(f"error: cannot create --out '{out}' ({reason}); choose a directory", file=sys.stderr)
        return 2
    for path in (plot_loss(records, out), plot_expert_load(records, out)):
        if path is not None:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
