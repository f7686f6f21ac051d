"""`python -m moe_jax.plot`: what the figures show, read back from the matplotlib objects, for
a made-up run of two MoE layers (0-based layers 1 and 3) of 4 experts; and the files written."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.observe.plot import dropped_figure, expert_load_figure, loss_figure, main
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
    names = ["loss.png", "expert_load.png", "dropped.png"] if moe else ["loss.png"]
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
