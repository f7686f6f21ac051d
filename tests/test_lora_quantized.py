"""LoRA on a quantised frozen base (lora.base_dtype=int8 | mxfp4, QLoRA-style): the adapted
model equals an explicit float model holding the dequantised base, a train step moves A
and B alone (the stored integers and scales bit-identical), and the state holds fewer
bytes than with a bfloat16 base. (Resume: tests/test_dpo.py's run; init_from an HF
directory: tests/test_lora_peft.py's.)

Tolerance: both sides float32 on the same dequantised values, summed in the same order
but for the int8 layer tie (`int8.after`, an added integer 0): 1e-6 of O(1) logits, while
the adapters (B drawn at 0.3) move them by O(0.1).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model import Transformer
from moe_jax.model.int8 import QuantizedParam
from moe_jax.posttrain import lora as lora_params
from moe_jax.train.step import init_state, make_optimizer, make_train_step
from tests.helpers import forward, tiny_config
from tests.test_lora import draw_b, tokens


def config(base_dtype: str, *extra):
    # d_model and expert_hidden multiples of 32 (mxfp4's blocks)
    return tiny_config(
        "lora.rank=4", "lora.alpha=8", "lora.targets=[attention,experts]",
        f"lora.base_dtype={base_dtype}", "model.d_model=64", "moe.expert_hidden=32",
        "moe.capacity_factor=0", "model.n_layers=2", *extra,
    )  # fmt: skip


def dequantised(params):
    """The params with every quantised weight a plain float32 Param of its dequantised
    values (what the quantised model reads)."""
    one = lambda v: nnx.Param(v[...], **v.get_metadata()) if isinstance(v, QuantizedParam) else v
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("base_dtype", ["int8", "mxfp4"])
def test_quantised_base_logits_equal_a_dequantised_float_reference(base_dtype):
    """The quantised LoRA model (B drawn) against the float LoRA model whose base weights
    are the dequantised ones: equal logits; and unlike the unquantised model's (the base
    really is quantised: its weights are not the float ones)."""
    cfg = config(base_dtype)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    draw_b(model)
    quantised = lora_params.quantized_base(model, base_dtype)
    n = len(jax.tree.leaves(nnx.state(quantised, QuantizedParam)))
    assert n >= (10 if base_dtype == "int8" else 3)  # int8: all matmuls; mxfp4: experts'
    reference = nnx.merge(nnx.graphdef(model), dequantised(nnx.state(quantised, nnx.Param)))
    x = tokens()
    got = forward(quantised, x)[0]
    np.testing.assert_allclose(got, forward(reference, x)[0], rtol=1e-6, atol=1e-6)
    floats = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for p, v in nnx.to_flat_state(nnx.state(reference, nnx.Param)):
        if "experts" in p and p[-1] == "w_up":  # quantised either way
            assert 0 < float(jnp.max(jnp.abs(v[...] - floats[p][...]))) < 0.1, p


def state_bytes(state) -> int:
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(state))


def test_an_int8_base_step_moves_the_adapters_alone_in_a_smaller_state():
    """lora.base_dtype=int8: two steps change A and B and nothing else (the base's int8
    values and scales bit for bit); the optimizer holds A and B's moments alone; the
    state's bytes (counted leaf by leaf) are those of the bfloat16 base's state less about
    its quantised weights' (2 bytes an entry become 1, plus a float32 scale a channel)."""
    cfg = config("int8", "train.batch_size=2", "train.seq_len=16", "train.lr=1e-2")
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx)
    flat = dict(nnx.to_flat_state(state["params"]))
    quantised = {p for p, v in flat.items() if isinstance(v, QuantizedParam)}
    assert any("experts" in p for p in quantised) and any("head" in p for p in quantised)
    raw = lambda s: {p: jax.tree.map(np.asarray, v.get_raw_value())
                     for p, v in nnx.to_flat_state(s["params"])}  # fmt: skip
    before = raw(state)
    step = make_train_step(cfg, graphdef, tx)
    for _ in range(2):
        state, metrics = step(state, tokens(2, 17, seed=3))
    assert np.isfinite(float(metrics["loss"]))
    after = raw(state)
    for p, b in before.items():
        if lora_params.is_trained(p):
            assert not np.array_equal(b, after[p]), p
        else:
            for u, v in zip(jax.tree.leaves(b), jax.tree.leaves(after[p]), strict=True):
                np.testing.assert_array_equal(u, v, str(p))
    n_trained = sum(map(lora_params.is_trained, flat))
    assert len(jax.tree.leaves(state["opt_state"][1][0].mu)) == n_trained

    bf16_cfg = config("bfloat16", "train.batch_size=2", "train.seq_len=16")
    _, bf16 = init_state(bf16_cfg, tx, abstract=True)
    bf16_flat = dict(nnx.to_flat_state(bf16["params"]))
    entries = sum(math.prod(bf16_flat[p].shape) for p in quantised)
    scale_bytes = sum(flat[p].get_raw_value()["scale"].nbytes for p in quantised)
    saved = state_bytes(bf16) - state_bytes(state)
    assert saved == entries - scale_bytes and scale_bytes < 0.15 * entries, (saved, entries)
