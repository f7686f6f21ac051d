"""Training DeepSeek sparse attention's indexer (train.indexer_stage, DeepSeek-V3.2's two
stages): the indexer's KL loss and its gradient against a float64 reference written out
from the formulas, and which weights each loss trains (the warm-up: the indexer alone, the
attention dense; the sparse stage: the LM loss the model, the KL the indexer).

The tiny model is tests/test_dsa.py's (3 MLA layers: dense, own indexer, shared selection).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.model import Transformer
from moe_jax.model.sparse_attention import Indexer, indexer_kl, select
from moe_jax.train.step import decay_mask, loss_fn
from tests.helpers import tiny_config
from tests.test_dsa import DSA, _randomized

T = 12


def _indexer_inputs(seed: int):
    """An indexer of the tiny config with random weights (its LayerNorm's too) and random
    inputs: x [1, T, D], the query latent [1, T, r], the main attention's q and k
    [1, T, H, Q]."""
    cfg = tiny_config(*DSA)
    indexer = Indexer(cfg, jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    for name in ("wq_b", "w_key", "k_norm_scale", "k_norm_bias", "weights_proj"):
        var = getattr(indexer, name)
        var[...] = jnp.asarray((name == "k_norm_scale") + 0.5 * rng.standard_normal(var.shape))
    a, D = cfg.attention, cfg.model.d_model
    Q = a.qk_nope_head_dim + a.qk_rope_head_dim
    shapes = [(1, T, D), (1, T, a.q_lora_rank), (1, T, a.n_heads, Q), (1, T, a.n_heads, Q)]
    return cfg, indexer, [rng.standard_normal(s) for s in shapes]


def _reference_kl(w: dict, x, q_r, q, k, scale, set_TS, theta: float, P: int):
    """The indexer loss in float64, written out from the formulas (`sparse_attention` doc),
    one query row at a time: rotate-half RoPE on the first P dims, LayerNorm, ReLU scores
    weighted per head, softmax over the set, the heads' mean attention as the target."""
    H, I = w["weights_proj"].shape[1], w["w_key"].shape[1]
    pos = jnp.arange(T, dtype=jnp.float64)
    angle = pos[:, None] / theta ** (jnp.arange(0, P, 2, dtype=jnp.float64) / P)  # [T, P/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)

    def rope(a):  # [T, ..., I]: the first P dims as halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        c = cos.reshape(T, *([1] * (a.ndim - 2)), P // 2)
        s_ = sin.reshape(c.shape)
        x1, x2 = a[..., : P // 2], a[..., P // 2 : P]
        return jnp.concatenate([x1 * c - x2 * s_, x2 * c + x1 * s_, a[..., P:]], axis=-1)

    qi = rope(jnp.einsum("tr,rhi->thi", q_r[0], w["wq_b"]))
    kl_ = x[0] @ w["w_key"]
    kl_ = (kl_ - kl_.mean(-1, keepdims=True)) / jnp.sqrt(kl_.var(-1, keepdims=True) + 1e-6)
    ki = rope(kl_ * w["k_norm_scale"] + w["k_norm_bias"])
    weights = x[0] @ w["weights_proj"] * H**-0.5
    total = 0.0
    for t in range(T):
        keys = np.flatnonzero(set_TS[t])
        index = sum(weights[t, h] * jax.nn.relu(ki[keys] @ qi[t, h] * I**-0.5) for h in range(H))
        log_q = index - jax.scipy.special.logsumexp(index)
        probs = [jax.nn.softmax(scale * (k[0, keys, h] @ q[0, t, h])) for h in range(q.shape[2])]
        p = sum(probs) / len(probs)
        total = total + jnp.sum(p * (jnp.log(p) - log_q))
    return total / T


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_indexer_loss_and_gradient_equal_a_float64_reference(stage):
    """Over the causal keys (warm-up) or the indexer's top-4 of them (sparse stage): the
    loss within 1e-6 and its gradient in every indexer weight within 1e-4 of the largest
    (float32 against float64)."""
    cfg, indexer, (x, q_r, q, k) = _indexer_inputs(seed=0)
    a = cfg.attention
    scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    causal_TS = np.tril(np.ones((T, T), bool))
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    graphdef, params = nnx.split(indexer)

    def ours(params, set_BTS):
        ix = nnx.merge(graphdef, params)
        k_BSI = ix.keys(f32(x), positions)
        scores = ix.scores(f32(x), f32(q_r), positions, k_BSI)
        return indexer_kl(f32(q), f32(k), scale, scores, set_BTS, jnp.ones((1, T), bool)), scores

    if stage == "warmup":
        set_TS = causal_TS
    else:
        scores = ours(params, jnp.asarray(causal_TS[None]))[1]
        set_TS = np.asarray(select(scores, jnp.asarray(causal_TS[None]), a.index_topk))[0]
        assert set_TS.sum(-1).max() == a.index_topk and (set_TS != causal_TS).any()
    loss, grads = jax.value_and_grad(lambda p: ours(p, jnp.asarray(set_TS[None]))[0])(params)
    names = ("wq_b", "w_key", "k_norm_scale", "k_norm_bias", "weights_proj")
    with jax.enable_x64(True):
        w = {n: jnp.asarray(np.asarray(params[n][...]), jnp.float64) for n in names}
        ref = lambda w: _reference_kl(w, x, q_r, q, k, scale, set_TS, a.rope_theta, 4)
        want, want_grads = jax.jit(jax.value_and_grad(ref))(w)
        want, want_grads = float(want), {n: np.asarray(g) for n, g in want_grads.items()}
    assert want > 0.05
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    for n in names:
        got, g64 = np.asarray(grads[n][...]), want_grads[n]
        assert np.abs(g64).max() > 0
        np.testing.assert_allclose(got, g64, rtol=0, atol=1e-4 * np.abs(g64).max(), err_msg=n)


def _model(stage: str):
    cfg = tiny_config(*DSA, f"train.indexer_stage={stage}", "moe.bias_update_rate=0")
    return cfg, _randomized(Transformer(cfg, rngs=nnx.Rngs(0)))


def _grads(model, loss):
    """d loss(model)/d param for every param, by path."""
    graphdef, params = nnx.split(model)
    grads = jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p))))(params)
    return {path: np.asarray(g[...]) for path, g in nnx.to_flat_state(grads)}


def _batch():
    tokens = np.random.default_rng(6).integers(0, 64, (2, T + 1)).astype(np.int32)
    return {"tokens": jnp.asarray(tokens)}


def test_the_warmup_attends_densely_and_trains_the_indexer_alone():
    """train.indexer_stage=warmup: the logits of dense attention (index_topk at the length),
    the step's loss (LM + KL) differentiating into the indexer's weights only."""
    cfg, m = _model("warmup")
    dense_cfg = dataclasses.replace(
        cfg,
        attention=dataclasses.replace(cfg.attention, index_topk=T),
        train=dataclasses.replace(cfg.train, indexer_stage="none"),
    )
    dense = nnx.merge(nnx.graphdef(Transformer(dense_cfg, rngs=nnx.Rngs(0))), nnx.state(m))
    x = _batch()["tokens"][:, :T]
    run = lambda mm: jax.jit(lambda s: nnx.merge(nnx.graphdef(mm), s)(x)[0])(nnx.state(mm))
    np.testing.assert_allclose(np.asarray(run(m)), np.asarray(run(dense)), rtol=0, atol=1e-6)
    graphdef = nnx.graphdef(m)
    step_loss = lambda mm: loss_fn(nnx.state(mm), graphdef, _batch(), 0.0)[0]
    grads = _grads(m, step_loss)
    indexer = {p for p in grads if "indexer" in p}
    assert indexer and all(np.abs(grads[p]).max() > 0 for p in indexer)
    assert all(not grads[p].any() for p in grads if p not in indexer)
    # and weight decay (which moves a weight without a gradient) for the indexer's alone
    decays = decay_mask(nnx.to_pure_dict(nnx.state(m)), False, indexer_only=True)
    decayed = {path for path, on in jax.tree_util.tree_leaves_with_path(decays) if on}
    assert decayed and all("'indexer'" in jax.tree_util.keystr(path) for path in decayed)


def test_the_sparse_stage_trains_the_model_by_the_lm_loss_and_the_indexer_by_its_kl():
    """train.indexer_stage=sparse: the step's loss differentiates into the indexer exactly as
    its KL alone does (the LM loss reaches it through no path), and the KL into nothing
    else."""
    cfg, m = _model("sparse")
    graphdef = nnx.graphdef(m)
    batch = _batch()
    total = _grads(m, lambda mm: loss_fn(nnx.state(mm), graphdef, batch, 0.0)[0])
    kl = _grads(m, lambda mm: mm(batch["tokens"][:, :T])[1]["indexer_loss"])
    indexer = {p for p in total if "indexer" in p}
    assert indexer and all(np.abs(kl[p]).max() > 0 for p in indexer)
    for p in total:
        if p in indexer:
            np.testing.assert_allclose(total[p], kl[p], rtol=1e-5, atol=1e-8, err_msg=str(p))
        else:
            assert not kl[p].any(), p
    assert any(np.abs(total[p]).max() > 0 for p in total if p not in indexer)
