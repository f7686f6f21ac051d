"""checkpoint.export_hf: Hugging Face copies of a run while it trains (moe_jax/train/hf_exports.py).

A tiny RoPE-everywhere run (Qwen3-MoE's form) saves every 2 steps and copies every 2nd save
and the last: its copies are where and when the key says, and each imports to the very
params of its checkpoint (float32 on the CPU: bit for bit). A model no Hugging Face family
holds is refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.inference.load import load_run
from moe_jax.interop.convert import load_hf
from moe_jax.train.loop import train
from tests.test_train import _cfg

EXPORTABLE = ["attention.nope_interval=0", "attention.qkv_bias=false", "moe.router_bias=false"]


def _flat(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_copies_of_every_second_save_and_the_last_equal_their_checkpoints(tmp_path):
    cfg = _cfg(tmp_path / "run", *EXPORTABLE, "checkpoint.every=2", "checkpoint.keep=5",
               "checkpoint.export_hf=2", "train.steps=5")  # fmt: skip
    train(cfg)
    hf = tmp_path / "run" / "hf"
    # saves at steps 2, 4 and 5 (the last): the 2nd (step 4) and the last are copied
    assert sorted(p.name for p in hf.iterdir()) == ["step_4", "step_5"]
    for step in (4, 5):
        imported = load_hf(hf / f"step_{step}")[1]
        saved = load_run(tmp_path / "run", step=step)[1]
        got, want = _flat(imported), _flat(saved)
        assert got.keys() == want.keys()
        for path in want:
            np.testing.assert_array_equal(got[path], want[path], err_msg=f"step {step} {path}")
        assert (hf / f"step_{step}" / "config.json").is_file()


def test_a_model_with_no_hugging_face_form_is_refused_before_anything_is_written(tmp_path):
    # tiny's NoPE layer beside QK-norm: no Hugging Face family holds it
    cfg = _cfg(tmp_path / "run", "checkpoint.export_hf=1", "train.steps=2")
    with pytest.raises(ConfigError, match="checkpoint.export_hf: .*checkpoint.export_hf=0"):
        train(cfg)
    assert not (tmp_path / "run").exists()
