"""Context parallelism (mesh.context, moe_jax/model/context_parallel.py) on 8 simulated CPU
devices: the loss and gradients of a split sequence equal the unsplit run's, float32, 2e-5.

One tiny model (2 layers: a sliding-window GQA layer with QK-norm and a full-attention MoE
layer, dropless so no routing group can drop differently), one packed batch whose documents
end inside and across the shards, compiled once per mesh.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import ConfigError
from moe_jax.sharding import make_mesh
from moe_jax.train.step import init_state, loss_fn, make_optimizer
from tests.helpers import tiny_config

B, T = 4, 32  # 4 rows over data 2; 32 tokens = 8 chunks of 4 at context 4
TOL = dict(rtol=2e-5, atol=2e-5)
MODEL = [
    "model.n_layers=2",
    "model.max_seq_len=64",
    f"train.seq_len={T}",
    f"train.batch_size={B}",
    "attention.nope_interval=0",
    "attention.qk_norm=rms",
    "attention.sliding_window=6",  # shorter than a shard's 8 tokens (context 4)
    "attention.full_attention_interval=2",  # layer 2 attends the whole document
    "moe.capacity_factor=0",  # dropless: a context shard routes as its own group
]


def packed_batch() -> dict:
    """tokens, segments and positions [B, T+1]: documents ending inside a shard's chunk
    (t=5), on a chunk's edge (t=12), and running across shards; a padded row end."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 256, (B, T + 1)).astype(np.int32)
    ends = [[5, 12, 21, T + 1], [T + 1], [9, 26, T + 1], [2, 17, 30]]  # row 3: pad after 30
    segments = np.zeros((B, T + 1), np.int32)
    positions = np.zeros((B, T + 1), np.int32)
    for r, row_ends in enumerate(ends):
        start = 0
        for d, end in enumerate(row_ends, 1):
            segments[r, start:end] = d
            positions[r, start:end] = np.arange(end - start)
            start = end
    return {"tokens": tokens, "segments": segments, "positions": positions}


def loss_and_grads(*overrides: str):
    cfg = tiny_config(*MODEL, *overrides)
    tx = make_optimizer(cfg.train)
    mesh = make_mesh(cfg) if any(o.startswith("mesh.") for o in overrides) else None
    graphdef, state = init_state(cfg, tx, mesh=mesh)
    batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
    run = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 3))
    if mesh is None:
        (loss, _), grads = run(state["params"], graphdef, batch, 0.0)
    else:
        with jax.set_mesh(mesh):
            (loss, _), grads = run(state["params"], graphdef, batch, 0.0)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def unsplit():
    return loss_and_grads()


def assert_same(got, want):
    assert abs(got[0] - want[0]) < 2e-5, (got[0], want[0])
    flat_got = jax.tree_util.tree_flatten_with_path(got[1])[0]
    for (path, g), w in zip(flat_got, jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, **TOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh", [["mesh.data=2", "mesh.context=4"]], ids=["data2_context4"])
def test_split_sequences_equal_the_unsplit_run(unsplit, mesh):
    assert_same(loss_and_grads(*mesh), unsplit)


def test_layout_holds_chunks_i_and_2n_1_i_and_balances_causal_work():
    from moe_jax.model.context_parallel import from_layout, layout_order, row_order, to_layout

    order = layout_order(16, 2)  # 4 chunks of 4: shard 0 holds 0 and 3, shard 1 holds 1 and 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    x = jnp.arange(2 * 48).reshape(2, 48)
    np.testing.assert_array_equal(from_layout(to_layout(x, 3), 3), x)
    np.testing.assert_array_equal(row_order(to_layout(x, 3), 3), x)  # the gathered keys' fix
    # each shard's queries see the same number of keys under a causal mask
    seen = [int(np.sum(shard + 1)) for shard in layout_order(64, 4).reshape(4, 16)]
    assert len(set(seen)) == 1, seen


def test_activations_are_split_over_context_at_every_layer_boundary():
    """sharding.at_block_boundary pins each layer's input and output to rows over the batch
    axes and the sequence over `context`."""
    from flax import nnx

    from moe_jax.model import Transformer
    from moe_jax.sharding import create_sharded

    cfg = tiny_config(*MODEL, "mesh.data=2", "mesh.context=4")
    mesh = make_mesh(cfg)
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(lambda t: model(t)[0])(jnp.zeros((B, T), jnp.int32)))
    found = re.findall(r"sharding_constraint\[[^\]]*?P\('data', 'context'\)", text)
    assert len(found) == 2 * cfg.model.n_layers


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.seq_len=36"], r"train.seq_len \(36\) must be divisible by 2 x mesh.context"),
        (["model.mtp_depth=1"], r"mesh.context=4 does not support model.mtp_depth"),
        (["attention.impl=splash"], r"does not support attention.impl=splash"),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        make_mesh(tiny_config(*MODEL, "mesh.data=2", "mesh.context=4", *overrides))
    assert "\n" not in str(e.value)
