"""Muon and MuonClip (`train.optimizer=muon`, `train.qk_clip`; moe_jax/train/muon.py and
qk_clip.py): Muon's update against a float64 numpy reference written from Moonlight's
algorithm, an expert stack against a loop over its experts, the Muon / AdamW split of the real
model's params, 8 simulated devices (fsdp x expert x tensor) against one, QK-clip's bound and
its untouched heads for GQA and MLA, the max-logit statistic against a numpy one, exact resume
of a Muon + QK-clip run, and the config's refusals.

Budget: tiny shapes; each model program is compiled once in a module-scoped fixture.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.model.attention import Attention
from moe_jax.observe.writers import read_metrics
from moe_jax.run.layout import RunError
from moe_jax.sharding import batch_sharding, make_mesh
from moe_jax.train import muon, qk_clip
from moe_jax.train.loop import train
from moe_jax.train.step import init_state, lr_schedule, make_optimizer, make_train_step
from tests.helpers import randomize_biases, resumed_copy_equals, tiny_config
from tests.test_train import TINY

MUON = ["train.optimizer=muon", "train.clip_norm=0"]
# Two stacked one-layer blocks (period 1, under the scan), MoE every layer, no QK-norm
# (QK-clip refuses it), q/k biases (which QK-clip scales with their projections).
GQA = [
    "model.n_layers=2",
    "attention.nope_interval=0",
    "attention.qk_norm=none",
    "attention.qkv_bias=true",
    "moe.interleave_step=1",
    "moe.capacity_factor=0",
    "train.batch_size=8",
    "train.seq_len=16",
    "model.max_seq_len=16",
]
MLA = [
    *GQA[:3],
    *GQA[4:],
    "attention.kind=mla",
    "attention.q_lora_rank=12",
    "attention.kv_lora_rank=16",
    "attention.qk_nope_head_dim=8",
    "attention.qk_rope_head_dim=4",
    "attention.v_head_dim=6",
]


# ----------------------------------------------------------------------------- the update


def reference_muon(W, grads, lrs, mu=0.95, wd=0.1, rms=0.2, steps=5):
    """Moonlight's Algorithm 1 ("Muon is Scalable for LLM Training"), with the Nesterov form of
    its code, for one matrix W [A, B], float64: M = mu M + G; N = G + mu M; O = NS5(N) *
    rms * sqrt(max(A, B)); W = W - lr (O + wd W). NS5 on the wide orientation, after N / |N|_F."""
    a, b, c = 3.4445, -4.7750, 2.0315
    W, M = W.astype(np.float64), np.zeros(W.shape)
    for G, lr in zip(grads, lrs, strict=True):
        M = mu * M + G
        X = G + mu * M
        tall = X.shape[0] > X.shape[1]
        X = X.T if tall else X
        X = X / (np.linalg.norm(X) + 1e-7)
        for _ in range(steps):
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        O = (X.T if tall else X) * rms * np.sqrt(max(W.shape))
        W = W - lr * (O + wd * W)
    return W


def test_update_equals_float64_reference():
    """Three make_optimizer steps on a dense matrix (tall and wide), a heads-fused q projection
    [D, H, hd] (one [D, H * hd] matrix) and an output projection [H, hd, D], and a scanned
    expert stack [L, E, D, F] (each layer's each expert's [D, F] apart), against the reference:
    the sum of the three updates (float32 each, summed in float64, so that the weights' own
    float32 rounding, 1e-7 of O(1) weights against updates of ~1e-3, does not enter).
    Tolerance: the float32 iteration's rounding (~1e-7 relative per op) grows through five
    quintic steps whose slope at 0 is 3.4; measured 5e-7 of the updates' scale, asserted at
    1e-5. A wrong coefficient, RMS factor, momentum form or matrix grouping is >1e-2 off."""
    cfg = tiny_config(*MUON, "train.warmup_steps=2", "train.steps=10")
    rng = np.random.default_rng(0)
    shapes = {
        ("ffn", "w_up"): (6, 10),
        ("ffn", "w_down"): (10, 6),
        ("attn", "wq"): (6, 2, 5),
        ("attn", "wo"): (2, 5, 6),
        ("blocks", "experts", "w_gate"): (2, 3, 6, 4),
        ("embed", "embedding"): (7, 6),  # AdamW's
    }
    nest = lambda path, v: {path[0]: v} if len(path) == 1 else {path[0]: nest(path[1:], v)}
    params = {}
    for path, shape in shapes.items():
        params = _merge(params, nest(path, rng.normal(size=shape).astype(np.float32)))
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
             for _ in range(3)]  # fmt: skip
    tx = make_optimizer(cfg.train)
    state, current = tx.init(params), params
    update = jax.jit(tx.update)
    got = jax.tree.map(lambda p: np.zeros(p.shape), params)  # the updates' float64 sum
    for g in grads:
        updates, state = update(g, state, current)
        current = jax.tree.map(lambda p, u: p + u, current, updates)
        got = jax.tree.map(lambda s, u: s + np.asarray(u, np.float64), got, updates)
    lrs = [float(lr_schedule(cfg.train)(s)) for s in range(3)]
    leaves = lambda tree, path: [_at(t, path) for t in tree]
    for path, shape in shapes.items():
        if path[-1] == "embedding":
            continue
        dims = muon.muon_dims([jax.tree_util.DictKey(k) for k in path], len(shape))
        W, G = np.asarray(_at(params, path)), np.stack(leaves(grads, path))
        want = np.empty(shape)
        A = int(np.prod([shape[i] for i in dims[0]]))  # the matrix's rows
        for lead in np.ndindex(*shape[: len(shape) - len(dims[0]) - len(dims[1])]):
            mats = [x[lead].reshape(A, -1) for x in (W, *G)]
            want[lead] = reference_muon(mats[0], mats[1:], lrs).reshape(shape[len(lead) :])
        step = want - W
        np.testing.assert_allclose(
            _at(got, path), step, rtol=0, atol=1e-5 * np.abs(step).max(), err_msg=str(path)
        )


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_an_expert_stack_is_orthogonalised_expert_by_expert():
    """orthogonalize([E, D, F]) equals the loop over experts (the same float ops, vmapped:
    1e-6), and differs from orthogonalising the stack as one [E * D, F] matrix."""
    u = jax.random.normal(jax.random.key(1), (4, 8, 6))
    dims = ((1,), (2,))
    stack = muon.orthogonalize(u, dims, 5, 0.2)
    loop = jnp.stack([muon.orthogonalize(u[e], ((0,), (1,)), 5, 0.2) for e in range(4)])
    np.testing.assert_allclose(stack, loop, rtol=0, atol=1e-6)
    flat = muon.orthogonalize(u.reshape(32, 6), ((0,), (1,)), 5, 0.2)
    assert np.abs(flat.reshape(4, 8, 6) * np.sqrt(8 / 32) - stack).max() > 1e-2
    # each expert's matrix is near-orthogonal: singular values of NS5 lie in about [0.7, 1.2]
    sv = np.linalg.svd(np.asarray(stack[0]) / (0.2 * np.sqrt(8)), compute_uv=False)
    assert sv.min() > 0.6 and sv.max() < 1.3


# ----------------------------------------------------------------------------- the partition


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_partition_of_the_real_model(kind):
    """Every param of the model (abstract) by name: Muon on the matmul weights with the matrix
    axes the module doc names (a scanned layer and an expert are batch axes), AdamW on the
    embedding, head, norms, biases, router and shared-expert gate; the state holds momenta for
    the Muon leaves and Adam's moments for the rest."""
    extra = ["moe.shared_expert_hidden=8", "moe.router_bias=true", "moe.interleave_step=2"]
    base = GQA if kind == "gqa" else MLA
    cfg = tiny_config(*base, *MUON, *extra, "model.n_layers=4")
    _, state = init_state(cfg, make_optimizer(cfg.train), abstract=True)
    got = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        got[".".join(names)] = muon.muon_dims(path, leaf.ndim)
    adamw = {n for n, d in got.items() if d is None}
    assert {n.split(".")[-1] for n in adamw} == {
        "embedding", "head", "scale", "router", "router_bias",
        *(("q_bias", "k_bias", "v_bias") if kind == "gqa" else ()),
    }  # fmt: skip
    # blocks: [2 blocks, ...]; layers.0 dense, layers.1 MoE (interleave_step=2)
    want = {
        "blocks.layers.0.ffn.w_gate": ((1,), (2,)),
        "blocks.layers.1.ffn.experts.w_down": ((2,), (3,)),  # [L, E, F, D]
        "blocks.layers.1.ffn.shared.w_up": ((1,), (2,)),
        "blocks.layers.0.attn.wo": ((1, 2), (3,)),  # [L, H, hd, D]
    }
    if kind == "gqa":
        want |= {
            "blocks.layers.0.attn.wq": ((1,), (2, 3)),
            "blocks.layers.1.attn.wk": ((1,), (2, 3)),
        }
    else:
        want |= {
            "blocks.layers.0.attn.wq_a": ((1,), (2,)),
            "blocks.layers.0.attn.wq_b": ((1,), (2, 3)),
            "blocks.layers.0.attn.wkv_a": ((1,), (2,)),
            "blocks.layers.1.attn.wk_b": ((1,), (2, 3)),
            "blocks.layers.1.attn.wv_b": ((1,), (2, 3)),
        }
    for name, dims in want.items():
        assert got[name] == dims, name
    inner = state["opt_state"][1].inner_states  # after clip_by_global_norm's
    momenta = jax.tree_util.tree_flatten_with_path(inner["muon"].inner_state[0].trace)[0]
    named = lambda p: ".".join(str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey))
    assert {named(p) for p, _ in momenta} == {n for n, d in got.items() if d is not None}


# ----------------------------------------------------------------------------- 8 devices


def _steps(*overrides: str, steps: int = 2):
    """-> (metrics, params) after train steps of the tiny GQA model with Muon and QK-clip."""
    # (no q/k biases: softmax is blind to the key bias, whose gradient is rounding noise that
    # Adam scales up to a full step)
    extra = ["attention.qkv_bias=false", "train.warmup_steps=1"]
    cfg = tiny_config(*GQA, *MUON, "train.qk_clip=0.02", *extra, *overrides)
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx, mesh=mesh)
    step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, cfg.model.vocab_size, jnp.int32)
    with jax.set_mesh(mesh):
        for _ in range(steps):
            state, metrics = step(state, jax.device_put(tokens, batch_sharding(mesh)))
    return jax.device_get(metrics), jax.device_get(state["params"])


def test_sharded_equals_unsharded():
    """fsdp 2 x expert 2 x tensor 2 against one device, two Muon steps with QK-clip (which
    clips some heads: the max logits reduced over the batch and tensor shards). Tolerance:
    the same float32 sums split into partial sums, then five Newton-Schulz steps; measured
    2.4e-7 (a norm scale's last bit), asserted at 1e-6 absolute, where each step moves a weight
    by ~lr = 3e-3 and orthogonalising a shard's slice alone would be off by that order."""
    m1, p1 = _steps()
    m8, p8 = _steps("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m8["max_logit"], m1["max_logit"], rtol=1e-5)
    assert m1["qk_clipped"] == m8["qk_clipped"] > 0
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- QK-clip


@pytest.fixture(scope="module", params=["gqa", "mla"])
def clip_case(request):
    """(cfg, params with random biases, a jitted params -> max_logit [L, H] forward)."""
    base = GQA if request.param == "gqa" else MLA
    cfg = tiny_config(*base, "train.qk_clip=1", "model.init_std=0.2")
    graphdef, state = init_state(cfg, make_optimizer(cfg.train))
    model = nnx.merge(graphdef, state["params"])
    randomize_biases(model)
    params = nnx.state(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (4, 16), 0, cfg.model.vocab_size, jnp.int32)
    forward = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens)[1]["max_logit"])
    return request.param, cfg, params, forward


def test_qk_clip_bounds_the_max_logit_and_leaves_other_heads_alone(clip_case):
    """tau = the median head's max logit over both layers. Each layer l with its clipped
    projections and every layer before it as it was (so that l sees the same inputs: later
    layers' inputs move with the earlier layers' attention, which is why Kimi K2 clips again
    every step) has max logit tau for every head that was over it (1e-5: a clipped head's
    logits scale by gamma exactly, up to float32 rounding), and every head under it keeps its
    max logit and its projections bit for bit. GQA: a key head is scaled only when all its
    query heads were over tau."""
    kind, cfg, params, forward = clip_case
    before = np.asarray(forward(params))  # [L, H]
    tau = float(np.median(before))
    over = before > tau
    assert 0 < over.sum() < over.size and over.any(-1).all()  # clips in every layer
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, qk_clip=tau))
    clipped = qk_clip.clip(params, jnp.asarray(before), cfg)
    for layer in range(before.shape[0]):
        after = np.asarray(forward(_clipped_at(params, clipped, layer)))[layer]
        np.testing.assert_allclose(after[over[layer]], tau, rtol=1e-5)
        assert np.array_equal(after[~over[layer]], before[layer][~over[layer]])
    old, new = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(clipped))
    G = cfg.attention.n_heads // cfg.attention.n_kv_heads
    for path, v in old.items():
        a, b = np.asarray(v[...]), np.asarray(new[path][...])
        heads = lambda w: np.moveaxis(w, -2, 1)  # [L, (in,) heads, dim] -> [L, heads, ...]
        if path[-1] in ("wq", "wq_b", "q_bias", "wk_b"):  # per query head
            assert np.array_equal(heads(a)[~over], heads(b)[~over]) and not np.array_equal(a, b)
        elif path[-1] in ("wk", "k_bias"):  # a key head moves only if its G heads are all over
            kept = ~over.reshape(over.shape[0], -1, G).all(-1)
            assert np.array_equal(heads(a)[kept], heads(b)[kept])
        else:  # values, output, the rope key, MLPs: untouched
            assert np.array_equal(a, b), path


def _clipped_at(params, clipped, layer: int):
    """`params` with scanned layer `layer`'s attention weights taken from `clipped`."""
    new = dict(nnx.to_flat_state(clipped))
    out = []
    for path, v in nnx.to_flat_state(params):
        if path[0] == "blocks" and "attn" in path:
            v = v.replace(v[...].at[layer].set(new[path][...][layer]))
        out.append((path, v))
    return nnx.from_flat_state(out)


def test_the_max_logit_is_each_heads_largest_scaled_q_dot_k():
    """The blocked kernel's statistic against numpy: max over rows and causal keys of
    (q_h . k_{h // G}) / sqrt(hd), per query head, with q/k biases and a packed row's
    document mask (NoPE, no temperature: plain projections)."""
    cfg = tiny_config(*GQA, "train.qk_clip=1", "attention.nope_interval=1",
                      "attention.temperature_tuning=false")  # fmt: skip
    layer = Attention(cfg, 0, rngs=nnx.Rngs(3))
    randomize_biases(layer)
    B, T, D = 2, 16, cfg.model.d_model
    x = jax.random.normal(jax.random.key(4), (B, T, D))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.concatenate([jnp.ones((B, 9), jnp.int32), 2 * jnp.ones((B, 7), jnp.int32)], 1)
    stats = {}
    layer(x, pos, None, seg, stats)
    w = {
        n: np.asarray(getattr(layer, n)[...], np.float64) for n in ("wq", "wk", "q_bias", "k_bias")
    }
    q = np.einsum("btd,dhk->bthk", np.asarray(x, np.float64), w["wq"]) + w["q_bias"]
    k = np.einsum("btd,dhk->bthk", np.asarray(x, np.float64), w["wk"]) + w["k_bias"]
    G = cfg.attention.n_heads // cfg.attention.n_kv_heads
    logits = np.einsum("bthk,bshk->bhts", q, np.repeat(k, G, axis=2)) / np.sqrt(cfg.head_dim)
    s = np.asarray(seg)
    mask = np.tril(np.ones((T, T), bool))[None] & (s[:, :, None] == s[:, None, :])
    want = np.where(mask[:, None], logits, -np.inf).max(axis=(0, 2, 3))
    np.testing.assert_allclose(stats["max_logit"], want, rtol=1e-5)


# ----------------------------------------------------------------------------- resume


def test_muon_with_qk_clip_resumes_exactly(tmp_path):
    """A 4-step run with Muon and QK-clip, and a copy of it resumed from its step-2 checkpoint
    to 4 (the checkpoint a run stopped at 2 would have saved): the same compiled step on the
    same inputs, so bit-identical params only if Muon's momenta came back. The metrics hold
    each layer's max logit and the heads clipped. Resuming it with AdamW is refused."""
    overrides = [*TINY, *GQA[:4], *MUON, "train.qk_clip=0.02", "checkpoint.every=2"]
    straight, resumed = resumed_copy_equals(overrides, tmp_path)
    records = [r for r in read_metrics(straight) if r["kind"] == "train"]
    assert [len(r["max_logit"]) for r in records] == [2] * 4
    assert sum(r["qk_clipped"] for r in records) > 0
    # AdamW cannot continue Muon's state: refused by name, before anything is written
    with pytest.raises(RunError, match=r"was trained with train.optimizer=muon, whose state"):
        train(tiny_config(*overrides, "train.optimizer=adamw", f"run_dir={resumed}"), stop_at=5)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.optimizer=sgd"], "train.optimizer='sgd' is not supported; use one of adamw, muon"),
        (["train.muon_momentum=1.0"], "train.muon_momentum must be within [0, 1)"),
        (["train.muon_ns_steps=0"], "train.muon_ns_steps must be positive, got 0"),
        (["train.muon_rms=0"], "train.muon_rms must be positive, got 0"),
        (["train.qk_clip=-1"], "train.qk_clip must be >= 0"),
        (["train.optimizer=muon", "lora.rank=4"], "set train.optimizer=adamw for LoRA"),
        (["train.qk_clip=100"], "train.qk_clip does not support attention.qk_norm=rms"),
        (["train.qk_clip=100", "attention.qk_norm=none", "model.mtp_depth=1"],
         "train.qk_clip does not support model.mtp_depth > 0"),
        (["train.qk_clip=100", "attention.qk_norm=none", "attention.impl=splash"],
         "set attention.impl=blocked or train.qk_clip=0"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config(*overrides)
