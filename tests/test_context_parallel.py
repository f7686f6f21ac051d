"""Context parallelism (mesh.context, moe_jax/model/context_parallel.py) on 8 simulated CPU
devices: the loss and gradients of a split sequence equal the unsplit run's, float32, 2e-5.

One tiny model (2 layers: a GQA layer with QK-norm, a window shorter than a shard, chunks and
sinks, then a NoPE MoE layer attending whole documents, dropless so that no routing group
can drop differently), one packed batch whose documents end inside and across the shards,
compiled once per mesh; MLA's layers once more.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import ConfigError
from moe_jax.sharding import make_mesh
from moe_jax.train.step import compute_grads, init_state, loss_fn, make_optimizer
from tests.helpers import tiny_config

B, T = 4, 32  # 4 rows over data 2; 32 tokens = 8 chunks of 4 at context 4
TOL = dict(rtol=2e-5, atol=2e-5)
MODEL = [
    "model.n_layers=2",
    "model.max_seq_len=64",
    f"train.seq_len={T}",
    f"train.batch_size={B}",
    "attention.qk_norm=rms",
    # layer 1: RoPE, a window shorter than a shard's 8 tokens (context 4) inside Llama 4's
    # chunks of 12 positions (their edges cut across the layout's chunks); layer 2: NoPE
    # with temperature tuning, attending the whole document; gpt-oss's sinks in both
    "attention.sliding_window=6",
    "attention.chunk_size=12",
    "attention.full_attention_interval=2",
    "attention.nope_interval=2",
    "attention.temperature_tuning=true",
    "attention.sinks=true",
    "moe.capacity_factor=0",  # dropless: a context shard routes as its own group
    "model.init_std=0.3",  # sharp attention: a wrong key, position or scale shows
    "model.scan_layers=true",  # the layers scanned and rematerialised: the backward
    "model.remat=full",  # runs each layer's collectives again
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
    """(loss, gradients) of the packed batch; on a mesh, its compiled program is also checked
    to gather no whole-sequence activation (`assert_no_sequence_gather`)."""
    cfg = tiny_config(*MODEL, *overrides)
    tx = make_optimizer(cfg.train)
    mesh = make_mesh(cfg) if any(o.startswith("mesh.") for o in overrides) else None
    graphdef, state = init_state(cfg, tx, mesh=mesh)
    batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
    # the train step's own gradient: its micro-batch split, then loss_fn's layout
    run = jax.jit(lambda params: compute_grads(params, graphdef, batch, cfg.train))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = run.lower(state["params"]).compile()
        grads, metrics = compiled(state["params"])
    if mesh is not None:
        assert_no_sequence_gather(compiled.as_text(), cfg.model.d_model)
    return float(metrics["loss"]), jax.tree.map(np.asarray, grads)


def assert_no_sequence_gather(hlo: str, D: int) -> None:
    """No all-gather in the program makes an activation [.., T, .., D] whole: only what the
    strategy names travels (K/V heads, MLA's latent, positions and segments), no [b, T, D]
    (the dense MLP's [B*T, D] rows once gathered the sequence to merge B and T)."""
    for line in re.findall(r"^\s*%[\w.\-]+ = (.*?) all-gather(?:-start)?\(", hlo, re.M):
        for dims in re.findall(r"\w+\[([\d,]*)\]", line):
            shape = tuple(int(d) for d in dims.split(",") if d)
            whole = len(shape) >= 3 and shape[-1] == D and T in shape[:-1]
            assert not whole, f"an activation gathered whole: {line[:120]}"


@pytest.fixture(scope="module")
def unsplit():
    return loss_and_grads()


def assert_same(got, want):
    assert abs(got[0] - want[0]) < 2e-5, (got[0], want[0])
    flat_got = jax.tree_util.tree_flatten_with_path(got[1])[0]
    for (path, g), w in zip(flat_got, jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, **TOL, err_msg=jax.tree_util.keystr(path))


SPLITS = {
    "data2_context4": ["mesh.data=2", "mesh.context=4"],
    "context8": ["mesh.context=8"],  # 2-token chunks: the window spans 3 of them
    "fsdp2_expert2_context2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.context=2"],
    "context4_tensor2": ["mesh.context=4", "mesh.tensor=2"],
}


@pytest.mark.parametrize("mesh", list(SPLITS.values()), ids=list(SPLITS))
def test_split_sequences_equal_the_unsplit_run(unsplit, mesh):
    got = loss_and_grads(*mesh)
    assert_same(got, unsplit)
    sinks = [g for p, g in jax.tree_util.tree_flatten_with_path(got[1])[0] if "sinks" in str(p)]
    assert sinks and all(np.abs(g).max() > 0 for g in sinks)  # the sinks' gradient reached


# Two steps round a ring of 2 (fewer to compile than 4): shard 0's second block comes from
# a later shard, shard 1's from an earlier one, so both of the skips' branches run.
RING_SPLIT = ["mesh.data=4", "mesh.context=2"]


def test_ring_equals_the_unsplit_run(unsplit):
    """K/V blocks round the ring, the causal blocks that see nothing skipped, merged by
    log-sum-exp with the sinks: the same masks, documents and MoE layer as above."""
    assert_same(loss_and_grads(*RING_SPLIT, "mesh.context_strategy=ring"), unsplit)


# MLA gathers its latent and shared rope key, each shard expanding every head's k and v.
MLA = [
    "moe.n_experts=0",
    "attention.kind=mla",
    "attention.qk_norm=none",
    "attention.sliding_window=0",
    "attention.full_attention_interval=0",
    "attention.chunk_size=0",
    "attention.nope_interval=0",
    "attention.sinks=false",
    "attention.kv_lora_rank=16",
    "attention.qk_nope_head_dim=8",
    "attention.qk_rope_head_dim=8",
    "attention.v_head_dim=6",
    "attention.q_lora_rank=12",
]


@pytest.fixture(scope="module")
def mla_unsplit():
    return loss_and_grads(*MLA)


@pytest.mark.parametrize(
    "strategy, mesh",
    [("all_gather", SPLITS["context4_tensor2"]), ("ring", RING_SPLIT)],
    ids=["all_gather_context4_tensor2", "ring_data4_context2"],
)
def test_mla_split_equals_the_unsplit_run(mla_unsplit, strategy, mesh):
    """With q-LoRA: the query's projection is per token, and what the axis changes (the
    latent's gather, the expansion, the masks) is the same without it (both query forms
    are checked against transformers in tests/test_mla.py)."""
    got = loss_and_grads(*MLA, *mesh, f"mesh.context_strategy={strategy}")
    assert_same(got, mla_unsplit)
    up = [g for p, g in jax.tree_util.tree_flatten_with_path(got[1])[0] if "wk_b" in str(p)]
    assert up and all(np.abs(g).max() > 0 for g in up)  # W_uk's gradient, every shard's


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


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_attention_moves_keys_values_positions_and_segments_over_context(strategy):
    """The split run's attention is the strategy's map, not XLA's partitioning of the
    unsplit path: per layer 4 all_gathers over `context` (k, v, positions, segments), or
    for the ring 3 ppermutes of each (N - 1 steps at context 4) and no gather."""
    cfg = tiny_config(*MODEL, *SPLITS["data2_context4"], f"mesh.context_strategy={strategy}")
    mesh = make_mesh(cfg)
    graphdef, state = init_state(cfg, make_optimizer(cfg.train), mesh=mesh)
    batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(lambda p: loss_fn(p, graphdef, batch, 0.0))(state["params"]))
    gathers = re.findall(r"all_gather\[[^\]]*axis_name=\(?'?context", text)
    permutes = re.findall(r"ppermute\[[^\]]*axis_name=\(?'?context", text)
    want = (4, 0) if strategy == "all_gather" else (0, 12)
    assert (len(gathers), len(permutes)) == tuple(n * cfg.model.n_layers for n in want)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.seq_len=36"], r"train.seq_len \(36\) must be divisible by 2 x mesh.context"),
        (["model.mtp_depth=1"], r"mesh.context=4 does not support model.mtp_depth"),
        (["attention.impl=splash"], r"does not support attention.impl=splash"),
        (["eval.tasks=hellaswag"], r"does not support eval.tasks"),
        (  # a hybrid stack (tests/test_hybrid.py's sizes): its state would cross the shards
            ["attention.linear=gated_deltanet", "attention.full_attention_interval=2"]
            + ["attention.sliding_window=0"]  # the hybrid's full layers: plain GQA
            + [f"attention.linear_{k}=4" for k in ("key_heads", "value_heads")]
            + [f"attention.linear_{k}=8" for k in ("key_dim", "value_dim")],
            r"does not support attention.linear=gated_deltanet",
        ),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        make_mesh(tiny_config(*MODEL, "mesh.data=2", "mesh.context=4", *overrides))
    assert "\n" not in str(e.value)
