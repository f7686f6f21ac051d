"""Plots of a training run from RUN_DIR/metrics.jsonl.

    python -m moe_jax.plot RUN_DIR [--out DIR]

writes into DIR (default: RUN_DIR)
    loss.png         train cross-entropy, validation loss and (train.objective=lm) the
                     validation unigram baseline, (dpo) the held-out chosen answers'
                     cross-entropy; below, on its own scale, the rest of the train loss
                     (lm: loss - cross-entropy, the router's aux losses and the logit z-loss;
                     dpo, grpo: the MoE aux loss, as their loss is not cross-entropy)
    objective.png    dpo and grpo: the objective's series, train and held-out (reward_*,
                     dpo_loss, kl, clip_frac: OBJECTIVE_PANELS)
    optimizer.png    the learning rate, the gradient norm and tokens/s
    expert_load.png  per MoE layer, the fraction of top-k assignments each expert received over
                     training (a balanced router is a flat 1/E)
    dropped.png      per MoE layer, the percentage of top-k assignments dropped by capacity
    exchange.png     when the ragged exchange ever overflowed its first round: per MoE layer,
                     its rounds per step and the percentage of rows past the first round
                     (moe.recv_factor, moe_jax/model/exchange_rounds.py)
    downstream.png   with `eval.tasks`: each harness task's metrics over training, one panel a
                     task (moe_jax/eval/in_training.py)
The `*_figure` functions return the matplotlib figures (None when there is nothing to show).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from moe_jax.observe.writers import METRICS_FILE, read_metrics  # noqa: E402
from moe_jax.run.door import HelpFormatter, command  # noqa: E402
from moe_jax.run.layout import RunError  # noqa: E402
from moe_jax.run.output import check_place, new_file  # noqa: E402

# The fields the figures read from every record of a kind (a record without one, written by
# hand or by another tool, is refused by name instead of ending in a KeyError); a train
# record's "mtp_ce" is drawn for all once the first has it, its "exchange_rounds" with its
# "overflow_frac".
DRAWN = {"train": ("step", "loss", "ce", "expert_load", "dropped_frac"), "eval": ("val_loss",),
         "info": ("val_unigram_entropy", "moe_layers")}  # fmt: skip


def missing_field(records: list[dict]) -> tuple[dict, str] | None:
    """The first (record, field) that a figure draws and the record lacks; None if none."""
    train = [r for r in records if r["kind"] == "train"]
    for r in records:
        need = list(DRAWN.get(r["kind"], ()))
        if r["kind"] == "train":
            need += ["mtp_ce"] if "mtp_ce" in train[0] else []
            need += ["exchange_rounds"] if np.size(r.get("overflow_frac", [])) else []
        if field := next((f for f in need if f not in r), None):
            return r, field
    return None


def _moe_layer_names(records: list[dict], n_layers: int) -> list[str]:
    """'layer N' (1-based, as in the docs) of each logged MoE layer."""
    infos = [r for r in records if r["kind"] == "info"]
    ids = infos[-1]["moe_layers"] if infos else list(range(n_layers))
    return [f"layer {i + 1}" for i in ids]


def objective(records: list[dict]) -> str:
    """The run's train.objective, as its last info record says (lm for a run of a version
    that did not say)."""
    infos = [r for r in records if r["kind"] == "info"]
    return infos[-1].get("objective", "lm") if infos else "lm"


def aux_series(records: list[dict]) -> tuple[str, list[float]]:
    """(label, values) of the train records' loss beside the cross-entropy. For lm it is
    loss - cross-entropy (the router's aux losses, the logit z-loss, the weighted MTP loss);
    for dpo and grpo the loss is another objective's, so the MoE aux loss is drawn itself."""
    train = [r for r in records if r["kind"] == "train"]
    if objective(records) == "lm":
        return "train loss - cross-entropy", [r["loss"] - r["ce"] for r in train]
    return "MoE aux loss", [r.get("aux_loss", np.nan) for r in train]


def loss_figure(records: list[dict]) -> Figure:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    infos = [r for r in records if r["kind"] == "info"]
    steps = [r["step"] for r in train]
    fig, (ax, ax_aux) = plt.subplots(
        2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.plot(steps, [r["ce"] for r in train], label="train cross-entropy", lw=1)
    if train and "mtp_ce" in train[0]:  # model.mtp_depth (its weighted sum is in the loss)
        ax.plot(steps, [r["mtp_ce"] for r in train], label="train MTP cross-entropy", lw=1)
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["val_loss"] for r in evals],
            "o-",
            label="validation loss",
        )
    if evals and "val_ce_chosen" in evals[-1]:  # dpo: the chosen answers' own
        points = [(r["step"], r["val_ce_chosen"]) for r in evals if "val_ce_chosen" in r]
        ax.plot(*zip(*points, strict=True), "s--", label="validation chosen cross-entropy")
    if infos and objective(records) == "lm":  # the baseline of a language model's text
        ax.axhline(
            infos[-1]["val_unigram_entropy"],
            color="gray",
            ls="--",
            label="validation unigram entropy",
        )
    ax.set_ylabel("nats / token")
    ax.set_title("loss")
    ax.legend()
    label, aux = aux_series(records)
    ax_aux.plot(steps, aux, color="tab:red", lw=1, label=label)
    ax_aux.set_ylabel("aux losses")
    ax_aux.set_xlabel("step")
    ax_aux.legend()
    for a in (ax, ax_aux):
        a.grid(alpha=0.3)
    return fig


def expert_load_figure(records: list[dict]) -> Figure | None:
    """One heatmap per MoE layer: experts (rows) x logged steps (columns), colour = load."""
    train = [r for r in records if r["kind"] == "train" and np.size(r["expert_load"])]
    if not train:
        return None
    steps = np.array([r["step"] for r in train])
    load_SLE = np.array([r["expert_load"] for r in train])  # [logged steps, MoE layers, E]
    n_layers, n_experts = load_SLE.shape[1:]
    names = _moe_layer_names(records, n_layers)
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
        ax.set_ylabel(f"{names[layer]}\nexpert")
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(
        image, ax=axes[:, 0].tolist(), label=f"fraction of assignments (even = {1 / n_experts:.3f})"
    )
    fig.suptitle("expert load")
    return fig


def dropped_figure(records: list[dict]) -> Figure | None:
    """One line per MoE layer: the percentage of its top-k assignments dropped by capacity."""
    train = [r for r in records if r["kind"] == "train" and np.size(r["dropped_frac"])]
    if not train:
        return None
    steps = [r["step"] for r in train]
    dropped_SL = 100 * np.array([r["dropped_frac"] for r in train])  # [logged steps, MoE layers]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = _moe_layer_names(records, dropped_SL.shape[1])
    for name, dropped_S in zip(names, dropped_SL.T, strict=True):
        ax.plot(steps, dropped_S, lw=1, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("% of assignments")
    ax.set_title("dropped by expert capacity (moe.capacity_factor)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def exchange_figure(records: list[dict]) -> Figure | None:
    """Per MoE layer, the ragged exchange's rounds per step and its overflow (rows past the
    first round); None while no record shows an overflow (then it is one round, always)."""
    train = [r for r in records if r["kind"] == "train" and np.size(r.get("overflow_frac", []))]
    if not any(np.max(r["overflow_frac"]) > 0 for r in train):
        return None
    steps = [r["step"] for r in train]
    rounds_SL = np.array([r["exchange_rounds"] for r in train])  # [logged steps, MoE layers]
    overflow_SL = 100 * np.array([r["overflow_frac"] for r in train])
    fig, (ax_r, ax_o) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    names = _moe_layer_names(records, rounds_SL.shape[1])
    for name, rounds_S, overflow_S in zip(names, rounds_SL.T, overflow_SL.T, strict=True):
        ax_r.plot(steps, rounds_S, lw=1, label=name)
        ax_o.plot(steps, overflow_S, lw=1, label=name)
    ax_r.set_ylabel("rounds per step")
    ax_r.set_title("ragged exchange: rounds of the receive buffer (moe.recv_factor)")
    ax_o.set_ylabel("% of rows past round 1")
    ax_o.set_xlabel("step")
    for ax in (ax_r, ax_o):
        ax.grid(alpha=0.3)
    ax_r.legend()
    return fig


# Each objective's own panels: (title, train series, eval series), as metrics.jsonl names them
# (posttrain/dpo.py, posttrain/rl/grpo.py; the eval ones train/evaluation.py's).
OBJECTIVE_PANELS = {
    "dpo": (
        ("DPO loss", ("dpo_loss",), ("val_dpo_loss",)),
        ("reward accuracy", ("reward_accuracy",), ("val_reward_accuracy",)),
        ("implicit rewards", ("reward_chosen", "reward_rejected", "reward_margin"),
         ("val_reward_margin",)),
    ),
    "grpo": (
        ("reward", ("reward_mean", "reward_std"), ("val_reward_mean",)),
        ("policy", ("kl", "clip_frac"), ()),
        ("sampler / trainer mismatch", ("logp_diff_mean", "mismatch_kl", "mismatch_frac"), ()),
    ),
}  # fmt: skip
# The optimizer's and the throughput's series, one panel each: (field, title, log scale)
OPTIMIZER_PANELS = (
    ("lr", "learning rate", True),
    ("grad_norm", "gradient norm (before clipping)", True),
    ("tokens_per_s", "tokens / s", False),
)


def _series(ax, records: list[dict], names, style: str) -> None:
    """A line for each of `names` over the records that hold a number for it."""
    for name in names:
        points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), style, lw=1, label=name)


def objective_figure(records: list[dict]) -> Figure | None:
    """A dpo or grpo run's own series (OBJECTIVE_PANELS), training's and held-out's, one
    panel a quantity; None for lm (its loss is loss.png's)."""
    panels = OBJECTIVE_PANELS.get(objective(records))
    if panels is None:
        return None
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True)
    for ax, (title, train_names, eval_names) in zip(axes, panels, strict=True):
        _series(ax, train, train_names, "-")
        _series(ax, evals, eval_names, "o--")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1].set_xlabel("step")
    return fig


def optimizer_figure(records: list[dict]) -> Figure | None:
    """The learning rate, the gradient norm and the throughput over training; None where no
    train record holds one of them (records written by hand)."""
    train = [r for r in records if r["kind"] == "train"]
    if not any(r.get(name) is not None for r in train for name, _, _ in OPTIMIZER_PANELS):
        return None
    fig, axes = plt.subplots(len(OPTIMIZER_PANELS), 1, figsize=(8, 7), sharex=True)
    for ax, (name, title, log) in zip(axes, OPTIMIZER_PANELS, strict=True):
        _series(ax, train, [name], "-")
        if log and any(r.get(name) for r in train):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


def downstream_figure(records: list[dict]) -> Figure | None:
    """One panel per harness task: its metrics ('<task>/<metric>') against the step."""
    evals = [r for r in records if r["kind"] == "downstream"]
    names = sorted({k for r in evals for k in r if k not in ("kind", "step")})
    if not names:
        return None
    tasks = sorted({n.split("/", 1)[0] for n in names})
    fig, axes = plt.subplots(
        len(tasks), 1, figsize=(8, 2.5 * len(tasks)), sharex=True, squeeze=False
    )
    for task, ax in zip(tasks, axes[:, 0], strict=True):
        for name in (n for n in names if n.split("/", 1)[0] == task):
            points = [(r["step"], r[name]) for r in evals if name in r]
            ax.plot(*zip(*points, strict=True), "o-", label=name.split("/", 1)[1])
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("step")
    return fig


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moe-jax plot", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("run_dir")
    parser.add_argument("--out", help="directory for the PNG files (default: RUN_DIR)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise RunError(
            f"no {METRICS_FILE} in '{run_dir}'; pass a run directory that train.py has written to"
        )
    records = read_metrics(run_dir)
    if not any(r["kind"] == "train" for r in records):
        raise RunError(
            f"'{run_dir}/{METRICS_FILE}' has no training records yet; train longer than "
            "train.log_every steps"
        )
    if found := missing_field(records):
        record, field = found
        raise RunError(
            f"'{run_dir / METRICS_FILE}': the {record['kind']} record of step {record['step']} "
            f"has no '{field}', which the plots draw; delete its line or add the field"
        )
    out = Path(args.out) if args.out else run_dir
    check_place(out, "--out")  # made when the first figure is drawn: a stop leaves nothing
    for name, make in (
        ("loss.png", loss_figure),
        ("objective.png", objective_figure),
        ("optimizer.png", optimizer_figure),
        ("expert_load.png", expert_load_figure),
        ("dropped.png", dropped_figure),
        ("exchange.png", exchange_figure),
        ("downstream.png", downstream_figure),
    ):
        fig = make(records)
        if fig is not None:
            out.mkdir(parents=True, exist_ok=True)
            with new_file(out / name) as tmp:  # a full disk leaves the old plot, not 0 bytes
                fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
            plt.close(fig)
            print(out / name)
    return 0
