"""Packed batches: documents sharing a row never see each other, padding takes no expert
capacity, the loss counts only the targets the batch interface says, exactly under gradient
accumulation, and `logits_at` picks one position per row.

The reference for a packed document is the same document run alone: at the start of its own
row (positions 0..L-1, the whole row one segment, which is plain causal attention: checked
against no segments once), followed by filler tokens that causality keeps out of its logits.
Models route without capacity drops (`moe.capacity_factor=0`) unless a test says otherwise,
so a token's MoE output does not depend on which tokens share its routing group.

Tolerances: float32 throughout. Packed and alone runs compute the same sums in a different
order (masked keys add exact zeros), ~1e-6 on O(1) logits: 1e-5 absolute, while a document
seeing one of its neighbours' tokens, or a shifted position, moves logits by >1e-2.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.model import Transformer, attention
from moe_jax.model.loss import split_batch
from moe_jax.model.moe import MoE
from moe_jax.model.routing import assign_slots
from moe_jax.sharding import BATCH_AXES, create_sharded, make_mesh
from moe_jax.train.step import compute_grads, loss_fn, make_eval_step
from tests.helpers import forward, randomize_biases, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)
T = 24
# Per row: (segment id, length); segment 0 is padding. Left padding in row 1, right in row 0.
ROWS = [[(1, 11), (2, 9), (0, 4)], [(0, 3), (1, 5), (2, 16)]]
# Two layers: layer 1 dense, layer 2 MoE; 4 query heads share 2 key/value heads (GQA).
BASE = ["model.n_layers=2", "moe.capacity_factor=0", "attention.qkv_bias=true"]
ONE_MOE_LAYER = ["model.n_layers=1", "moe.interleave_step=1"]  # for the loss tests
KINDS = {
    "causal": ["attention.nope_interval=0"],
    "chunked": ["attention.nope_interval=0", "attention.chunk_size=5"],
    "window": ["attention.nope_interval=0", "attention.sliding_window=6"],
    "nope_temperature": [
        "attention.nope_interval=1",
        "attention.temperature_tuning=true",
        "attention.floor_scale=4",  # small, so the temperature varies within a document
    ],
}


def make(*overrides, mesh=None):
    cfg = tiny_config(*BASE, *overrides)
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    randomize_biases(model)
    return cfg, model


def layout(rows) -> tuple[np.ndarray, np.ndarray, list]:
    """segments and positions [B, T] of packed rows, and each document's (row, start, length)."""
    segments, positions, docs = [], [], []
    for row in rows:
        seg, pos = [], []
        for s, n in row:
            if s:
                docs.append((len(segments), len(seg), n))
            seg += [s] * n
            pos += list(range(n))
        segments.append(seg)
        positions.append(pos)
    return np.array(segments, np.int32), np.array(positions, np.int32), docs


def alone_tokens(tokens_BT, docs, n_rows: int, seed: int = 9):
    """Each document at the start of a row of its own, followed by random filler."""
    out = np.array(jax.random.randint(jax.random.key(seed), (n_rows, T), 0, 256), np.int32)
    for i, (r, s, n) in enumerate(docs):
        out[i, :n] = tokens_BT[r, s : s + n]
    return out


@nnx.jit
def packed_forward(model, tokens_BT, positions_BT, segments_BT):
    return model(tokens_BT, positions=positions_BT, segments=segments_BT)[0]


def check_packed_equals_alone(model, rows, mesh=None, plain=False):
    """The packed rows and the documents alone (one segment a row) run as one batch, so one
    compile serves both; `plain`: the documents alone without segments agree too."""
    seg, pos, docs = layout(rows)
    toks = np.array(jax.random.randint(jax.random.key(1), seg.shape, 0, 256), np.int32)
    alone = alone_tokens(toks, docs, -(-len(docs) // len(rows)) * len(rows))
    B = len(rows)
    alone_pos = np.broadcast_to(np.arange(T, dtype=np.int32), alone.shape)
    both = [
        np.concatenate(pair) for pair in ((toks, alone), (pos, alone_pos), (seg, alone * 0 + 1))
    ]
    if mesh is not None:  # the batch split over the batch axes, as the trainer feeds it
        both = [jax.device_put(a, NamedSharding(mesh, P(BATCH_AXES))) for a in both]
    # Jitted afresh: a trace cached by another test would not see `many_blocks`' patch.
    logits_BTV = nnx.jit(lambda m, *a: m(a[0], positions=a[1], segments=a[2])[0])(model, *both)
    for i, (r, s, n) in enumerate(docs):
        np.testing.assert_allclose(logits_BTV[r, s : s + n], logits_BTV[B + i, :n], **TOL)
    if plain:
        np.testing.assert_allclose(forward(model, alone)[0], logits_BTV[B:], **TOL)


def many_blocks(monkeypatch):
    """Query blocks of 4 positions (6 blocks at T=24), where T >= 128 would be needed."""
    monkeypatch.setattr(attention, "query_blocks", partial(attention.query_blocks, min_block=4))
    assert len(attention.query_blocks(T)) == 6


@pytest.mark.parametrize(
    "kind,blocked",
    [("causal", False), *((kind, True) for kind in KINDS)],
    ids=["causal-one_block", *(f"{kind}-blocked" for kind in KINDS)],
)
def test_packed_documents_equal_each_document_alone(monkeypatch, kind, blocked):
    """One [T, T] mask, or 6 query blocks of 4 (the path T >= 128 takes: block-skipped keys,
    windows and chunks across block edges, the hand-written backward's forward)."""
    if blocked:
        many_blocks(monkeypatch)
    _, model = make(*KINDS[kind])
    check_packed_equals_alone(model, ROWS, plain=kind == "causal" and not blocked)


def test_packed_documents_equal_alone_under_expert_parallelism(monkeypatch):
    """Data 2 x expert 4 (the MoE layer's shard_map with all_to_all, the padding mask split
    with the tokens), one RoPE layer with chunks and a window and one NoPE MoE layer with
    temperature tuning, in query blocks and a layer scan: 8 rows of 2 documents, some
    padded."""
    many_blocks(monkeypatch)
    over = [
        "model.scan_layers=true",
        "attention.nope_interval=2",
        "attention.temperature_tuning=true",
        "attention.floor_scale=4",
        "attention.chunk_size=5",
        "attention.sliding_window=6",
        "mesh.data=2",
        "mesh.expert=4",
    ]
    mesh = make_mesh(tiny_config(*BASE, *over))
    _, model = make(*over, mesh=mesh)
    rows = [[(1, 7 + r), (2, T - 7 - r - r % 3), (0, r % 3)] for r in range(8)]
    with jax.set_mesh(mesh):
        check_packed_equals_alone(model, rows, mesh)


def test_a_cached_forward_takes_no_segments():
    cfg = tiny_config()
    attn = attention.Attention(cfg, 0, rngs=nnx.Rngs(0))
    cache = {"k": jnp.zeros((1, 4, 2, cfg.head_dim)), "v": jnp.zeros((1, 4, 2, cfg.head_dim))}
    x, pos, seg = jnp.zeros((1, 4, cfg.model.d_model)), jnp.arange(4)[None], jnp.ones((1, 4))
    with pytest.raises(ValueError, match="segments are for forwards without a KV cache"):
        attn(x, pos, cache, seg)


# ----------------------------------------------------------------------------- MoE padding


def test_padding_takes_no_capacity_by_hand():
    """One group, 2 experts of capacity 1, top-1. Unmasked, tokens 0 and 2 (first in each
    expert's queue) take the slots; with tokens 0 and 3 padding, tokens 1 and 2 get them."""
    experts = jnp.array([[[0], [0], [1], [1]]])
    slot, keep = assign_slots(experts, 2, 1)
    assert slot[0, :, 0].tolist() == [0, 2, 1, 2] and keep[0, :, 0].tolist() == [1, 0, 1, 0]
    valid = jnp.array([[False, True, True, False]])
    slot, keep = assign_slots(experts, 2, 1, valid)
    assert slot[0, :, 0].tolist() == [2, 0, 1, 2] and keep[0, :, 0].tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize("mesh_over", [[], ["mesh.data=2", "mesh.expert=4"]], ids=["local", "ep"])
def test_padding_is_not_routed_and_counts_in_no_statistic(mesh_over):
    """An MoE layer given a padding mask: the valid tokens' outputs and every aux statistic
    equal those of the valid tokens alone, and padding's output is 0 (no shared expert)."""
    cfg = tiny_config(*BASE, "moe.router_bias=true", *mesh_over)
    mesh = make_mesh(cfg) if mesh_over else None
    ref = MoE(cfg, rngs=nnx.Rngs(0))
    moe = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), mesh)
    randomize_biases(ref)
    randomize_biases(moe)
    x = jax.random.normal(jax.random.key(2), (8, 6, cfg.model.d_model))
    valid = jax.random.bernoulli(jax.random.key(3), 0.6, (8, 6))
    y_ref, s_ref = nnx.jit(lambda m, x: m(x))(ref, x[valid][None])  # [1, n_valid, D]
    if mesh is not None:
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P(BATCH_AXES)))
        with jax.set_mesh(mesh):
            y, s = nnx.jit(lambda m, x, v: m(x, 1, v))(moe, put(x), put(valid))
    else:
        y, s = nnx.jit(lambda m, x, v: m(x, 1, v))(moe, x, valid)
    np.testing.assert_allclose(y[valid], y_ref[0], **TOL)
    np.testing.assert_array_equal(y[~valid], 0)
    for k in s_ref:
        if k == "experts":  # each token's choice (routing replay's record): the valid ones'
            np.testing.assert_array_equal(s[k][valid], s_ref[k][0])
            continue
        np.testing.assert_allclose(s[k], s_ref[k], err_msg=k, **TOL)


def test_padding_never_changes_the_documents_or_the_aux_statistics():
    """With capacity drops, new tokens in the padding leave the documents' logits and every
    MoE statistic as they were: padding takes no expert's capacity (left padding would come
    first in the drop order) and counts in no statistic."""
    _, model = make(*ONE_MOE_LAYER, "moe.capacity_factor=0.5")
    seg, pos, _ = layout([[(0, 10), (1, 14)], [(1, 8), (2, 6), (0, 10)]])
    toks = jax.random.randint(jax.random.key(1), seg.shape, 0, 256)
    other = jnp.where(seg == 0, jax.random.randint(jax.random.key(2), seg.shape, 0, 256), toks)
    run = nnx.jit(lambda m, x: m(x, positions=pos, segments=seg))
    (logits, aux), (logits_other, aux_other) = run(model, toks), run(model, other)
    assert float(aux["dropped_frac"][0]) > 0.1  # capacity binds
    np.testing.assert_allclose(logits_other[seg != 0], logits[seg != 0], **TOL)
    for k in ("lb_loss", "z_loss", "expert_load", "dropped_frac"):
        np.testing.assert_allclose(aux_other[k], aux[k], err_msg=k, **TOL)


# ----------------------------------------------------------------------------- the loss


# The loss tests share one model, batches of one shape ([4, T+1], every key of the batch
# interface) and so one compiled gradient. Router aux losses off: the load-balance loss is a
# product of batch means (neither a sum over documents nor over micro-batches), and both are
# per micro-batch by design (see train_step). The logit z-loss is per counted target: on.
# Chunks make the logits depend on the positions themselves, not only on their differences;
# the layer runs as a one-block layer scan, its backward rematerialised.
LOSS = [
    *ONE_MOE_LAYER,
    "attention.nope_interval=0",
    "attention.chunk_size=5",
    "model.scan_layers=true",
    "model.remat=dots",
    "moe.lb_loss_weight=0",
    "moe.z_loss_weight=0",
    "train.logit_z_loss=1e-3",
    "train.grad_accum=2",
]
grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 3))


@pytest.fixture(scope="module")
def loss_model():
    cfg, model = make(*LOSS)
    return (cfg, *nnx.split(model))


def packed_batch(rows, seed=1) -> dict:
    """A [B, T+1] batch dict of the given row layout (T+1 positions per row), all targets
    masked in."""
    seg, pos, _ = layout(rows)
    toks = np.array(jax.random.randint(jax.random.key(seed), seg.shape, 0, 256), np.int32)
    return {"tokens": toks, "segments": seg, "positions": pos, "loss_mask": np.ones_like(seg)}


def counted_by_hand(batch) -> np.ndarray:
    """[B, T] 0/1: target t+1 counts if tokens t and t+1 share a non-padding document and
    loss_mask[t+1] is 1: the definition, written as loops."""
    seg, mask = batch["segments"], batch["loss_mask"]
    out = np.zeros(seg[:, 1:].shape)
    for b in range(seg.shape[0]):
        for t in range(seg.shape[1] - 1):
            out[b, t] = seg[b, t] == seg[b, t + 1] != 0 and mask[b, t + 1] == 1
    return out


def test_loss_counts_only_masked_in_targets_of_each_document(loss_model):
    """Segments and a loss mask (an SFT-style prompt/completion split): the eval step's sum
    and count, and the loss, are the CE over exactly the counted targets, by hand (fp64)."""
    _, graphdef, params = loss_model
    rows = [[(1, 10), (2, 12), (0, 3)], [(1, 25)], [(0, 4), (1, 21)], [(1, 12), (2, 13)]]
    batch = packed_batch(rows)
    mask = batch["loss_mask"]
    mask[0, :4] = mask[0, 10:15] = mask[1, :9] = mask[2, 6:9] = 0  # some prompts
    counted = counted_by_hand(batch)
    assert 0 < counted.sum() < counted.size - 20  # the rule leaves many targets out
    inputs = [batch[k][:, :-1] for k in ("tokens", "positions", "segments")]
    logits = np.asarray(packed_forward(nnx.merge(graphdef, params), *inputs), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce_BT = logz - np.take_along_axis(logits, batch["tokens"][:, 1:, None], -1)[..., 0]
    ce_sum, count = make_eval_step(graphdef, sums=True)(params, batch)
    assert float(count) == counted.sum()
    np.testing.assert_allclose(ce_sum, np.sum(ce_BT * counted), rtol=1e-5)  # fp32 vs fp64
    (loss, _), _ = grad_fn(params, graphdef, batch, 1e-3)
    want = np.sum((ce_BT + 1e-3 * logz**2) * counted) / counted.sum()
    np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_packed_loss_and_gradients_equal_the_documents_alone(loss_model):
    """The loss and gradient of packed documents equal those of the same documents each at
    the start of its own row, followed by filler that the loss mask leaves out. Gradients:
    fp32 sums in another order, relative 1e-5 of each tensor's scale."""
    _, graphdef, params = loss_model
    rows = [[(1, 11), (2, 9), (0, 5)], [(0, 3), (1, 6), (2, 16)], [(0, 25)], [(0, 25)]]
    packed = packed_batch(rows)
    _, _, docs = layout(rows)
    alone = packed_batch([[(1, 25)]] * len(docs), seed=9)  # one document a row: plain causal
    alone["loss_mask"][:] = 0
    for i, (r, s, n) in enumerate(docs):
        alone["tokens"][i, :n] = packed["tokens"][r, s : s + n]
        alone["loss_mask"][i, 1:n] = 1  # the document's own targets
    (l_packed, m_packed), g_packed = grad_fn(params, graphdef, packed, 1e-3)
    (l_alone, m_alone), g_alone = grad_fn(params, graphdef, alone, 1e-3)
    assert (
        float(m_packed["n_targets"])
        == float(m_alone["n_targets"])
        == sum(n - 1 for _, _, n in docs)
    )
    np.testing.assert_allclose(l_packed, l_alone, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_a_batch_dict_names_only_known_keys():
    tokens = np.zeros((1, 5), np.int32)
    with pytest.raises(ValueError, match="a batch dict holds 'tokens' and optionally"):
        split_batch({"tokens": tokens, "lossmask": tokens})


def test_grad_accumulation_with_unequal_counts_equals_the_full_batch(loss_model):
    """Two micro-batches counting 6 and 48 targets: the accumulated sums over the global count
    give the full batch's loss, metrics and gradients (a mean of the micro-batch means would
    weigh a target of the sparse one 8x more). Tolerances as for the gradients above."""
    cfg, graphdef, params = loss_model
    batch = packed_batch([[(1, 12), (2, 13)], [(1, 25)], [(1, 2), (0, 23)], [(1, 25)]])
    batch["loss_mask"][0, :20] = 0  # row 0 learns only its last few targets
    counts = counted_by_hand(batch).sum(axis=1)
    per_micro = [counts[0] + counts[2], counts[1] + counts[3]]  # micro-batch a: rows a, a + 2
    assert per_micro == [6, 48], per_micro
    (loss, m_full), g_full = grad_fn(params, graphdef, batch, cfg.train.logit_z_loss)
    g_acc, m_acc = jax.jit(lambda p, b: compute_grads(p, graphdef, b, cfg.train))(params, batch)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_acc), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))
    np.testing.assert_allclose(m_acc["loss"], loss, rtol=1e-5)
    for k in ("ce", "logit_z"):
        np.testing.assert_allclose(m_acc[k], m_full[k], rtol=1e-5, err_msg=k)
    assert float(m_acc["n_targets"]) == counts.sum()


# ----------------------------------------------------------------------------- logits_at


def test_logits_at_equals_the_full_logits_at_those_positions():
    _, model = make(*ONE_MOE_LAYER)
    toks = jax.random.randint(jax.random.key(4), (3, T), 0, 256)
    at = jnp.array([0, 17, T - 1], jnp.int32)
    full, _ = forward(model, toks)
    picked, _ = nnx.jit(lambda m, x, at: m(x, logits_at=at))(model, toks, at)
    assert picked.shape == (3, 1, full.shape[-1])
    np.testing.assert_allclose(picked[:, 0], full[jnp.arange(3), at], rtol=1e-6, atol=1e-6)
