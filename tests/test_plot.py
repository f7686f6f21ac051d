"""`python -m moe_jax.plot`: what the figures show, read back from the matplotlib objects, for
a made-up run of two MoE layers (0-based layers 1 and 3) of 4 experts; and the files written."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.observe.plot import (
    OBJECTIVE_PANELS,
    dropped_figure,
    expert_load_figure,
    loss_figure,
    main,
    objective_figure,
    optimizer_figure,
)
from moe_jax.observe.writers import MetricsWriter

STEPS = [10, 20, 30]
CE = [4.0, 3.0, 2.5]
AUX = [0.012, 0.011, 0.010]  # loss - ce: 1/300 of the loss, invisible on the loss's axis
DROPPED_SL = [[0.10, 0.02], [0.05, 0.01], [0.0, 0.0]]
LOAD_SLE = np.random.default_rng(0).dirichlet(np.ones(4), (3, 2))


def records(moe: bool = True) -> list[dict]:
    info = {"kind": "info", "step": 0, "val_unigram_entropy": 2.9, "moe_layers": [1, 3]}
    train = [
        {
            "kind": "train",
            "step": step,
            "loss": ce + aux,
            "ce": ce,
            "dropped_frac": dropped if moe else [],
            "expert_load": load.tolist() if moe else [],
            "lr": 1e-3 * step,
            "grad_norm": 2.0 / step,
            "tokens_per_s": None if step == STEPS[0] else 1e3 * step,  # the compiling window
        }
        for step, ce, aux, dropped, load in zip(STEPS, CE, AUX, DROPPED_SL, LOAD_SLE, strict=True)
    ]
    evals = [{"kind": "eval", "step": 30, "val_loss": 2.7}]
    return [info, *train, *evals]


def lines(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_the_aux_losses_get_an_axis_of_their_own():
    ax, ax_aux = loss_figure(records()).axes
    shown = lines(ax)
    assert shown["train cross-entropy"] == (STEPS, CE)
    assert shown["validation loss"] == ([30], [2.7])
    assert shown["validation unigram entropy"][1] == [2.9, 2.9]
    ((steps, aux),) = lines(ax_aux).values()
    assert steps == STEPS
    np.testing.assert_allclose(aux, AUX, rtol=1e-12)
    low, high = ax_aux.get_ylim()
    assert low < min(AUX) and max(AUX) < high and high - low < 10 * np.ptp(AUX)


def test_dropped_fraction_and_expert_load_per_moe_layer():
    (ax,) = dropped_figure(records()).axes
    shown = lines(ax)
    assert list(shown) == ["layer 2", "layer 4"]
    for name, dropped_S in zip(shown, np.transpose(DROPPED_SL), strict=True):
        assert shown[name][0] == STEPS
        np.testing.assert_allclose(shown[name][1], 100 * dropped_S)

    heatmaps = [ax for ax in expert_load_figure(records()).axes if ax.images]
    assert [ax.get_ylabel() for ax in heatmaps] == ["layer 2\nexpert", "layer 4\nexpert"]
    for layer, ax in enumerate(heatmaps):
        np.testing.assert_array_equal(ax.images[0].get_array(), LOAD_SLE[:, layer, :].T)


@pytest.mark.parametrize("moe", [True, False])
def test_the_cli_writes_one_png_per_figure(tmp_path, capsys, moe):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for r in records(moe):
            writer.write(r)
    out = tmp_path / "plots"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    names = ["loss.png", "optimizer.png", *(["expert_load.png", "dropped.png"] if moe else [])]
    assert capsys.readouterr().out.split() == [str(out / n) for n in names]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "kind, field", [("train", "ce"), ("train", "expert_load"), ("eval", "val_loss"),
                    ("info", "val_unigram_entropy"), ("train", "mtp_ce")],
)  # fmt: skip
def test_a_record_without_a_field_it_draws_is_one_line(tmp_path, capsys, kind, field):
    """A record lacking a field a figure reads (it once ended in a KeyError's traceback):
    refused by name, before any file is written."""
    rs = records()
    if field == "mtp_ce":  # drawn for all train records once the first has it
        rs[1]["mtp_ce"] = 4.1
    else:
        del next(r for r in rs if r["kind"] == kind and field in r)[field]
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for r in rs:
            writer.write(r)
    out = tmp_path / "plots"
    assert main([str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "record of step" in err and f"has no '{field}'" in err, err
    assert not out.exists()


def dpo_records() -> list[dict]:
    """A DPO run's records: its loss is DPO's (about ln 2), far from its cross-entropy."""
    info, *train, evals = records()
    info = info | {"objective": "dpo"}
    keys = [k for _, names, _ in OBJECTIVE_PANELS["dpo"] for k in names]
    val_keys = [k for _, _, names in OBJECTIVE_PANELS["dpo"] for k in names]
    train = [
        r | {"loss": 0.69 + aux, "aux_loss": aux} | {k: 0.1 * i for k in keys}
        for i, (r, aux) in enumerate(zip(train, AUX, strict=True))
    ]
    evals = evals | {"val_ce_chosen": 1.4} | {k: 0.5 for k in val_keys}
    return [info, *train, evals]


def test_each_objective_draws_its_own_series_and_aux_loss():
    """DPO: the reward_* / dpo_loss series (train and held-out) on objective.png, the MoE aux
    loss itself under the loss (loss - ce would be DPO's loss less the cross-entropy), no
    unigram baseline, the held-out chosen cross-entropy; lm: no objective figure. Every
    run: the learning rate, the gradient norm and tokens/s (the compiling window's None
    left out)."""
    dpo = dpo_records()
    fig = objective_figure(dpo)
    drawn = [set(lines(ax)) for ax in fig.axes]
    assert drawn == [
        {"dpo_loss", "val_dpo_loss"},
        {"reward_accuracy", "val_reward_accuracy"},
        {"reward_chosen", "reward_rejected", "reward_margin", "val_reward_margin"},
    ]
    assert lines(fig.axes[1])["val_reward_accuracy"] == ([30], [0.5])
    ax, ax_aux = loss_figure(dpo).axes
    assert set(lines(ax)) == {"train cross-entropy", "validation loss",
                              "validation chosen cross-entropy"}  # fmt: skip
    ((label, (steps, aux)),) = lines(ax_aux).items()
    assert label == "MoE aux loss" and steps == STEPS
    np.testing.assert_allclose(aux, AUX, rtol=1e-12)
    assert objective_figure(records()) is None
    grpo = [dpo[0] | {"objective": "grpo"}, *records()[1:]]
    grpo[1] |= {"reward_mean": 0.25, "kl": 0.01, "mismatch_kl": 1e-4}
    assert [set(lines(ax)) for ax in objective_figure(grpo).axes] == [
        {"reward_mean"}, {"kl"}, {"mismatch_kl"},
    ]  # fmt: skip
    shown = [lines(ax) for ax in optimizer_figure(dpo).axes]
    assert [list(s) for s in shown] == [["lr"], ["grad_norm"], ["tokens_per_s"]]
    assert shown[2]["tokens_per_s"] == (STEPS[1:], [2e4, 3e4])
