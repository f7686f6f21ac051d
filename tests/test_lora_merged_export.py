"""A LoRA run on a quantised frozen base (lora.base_dtype=int8 | mxfp4) exported merged
(moe_jax/interop/export.py): each quantised weight dequantised as it is read, the adapters
merged in, the result a Hugging Face model whose logits (transformers) equal the run's own.

A tiny Qwen3-MoE (tests/test_interop.py's: a dense tail layer, attention biases; d_model and
expert_hidden multiples of 32 for MXFP4) imported with init_from, one LoRA step on attention
and the routed experts (lr 5e-2: the adapters move the logits by up to ~4).
Tolerance: 1e-5 on O(1) logits with the export in float32: both sides hold the same
dequantised float32 values, ours adds the attention adapters' (x A) B beside x W where the
export has x (W + s A B) (measured 1.8e-6 int8, 1.9e-6 MXFP4). The default export is the
run's compute dtype, bfloat16: each tensor the float32 export's rounded (compared exactly).
Budget: ~25 s on 2 CPU cores (a train() call per base).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch", reason="export parity needs torch (the `interop` extra)")
pytest.importorskip("transformers", reason="export parity needs transformers (`interop`)")

from moe_jax.interop.safetensors_io import TensorReader  # noqa: E402
from tests.test_interop import hf_logits, hf_model, our_logits, tokens  # noqa: E402


@pytest.mark.parametrize("base_dtype", ["int8", "mxfp4"])
def test_a_quantised_base_lora_run_exports_merged(tmp_path, base_dtype):
    from transformers import AutoModelForCausalLM

    from moe_jax.config import load_config
    from moe_jax.inference.load import load_run
    from moe_jax.interop.export import export_run
    from moe_jax.model import lora
    from moe_jax.model.int8 import QuantizedParam
    from moe_jax.train.loop import train

    directory = tmp_path / "hf"
    hf_model("qwen3_moe", seed=2, vocab_size=256).save_pretrained(directory)
    run = tmp_path / "run"
    train(load_config(None, [
        f"init_from={directory}", f"run_dir={run}", "lora.rank=4", "lora.alpha=8",
        "lora.targets=[attention,experts]", f"lora.base_dtype={base_dtype}",
        "moe.capacity_factor=0", "train.steps=1", "train.batch_size=2", "train.seq_len=16",
        "train.lr=5e-2", "train.warmup_steps=0", "train.eval_every=100",
        "train.eval_batches=1", "data.embedded_max_bytes=20000", "train.peak_flops=1e11",
        "train.trackers=[]",
    ]))  # fmt: skip
    _, model, _ = load_run(run)
    assert len(nnx.to_flat_state(nnx.state(model, QuantizedParam))) >= 2  # restored quantised
    x = tokens(2, 12, seed=5)
    ours = our_logits(model, x)
    with lora.off():  # traced afresh: the adapters' terms left out
        base = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, x))
    assert np.abs(ours - base).max() > 1e-3  # the step moved the adapters

    export_run(run, tmp_path / "f32", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "f32").eval()
    np.testing.assert_allclose(hf_logits(merged, x), ours, rtol=0, atol=1e-5)

    export_run(run, tmp_path / "bf16")  # the default: the run's compute dtype
    conf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert conf.get("torch_dtype", conf.get("dtype")) == "bfloat16"
    f32, bf16 = TensorReader(tmp_path / "f32"), TensorReader(tmp_path / "bf16")
    assert f32.names() == bf16.names()
    for name in f32.names():
        want = np.asarray(f32.get(name)).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(bf16.get(name)), want, err_msg=name)
