"""FP8 block-quantised checkpoints (DeepSeek-V3 / Kimi K2's release form, moe_jax/interop/fp8.py)
against a reference written from the format's definition: each 128 x 128 block of the e4m3
weight times its `weight_scale_inv`, a float32 product, rounded to bf16.

A tiny DeepSeek-V3 (hidden 192 and MLP 160: whole and partial blocks) has its projections
quantised as the release does (the embedding, head, norms and router stay bf16); its import
must equal, bit for bit, the import of the same model whose weights are the reference's
dequantisation. Budget: ~5 s.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
from safetensors.torch import load_file, save_file  # noqa: E402

from moe_jax.interop import InteropError, load_hf  # noqa: E402
from moe_jax.interop.fp8 import deferred, dequantize  # noqa: E402
from tests.test_interop import params_of  # noqa: E402
from tests.test_interop_deepseek import hf_model  # noqa: E402

B = 128
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[m, n] -> (e4m3 [m, n], float32 scale_inv [ceil(m/128), ceil(n/128)]): each block
    scaled so that its largest magnitude is the largest e4m3 value."""
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(m / B), math.ceil(n / B), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * B : (i + 1) * B, j * B : (j + 1) * B].float()
            s[i, j] = block.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * B : (i + 1) * B, j * B : (j + 1) * B] = (block / s[i, j]).to(q.dtype)
    return q, s


def reference(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The format's definition, block by block: float32(q) * scale_inv, then bf16."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * B, (i + 1) * B), slice(j * B, (j + 1) * B)
            out[rows, cols] = q[rows, cols].to(torch.float32) * s[i, j]
    return out.to(torch.bfloat16)


def test_dequantize_and_its_deferred_views_follow_the_definition():
    g = torch.Generator().manual_seed(0)
    q, s = quantize(torch.randn(300, 260, generator=g))
    want = reference(q, s).float().numpy()
    w8 = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    full = dequantize(w8, s.numpy())
    np.testing.assert_array_equal(full.astype(ml_dtypes.bfloat16).astype(np.float32), want)
    lazy = deferred(w8, s.numpy())
    np.testing.assert_array_equal(np.asarray(lazy), full)
    # what the tensor maps do to it: transpose, split an axis, slice, pick a row
    views = [
        lambda a: a.T[5:200, 17:250],
        lambda a: a.reshape(4, 75, 260)[1:3, 10:70, 100:],
        lambda a: a.T.reshape(260, 3, 100)[:, 1:, 40:],
        lambda a: a.reshape(3, 100, 260)[:, :40].transpose(2, 0, 1)[7],
        lambda a: a[..., 1::2][10:100, 3:],  # gpt-oss's interleaved gate / up
        lambda a: a.T[3:250:7][:, 5:9],
    ]
    for view in views:
        np.testing.assert_array_equal(np.asarray(view(lazy)), view(full))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(FP8 checkpoint dir, the reference-dequantised bf16 dir) of one tiny DeepSeek-V3."""
    root = tmp_path_factory.mktemp("fp8")
    model = hf_model("deepseek_v3", seed=3, hidden_size=192, intermediate_size=160)
    model.to(torch.bfloat16).save_pretrained(root / "ref")
    tensors = load_file(root / "ref" / "model.safetensors")
    packed, dequantised = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"):
            q, s = quantize(w)
            packed |= {name: q, name + "_scale_inv": s}
            dequantised[name] = reference(q, s)
        else:
            packed[name] = dequantised[name] = w
    assert sum(n.endswith("_scale_inv") for n in packed) > 20
    (root / "fp8").mkdir()
    save_file(packed, root / "fp8" / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, root / "ref" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "ref" / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [B, B],
             "activation_scheme": "dynamic"}  # fmt: skip
    (root / "fp8" / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    return root / "fp8", root / "ref"


def test_fp8_checkpoint_imports_its_reference_dequantisation(checkpoints):
    fp8_dir, ref_dir = checkpoints
    cfg, ours = load_hf(fp8_dir, dtype="source")
    cfg_ref, ref = load_hf(ref_dir, dtype="source")
    assert cfg == cfg_ref
    a, b = params_of(ours), params_of(ref)
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        np.testing.assert_array_equal(a[path], b[path], str(path))
    assert a[("blocks", "layers", 0, "attn", "wq_a")].dtype == ml_dtypes.bfloat16


def test_fp8_scales_of_the_wrong_shape_are_named(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints
    tensors = load_file(fp8_dir / "model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    tensors[name] = torch.ones(1, 1)
    (tmp_path / "bad").mkdir()
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((fp8_dir / "config.json").read_text())
    with pytest.raises(InteropError, match=f"'{name}' has shape"):
        load_hf(tmp_path / "bad")
