"""MXFP4 (gpt-oss expert weights): dequantize bit for bit against transformers'
convert_moe_packed_tensors (skipped without torch/transformers), the nibble order and layout by
hand, quantize/dequantize round trips, the rounding bound and tie rule, and the error messages.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moe_jax.interop.mxfp4 import FP4_VALUES, dequantize, quantize

BF16 = ml_dtypes.bfloat16
E, H, I = 3, 64, 96  # gpt-oss: gate_up_proj [E, H, 2I], down_proj [E, I, H]


def _random_packed(rng, shape, extremes=True):
    """blocks [*shape, 16] and scales shape: scales mostly 110..135, plus a few 0/1/253/254/255."""
    blocks = rng.integers(0, 256, size=(*shape, 16), dtype=np.uint8)
    scales = rng.integers(110, 136, size=shape, dtype=np.uint8)
    if extremes:
        flat = scales.reshape(-1)
        flat[:5] = [0, 1, 253, 254, 255]
        rng.shuffle(flat)
    return blocks, scales


@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize_matches_transformers_bit_for_bit(proj, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    # checkpoint shapes: gate_up_proj_blocks [E, 2I, H/32, 16], down_proj_blocks [E, H, I/32, 16]
    shape, param = (
        ((E, 2 * I, H // 32), (E, H, 2 * I))
        if proj == "gate_up_proj"
        else (
            (E, H, I // 32),
            (E, I, H),
        )
    )
    blocks, scales = _random_packed(rng, shape)
    tdtype = getattr(torch, dtype)
    ref = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=tdtype
    )
    ours = dequantize(blocks, scales, dtype=BF16 if dtype == "bfloat16" else np.dtype(dtype))
    assert ours.shape == tuple(ref.shape) == param
    bits = {"bfloat16": (torch.int16, np.uint16), "float16": (torch.int16, np.uint16)}
    tview, nview = bits.get(dtype, (torch.int32, np.uint32))
    ref_bits = ref.contiguous().view(tview).numpy().view(nview)
    np.testing.assert_array_equal(ours.view(nview), ref_bits)
    assert np.isinf(ours.astype(np.float32)).any()  # the extreme scales were exercised


def test_dequantize_layout_and_nibble_order_by_hand():
    # expert 1, row 2, group 1: byte j holds (low, high) = element 2j, 2j+1 of that block
    blocks = np.zeros((2, 3, 2, 16), np.uint8)
    scales = np.full((2, 3, 2), 127, np.uint8)
    blocks[1, 2, 1, 0] = 0x71  # low nibble 1 (0.5), high nibble 7 (6.0)
    blocks[1, 2, 1, 15] = 0xA3  # low 3 (1.5), high 10 (-1.0)
    scales[1, 2, 1] = 129  # * 4
    out = dequantize(blocks, scales)
    assert out.shape == (2, 64, 3) and out.dtype == np.dtype(BF16)
    expected = np.zeros((2, 64, 3), np.float32)
    expected[1, 32 + 0, 2], expected[1, 32 + 1, 2] = 2.0, 24.0
    expected[1, 32 + 30, 2], expected[1, 32 + 31, 2] = 6.0, -4.0
    np.testing.assert_array_equal(out.astype(np.float32), expected)


def test_dequantize_value_table_and_scale_range():
    # every code at every scale: code * 2**(scale - 127), exact (float64 output)
    blocks = np.repeat(np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16), 256, axis=1)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 16, axis=2)
    out = dequantize(blocks, scales, dtype=np.float64)  # [1, 16*32, 256]
    codes = np.stack([np.arange(256) & 15, np.arange(256) >> 4], -1).reshape(16 * 32)
    want = np.ldexp(FP4_VALUES[codes][:, None], np.arange(256)[None, :] - 127)
    np.testing.assert_array_equal(out[0], want)
    np.testing.assert_array_equal(np.signbit(out[0]), np.signbit(want))  # -0 stays -0
    # bf16 overflows to inf exactly where the product exceeds its range (scales 253..255)
    bf = dequantize(blocks, scales).astype(np.float32)[0]
    assert set(np.nonzero(np.isinf(bf))[1]) == {253, 254, 255}


def test_dequantize_chunking_does_not_change_the_result():
    rng = np.random.default_rng(1)
    blocks, scales = _random_packed(rng, (2, 7, 3), extremes=False)
    whole = dequantize(blocks, scales)
    for chunk in (1, 96, 100, 10_000):
        np.testing.assert_array_equal(
            dequantize(blocks, scales, chunk_size=chunk).view(np.uint16), whole.view(np.uint16)
        )


@pytest.mark.parametrize("chunk", [1 << 22, 70])
def test_round_trip_exact_on_representable_weights(chunk):
    rng = np.random.default_rng(2)
    blocks, scales = _random_packed(rng, (E, 2 * I, H // 32), extremes=False)
    scales.reshape(-1)[:3] = [0, 1, 127]  # the smallest scales (subnormal bf16 values) too
    blocks[0, 0, 1] = 0  # an all-zero block
    w = dequantize(blocks, scales)  # [E, H, 2I] bf16, representable by construction
    b2, s2 = quantize(w, chunk_size=chunk)
    assert b2.shape == blocks.shape and s2.shape == scales.shape
    assert b2.dtype == s2.dtype == np.uint8
    np.testing.assert_array_equal(dequantize(b2, s2).view(np.uint16), w.view(np.uint16))
    # the same from float32 and float64 copies
    for dt in (np.float32, np.float64):
        np.testing.assert_array_equal(dequantize(*quantize(w.astype(dt))), w)
    # a block whose largest code is 6 or 4 gets back its own scale
    big = np.abs(FP4_VALUES[np.stack([blocks & 15, blocks >> 4], -1)]).max(axis=(-1, -2)) >= 4
    np.testing.assert_array_equal(s2[big], scales[big])


def _e2m1_step(a):
    """Spacing of the E2M1 grid around |x| = a (a <= 6)."""
    return np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))


def test_quantize_error_bound_and_nearest_value():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 128, 24)) * np.exp(rng.uniform(-8, 8, size=(2, 1, 24)))
    w[0, :32, 0] = 0.0  # all-zero block
    blocks, scales = quantize(w)
    deq = dequantize(blocks, scales, dtype=np.float64)
    err = np.abs(deq - w)
    # per block: 2**s is the smallest power of two with amax <= 6 * 2**s
    s = scales.astype(np.int64) - 127  # [2, 24, 4]
    blk = w.transpose(0, 2, 1).reshape(2, 24, 4, 32)
    amax = np.abs(blk).max(-1)
    nz = amax > 0
    assert np.all(amax <= 6 * np.exp2(s)) and np.all(amax[nz] > 3 * np.exp2(s[nz]))
    assert scales[0, 0, 0] == 0  # the all-zero block
    # bound: half the E2M1 spacing at |w| / 2**s, times 2**s (so at most 2**s)
    unit = np.exp2(np.repeat(s, 32, axis=-1)).transpose(0, 2, 1)  # [2, 128, 24] like w
    bound = 0.5 * _e2m1_step(np.abs(w) / unit) * unit
    assert np.all(err <= bound)
    assert np.all(err <= unit)
    # and it is the nearest grid value: no code at that scale is closer
    grid = FP4_VALUES[None, None, None, :] * unit[..., None]
    best = np.abs(grid - w[..., None]).min(-1)
    np.testing.assert_array_equal(err, best)
    assert np.array_equal(np.signbit(deq), np.signbit(w))  # signs kept, -0 included


def test_quantize_ties_round_to_even_code():
    # block scale 1 (amax 6); midpoints between neighbours go to the code with mantissa bit 0
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    x = np.zeros(32)
    x[0] = 6.0
    x[1:8], x[8:15] = mids, -mids
    x[15], x[16] = -0.1, 0.1  # round to -0 / +0
    blocks, scales = quantize(x.reshape(1, 32, 1))
    assert scales[0, 0, 0] == 127
    deq = dequantize(blocks, scales, dtype=np.float64)[0, :, 0]
    np.testing.assert_array_equal(deq[1:8], want)
    np.testing.assert_array_equal(deq[8:15], -want)
    assert deq[15] == 0 and np.signbit(deq[15]) and not np.signbit(deq[16])


@pytest.mark.parametrize(
    ("blocks", "scales", "match"),
    [
        (np.zeros((1, 2, 3, 16), np.int8), np.zeros((1, 2, 3), np.uint8), "blocks must be uint8"),
        (np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 3), np.int32), "scales must be uint8"),
        (
            np.zeros((1, 2, 3, 8), np.uint8),
            np.zeros((1, 2, 3), np.uint8),
            r"\[experts, rows, groups, 16\]",
        ),
        (
            np.zeros((2, 3, 16), np.uint8),
            np.zeros((2, 3), np.uint8),
            r"\[experts, rows, groups, 16\]",
        ),
        (np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 4), np.uint8), "without the last dim"),
    ],
)
def test_dequantize_errors(blocks, scales, match):
    with pytest.raises(ValueError, match=match) as info:
        dequantize(blocks, scales)
    assert "\n" not in str(info.value)


def test_dequantize_dtype_error():
    ok = np.zeros((1, 1, 1, 16), np.uint8), np.zeros((1, 1, 1), np.uint8)
    with pytest.raises(ValueError, match="dtype must be bfloat16, float16, float32 or float64"):
        dequantize(*ok, dtype=np.int32)


@pytest.mark.parametrize(
    ("w", "match"),
    [
        (np.zeros((1, 33, 2), np.float32), "K a multiple of 32"),
        (np.zeros((32, 2), np.float32), "K a multiple of 32"),
        (np.zeros((1, 32, 2), np.int32), "float array"),
        (np.full((1, 32, 2), np.nan, np.float32), "inf or NaN"),
        (np.full((1, 32, 2), 2e39, np.float64), "exceeds the largest MXFP4 value"),
    ],
)
def test_quantize_errors(w, match):
    with pytest.raises(ValueError, match=match) as info:
        quantize(w)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- packed in the model


def _ours_to_hf(a: np.ndarray) -> np.ndarray:
    """Our [E, G, 16, F] blocks / [E, G, F] scales -> the checkpoint's [E, F, G, 16] / [E, F, G]."""
    return np.moveaxis(a, -1, 1)


def test_model_packing_equals_the_checkpoint_format_bit_for_bit():
    """`model.fp4` (JAX, our layout) and `interop.mxfp4` (NumPy, the checkpoints'): the same
    blocks and scales for one weight (ties, zeros, tiny and large blocks included), and the
    same values back."""
    import jax.numpy as jnp

    from moe_jax.model import fp4

    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 64, 24)).astype(np.float32)
    w *= np.exp2(rng.integers(-8, 8, (3, 1, 24)))  # blocks of very different scales
    w[0, :32, 0] = 0.0  # an all-zero block
    w[1, :32, 1] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # every tie
    ours = fp4.quantize(jnp.asarray(w))
    blocks, scales = quantize(w)  # [E, F, G, 16], [E, F, G]: w's contracted axis is 64
    np.testing.assert_array_equal(_ours_to_hf(np.asarray(ours["blocks"])), blocks)
    np.testing.assert_array_equal(_ours_to_hf(np.asarray(ours["scales"])), scales)
    np.testing.assert_array_equal(
        np.asarray(fp4.dequantize(ours)), dequantize(blocks, scales, np.float32)
    )
    picked = np.asarray(fp4.dequantize(ours, jnp.array([[2, 0]])))  # a gather of experts
    np.testing.assert_array_equal(picked[0], dequantize(blocks, scales, np.float32)[[2, 0]])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_both_packings_refuse_non_finite_weights(bad):
    """One rule for the format (`model.fp4`): no scale holds NaN or inf, so the model's packing
    refuses them as the checkpoints' does (it once packed NaN as a finite code)."""
    import jax
    import jax.numpy as jnp

    from moe_jax.model import fp4

    w = np.ones((2, 64, 4), np.float32)
    w[1, 40, 3] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(w)
    with pytest.raises(ValueError, match="inf or NaN"):
        fp4.quantize(jnp.asarray(w))
    shapes = jax.eval_shape(fp4.quantize, jax.ShapeDtypeStruct(w.shape, jnp.float32))  # traced
    assert shapes["blocks"].shape == (2, 2, 16, 4)


def test_model_decode_of_every_scale_byte_equals_the_checkpoints_bit_for_bit():
    """`model.fp4.dequantize` and `interop.mxfp4.dequantize` (transformers') on every scale byte
    0..255 and every code: the same float32 bits, the subnormals of bytes 0..2 and byte 255
    (2**128, as transformers reads it: +-inf, 2**127 for code 0.5, +-0 for a zero code)
    included. The model's once built 2**(s-127) with exp2: 4e-6 off, bytes 0/1 flushed to 0,
    255 inf (so NaN for a zero code)."""
    import jax.numpy as jnp

    from moe_jax.model import fp4

    scales = np.arange(256, dtype=np.uint8)[None, :]  # [E=1, F=256]: one block per byte
    codes = np.arange(32, dtype=np.uint8) % 16  # every code, twice, in both nibbles
    blocks = np.broadcast_to((codes[0::2] | (codes[1::2] << 4))[None, :, None], (1, 16, 256))
    ours = {"blocks": jnp.asarray(blocks)[:, None], "scales": jnp.asarray(scales)[:, None]}
    got = np.asarray(fp4.dequantize(ours))  # [1, 32, 256]
    want = dequantize(_ours_to_hf(blocks[:, None]), _ours_to_hf(scales[:, None]), np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isinf(got[0, :, 255]).sum() == 24 and not np.isnan(got).any()


def test_model_packing_of_ties_at_every_scale_equals_the_checkpoints():
    """The ties (and 6, the block's largest) at every scale 2**-124..2**125 (the normal floats; a
    subnormal weight is flushed to 0 by XLA's CPU before it is packed): the model
    packs them as `interop.mxfp4` does; it once divided by exp2(s), off by up to 4e-6 on XLA's
    CPU, enough to move a tie to the other code."""
    import jax.numpy as jnp

    from moe_jax.model import fp4

    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32)
    w = np.ldexp(ties[None, :, None], np.arange(-124, 126)[None, None, :]).astype(np.float32)
    ours = fp4.quantize(jnp.asarray(w))
    blocks, scales = quantize(w)
    np.testing.assert_array_equal(_ours_to_hf(np.asarray(ours["scales"])), scales)
    np.testing.assert_array_equal(_ours_to_hf(np.asarray(ours["blocks"])), blocks)
