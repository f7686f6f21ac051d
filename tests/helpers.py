"""Small shared builders for the tests."""

from __future__ import annotations

import zlib

import jax
import numpy as np
from flax import nnx

from moe_jax.config import Config, load_config

# A very small model on top of configs/tiny.yaml (also usable as CLI overrides).
TINY_BASE = [
    # The tests' tiny model keeps a NoPE layer with temperature tuning (configs/tiny.yaml had
    # them until the default had to export): every path through it stays exercised.
    "attention.nope_interval=4",
    "attention.temperature_tuning=true",
    "model.d_model=32",
    "model.ffn_hidden=48",
    "attention.n_heads=4",
    "attention.n_kv_heads=2",
    "moe.expert_hidden=40",
]


def tiny_config(*overrides: str) -> Config:
    """configs/tiny.yaml shrunk by TINY_BASE, then the given overrides."""
    return load_config("configs/tiny.yaml", [*TINY_BASE, *overrides])


@nnx.jit
def forward(model, tokens_BT):
    """Jitted `model(tokens)`: one compile per shape instead of thousands of eager op launches."""
    return model(tokens_BT)


@nnx.jit
def forward_cached(model, tokens_BT, positions_BT, cache):
    return model(tokens_BT, positions=positions_BT, cache=cache)


def one_expert_at_a_time(monkeypatch, unrolled: bool) -> None:
    """Send the tiny tests' expert buffers down the training path (`experts.expert_swiglu`: one
    expert at a time on its filled rows), with the experts unrolled or in a `lax.map`."""
    from moe_jax.model import experts

    monkeypatch.setattr(experts, "MAP_MIN_CAPACITY", 1)
    monkeypatch.setattr(
        experts, "UNROLL_MAX_EXPERTS", experts.UNROLL_MAX_EXPERTS if unrolled else 0
    )
    monkeypatch.setattr(experts, "UNROLL_MIN_MACS", 0)


def randomize_biases(module: nnx.Module, seed: int = 0) -> None:
    """Biases start at zero, where a wrongly placed or dropped one goes unseen: give every
    `*bias` parameter N(0, 0.3^2) values, keyed by its path so that two models with the same
    layout (scanned or not, sharded or not) get the same values, keeping each one's sharding."""
    for path, p in nnx.iter_graph(module):
        if isinstance(p, nnx.Param) and str(path[-1]).endswith("bias"):
            key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(repr(path).encode()))
            value = jax.random.normal(key, p[...].shape, p[...].dtype) * 0.3
            sharding = getattr(p[...], "sharding", None)
            p[...] = jax.device_put(value, sharding) if sharding is not None else value


def dequantised_copy(model: nnx.Module, qmodel: nnx.Module) -> nnx.Module:
    """`model` (float) with each weight that `qmodel` (its `quantize_model`) holds quantised
    replaced by that weight dequantised: the float model the quantised one must compute."""
    from moe_jax.model.int8 import QuantizedParam

    dequantised = nnx.clone(model)
    for path, v in nnx.to_flat_state(nnx.state(qmodel, QuantizedParam)):
        target = dequantised
        for name in path[:-1]:
            target = target[name] if isinstance(name, int) else getattr(target, name)
        getattr(target, path[-1])[...] = v[...]
    return dequantised


def assert_same_rollout_rows(got: dict, want: dict) -> None:
    """Two draws' GRPO rows alike: the same keys, shapes and dtypes; tokens, mask, routes,
    rewards and advantages equal, the sampled tokens' log-probs within 1e-5 (another program
    sums the same float32 logits in another order); completions of more than one token."""
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert (got[k].shape, got[k].dtype) == (v.shape, v.dtype), k
        if k == "old_logp":
            np.testing.assert_allclose(got[k], v, atol=1e-5, rtol=0)
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert got["mask"].sum() > 8


def resumed_copy_equals(overrides: list[str], root, resume_step: int = 2, steps: int = 4):
    """Train `tiny_config(*overrides)` to `steps` in root/straight, copy it to root/resumed and
    resume the copy from its `resume_step` checkpoint (the one a run stopped there would have
    saved) to `steps`: its params must be bit-identical (the same compiled step on the same
    inputs). -> (straight, resumed) run directories."""
    import shutil

    from moe_jax.inference.load import load_run
    from moe_jax.train.loop import train

    straight, resumed = root / "straight", root / "resumed"
    train(tiny_config(*overrides, f"run_dir={straight}"), stop_at=steps)
    shutil.copytree(straight, resumed)
    train(tiny_config(*overrides, f"run_dir={resumed}", f"train.resume_step={resume_step}"),
          stop_at=steps)  # fmt: skip
    a, b = (nnx.state(load_run(d, steps)[1], nnx.Param) for d in (straight, resumed))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    return straight, resumed
