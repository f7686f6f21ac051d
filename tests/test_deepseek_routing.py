"""DeepSeek-V3's routing (`routing.route`, `limit_to_groups`): group-limited top-k on
hand-built scores, the correction bias choosing but never weighing, the routed scaling
factor; parity with transformers' DeepseekV3TopkRouter; the sequence-wise balance loss by
hand; auxiliary-loss-free balancing (`model/balancing.py`): the bias update rule by hand in
a real train step, no optimizer update of it, and resume equal to an uninterrupted run; and
moe.first_dense_layers (the dense prefix: layer order, decoding with a cache, config errors).
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import Config, ConfigError, load_config
from moe_jax.inference.load import load_run
from moe_jax.interop import deepseek, glm4_moe
from moe_jax.interop.common import HFConfig
from moe_jax.model import Transformer
from moe_jax.model.routing import limit_to_groups, route, route_group
from moe_jax.observe.writers import read_metrics
from moe_jax.train.loop import train
from tests.helpers import forward, forward_cached, tiny_config

DEEPSEEK = [
    "moe.n_experts=8",
    "moe.top_k=2",
    "moe.score=sigmoid",
    "moe.renormalize=true",
    "moe.n_group=4",
    "moe.topk_group=2",
    "moe.correction_bias=true",
    "moe.routed_scaling_factor=2.5",
]


def test_group_limited_routing_on_hand_built_scores():
    """8 experts in 4 groups of 2; the groups' scores are their top-2 sums."""
    choice = jnp.array(
        [
            [0.9, 0.1, 0.5, 0.5, 0.3, 0.2, 0.8, 0.05],  # groups 1.0, 1.0, 0.5, 0.85
            [0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2],  # every group ties at 0.4
        ]
    )
    masked = limit_to_groups(choice, n_group=4, topk_group=2)
    # row 0: groups 0 and 1 (tied at 1.0, both above group 3's 0.85): expert 6 (0.8, the
    # second best alone) is out, and so the top-2 are 0 and one of 2, 3 (tied: the lower)
    np.testing.assert_array_equal(np.isfinite(masked[0]), [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(jax.lax.top_k(masked[0], 2)[1], [0, 2])
    # row 1: tied groups go to the lower ones (lax.top_k), then tied experts likewise
    np.testing.assert_array_equal(np.isfinite(masked[1]), [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(jax.lax.top_k(masked[1], 2)[1], [0, 1])


def test_the_correction_bias_chooses_but_never_weighs():
    cfg = tiny_config(*DEEPSEEK, "moe.n_group=1", "moe.topk_group=1").moe
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    bias = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])  # lifts expert 7 to the top
    w, experts, probs = route(logits, cfg, bias)
    assert sorted(np.asarray(experts[0]).tolist()) == [0, 7]
    s = jax.nn.sigmoid(logits[0])
    picked = np.array([s[int(e)] for e in experts[0]])
    np.testing.assert_allclose(w[0], 2.5 * picked / picked.sum(), rtol=1e-6)  # no bias in it
    np.testing.assert_allclose(probs[0], s / s.sum(), rtol=1e-6)
    # without the bias: the plain top-2 of the logits, same weights' rule
    w0, experts0, _ = route(logits, cfg, jnp.zeros(8))
    np.testing.assert_array_equal(sorted(np.asarray(experts0[0]).tolist()), [0, 1])
    # the bias gets no gradient through the weights
    g = jax.grad(lambda b: jnp.sum(route(logits, cfg, b)[0] ** 2))(bias)
    np.testing.assert_array_equal(g, 0)


def test_router_equals_transformers_deepseek_v3():
    """Random tokens through HF's DeepseekV3TopkRouter and ours from the same weight and
    bias: the same experts (as sets) and weights to 1e-6 (float32, one sigmoid and a sum)."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E, D, T = 16, 24, 64
    hf_cfg = DeepseekV3Config(
        hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(hf_cfg)
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(E, D)).astype(np.float32) * 0.3
    bias = rng.normal(size=E).astype(np.float32) * 0.2
    x = rng.normal(size=(T, D)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, hf_w, hf_e = router(torch.from_numpy(x))
    cfg = tiny_config(*DEEPSEEK, f"moe.n_experts={E}", "moe.top_k=4").moe
    w, e, _ = route(jnp.asarray(x) @ jnp.asarray(weight).T, cfg, jnp.asarray(bias))
    order_hf, order = np.argsort(hf_e.numpy(), -1), np.argsort(np.asarray(e), -1)
    np.testing.assert_array_equal(np.take_along_axis(hf_e.numpy(), order_hf, -1),
                                  np.take_along_axis(np.asarray(e), order, -1))  # fmt: skip
    w_sorted = np.take_along_axis(np.asarray(w), order, -1)
    np.testing.assert_allclose(w_sorted, np.take_along_axis(hf_w.numpy(), order_hf, -1), rtol=1e-6)


def test_sequence_wise_balance_loss_by_hand():
    """f counts each token's top-k of its own scores (the report's eq. 18, Megatron-LM's
    seq_aux_loss), not the choice the correction bias makes: here a bias that sends every
    token to experts 6 and 7."""
    cfg = tiny_config(*DEEPSEEK, "moe.seq_aux_loss_weight=1e-4", "model.d_model=8").moe
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (3, 5, 8))
    router = jax.random.normal(key[1], (8, 8))
    valid = jnp.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
    correction = jnp.array([0, 0, 0, 0, 0, 0, 5.0, 5.0])
    r = route_group(x, router, jnp.zeros(()), cfg, jnp.float32, valid, correction)
    assert np.all(np.sort(np.asarray(r.experts), -1) == [6, 7])
    expected, seqs = 0.0, 0
    for b in range(3):
        n = int(valid[b].sum())
        if n == 0:  # a row of padding is no sequence
            continue
        s = np.asarray(jax.nn.sigmoid(x[b, :n] @ router))
        p = np.mean(s / s.sum(-1, keepdims=True), 0)
        f = np.bincount(np.argsort(-s, -1)[:, :2].ravel(), minlength=8) / (n * 2)
        expected += 8 * float(np.sum(f * p))
        seqs += 1
    assert float(r.sums["seqs"]) == seqs == 2
    np.testing.assert_allclose(float(r.sums["seq_lb"]), expected, rtol=1e-6)


def test_sequence_wise_loss_is_summed_over_the_moe_layers():
    """DeepSeek's code adds every MoE layer's alpha * loss to the total: two MoE layers whose
    routers see only a bias (every token routed alike) give twice one layer's loss, by hand,
    in "seq_lb_loss" and in aux_loss (where the Switch and z losses stay means)."""
    cfg = tiny_config(
        *TRAIN, "moe.seq_aux_loss_weight=1e-4", "moe.router_bias=true", "model.mtp_depth=0"
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    bias = np.array([3.0, 2.0, 0, 0, 0, 0, 0, 0], np.float32)  # groups 0 and 1, experts 0, 1
    for path, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and path[-1] in ("router", "router_bias"):
            value = np.zeros(p[...].shape, np.float32) if path[-1] == "router" else bias
            p[...] = jnp.broadcast_to(jnp.asarray(value), p[...].shape)
    _, aux = forward(model, jnp.ones((2, 8), jnp.int32))
    s = 1 / (1 + np.exp(-bias))
    f = np.array([0.5, 0.5, 0, 0, 0, 0, 0, 0])
    one_layer = 8 * np.sum(f * s / s.sum())  # per sequence, and so their mean
    z = np.log(np.exp(bias).sum()) ** 2
    assert aux["expert_load"].shape == (2, 8)
    np.testing.assert_allclose(aux["seq_lb_loss"], 2 * one_layer, rtol=1e-6)
    np.testing.assert_allclose(aux["lb_loss"], one_layer, rtol=1e-6)  # the same f and P here
    expected = 0.01 * one_layer + 1e-3 * z + 1e-4 * 2 * one_layer
    np.testing.assert_allclose(aux["aux_loss"], expected, rtol=1e-6)


# ----------------------------------------------------------------------------- training

TRAIN = [
    *DEEPSEEK,
    "model.n_layers=3",
    "moe.interleave_step=1",
    "moe.first_dense_layers=1",
    "moe.bias_update_rate=0.01",
    "moe.capacity_factor=0",
    "attention.nope_interval=0",
    "attention.temperature_tuning=false",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.peak_flops=1e11",
    "data.embedded_max_bytes=300000",
    "train.steps=1000",  # runs stop early with stop_at: one compiled train step
    "train.eval_every=1000",
    "checkpoint.every=2",
    "model.mtp_depth=1",  # an MTP layer with a router of its own (the last layer's kind)
    "moe.seq_aux_loss_weight=1e-4",
]


def _biases(run_dir, step):
    state = nnx.state(load_run(run_dir, step)[1], nnx.Param)
    found = {}
    for path, v in nnx.to_flat_state(state):
        if path[-1] == "correction_bias":
            found[path] = np.asarray(v[...])
    return found


def test_bias_moves_by_the_rule_outside_the_optimizer_and_resumes_exactly(tmp_path):
    """Each step moves each MoE layer's bias by rate * sign(mean load - load) of that step's
    expert_load (metrics.jsonl), nothing else moves it; resuming from step 2 to 4 equals the
    straight 4 (a copy of the straight run resumed at its step-2 checkpoint: the checkpoint a
    run stopped at 2 would have saved, one training run fewer)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(*TRAIN, f"run_dir={straight}"), stop_at=4)
    shutil.copytree(straight, resumed)
    train(tiny_config(*TRAIN, f"run_dir={resumed}", "train.resume_step=2"), stop_at=4)

    train_records = [r for r in read_metrics(straight) if r["kind"] == "train"]
    for r in train_records:  # the sequence-wise loss, summed over the 3 MoE layers (MTP's too)
        expected = 0.01 * r["lb_loss"] + 1e-3 * r["z_loss"] + 1e-4 * r["seq_lb_loss"]
        np.testing.assert_allclose(r["aux_loss"], expected, rtol=1e-5)
        assert 2 < r["seq_lb_loss"] < 3 * 8
    loads = {r["step"]: np.array(r["expert_load"]) for r in train_records}
    mtp_loads = {r["step"]: np.array(r["mtp_expert_load"]) for r in train_records}
    assert loads[3].shape == (2, 8)  # layers 2 and 3 are MoE, layer 1 the dense prefix
    assert mtp_loads[3].shape == (1, 8)
    b2, b4 = _biases(straight, 2), _biases(straight, 4)
    # the two MoE layers, stacked in one block, and the MTP layer's, by its own load
    assert sorted(p[0] for p in b4) == ["blocks", "mtp"]
    for path in b4:
        load_of = mtp_loads if path[0] == "mtp" else loads
        expected = b2[path].astype(np.float64)
        for step in (3, 4):
            load = load_of[step]
            expected = expected + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_allclose(b4[path], expected.reshape(b4[path].shape), rtol=0, atol=1e-6)
        assert np.any(b4[path] != 0) and np.any(b4[path] != b2[path])
    for a, b in zip(jax.tree.leaves(_biases(resumed, 4)), jax.tree.leaves(b4), strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- dense prefix


def test_first_dense_layers_come_first_and_decode_with_a_cache():
    cfg = tiny_config(*TRAIN, "model.n_layers=4")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, True, True]
    assert len(model.prefix) == 1 and not model.prefix[0].is_moe
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.model.vocab_size)
    logits, aux = forward(model, tokens)
    assert aux["expert_load"].shape == (3, 8)
    cache = model.init_cache(2, 12)
    assert len(cache["prefix"]) == 1
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    got, _, cache = forward_cached(model, tokens[:, :8], positions[:, :8], cache)
    np.testing.assert_allclose(got, logits[:, :8], rtol=1e-5, atol=1e-5)
    for t in range(8, 12):
        step, _, cache = forward_cached(model, tokens[:, t : t + 1], positions[:, t : t + 1], cache)
        np.testing.assert_allclose(step[:, 0], logits[:, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["moe.n_group=3"], "moe.n_group (3) must divide moe.n_experts (8)"),
        (["moe.topk_group=5"], "moe.topk_group (5) must be at most moe.n_group (4)"),
        (["moe.topk_group=1", "moe.top_k=3"], "moe.top_k (3) picks from the topk_group"),
        (["moe.first_dense_layers=9"], "moe.first_dense_layers (9) exceeds model.n_layers"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_config(*TRAIN, *overrides)


def test_a_correction_bias_balances_by_default_and_training_refuses_none(tmp_path):
    """The correction bias moves at DeepSeek-V3's gamma unless told otherwise: in the configs
    that train loss-free and in an import (over the default base config); a training run
    whose bias neither moves nor has a balance loss stops at once, in one line."""
    assert tiny_config(*DEEPSEEK).moe.bias_update_rate == 0.001
    for name in ("deepseek_v3", "kimi_k2", "glm45_air"):
        moe = load_config(f"configs/{name}.yaml").moe
        assert (moe.correction_bias, moe.bias_update_rate, moe.lb_loss_weight) == (True, 1e-3, 0)
    for family in (deepseek, glm4_moe):
        cfg = family.to_config(HFConfig({}, family.DEFAULTS, family.ARCH), Config())
        assert cfg.moe.correction_bias and cfg.moe.lb_loss_weight == 0
        assert cfg.moe.bias_update_rate == 0.001
        cfg.moe.check_training()
    frozen = ["moe.bias_update_rate=0", "moe.lb_loss_weight=0", "moe.seq_aux_loss_weight=0"]
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"set moe.bias_update_rate=0.001 \(DeepSeek-V3's\)"):
        train(tiny_config(*TRAIN, *frozen, f"run_dir={run_dir}"))
    assert not run_dir.exists()
    tiny_config(*TRAIN, *frozen, "moe.seq_aux_loss_weight=1e-4").moe.check_training()
    tiny_config(*TRAIN, *frozen, "moe.correction_bias=false").moe.check_training()


def test_route_scale_and_defaults_leave_other_families_alone():
    """Without a bias or groups the experts are the logits' top-k, as before: Llama 4's
    sigmoid path and softmax unchanged (scaling 1 multiplies nothing)."""
    cfg = dataclasses.replace(tiny_config().moe, n_experts=8, top_k=2)
    logits = jax.random.normal(jax.random.key(3), (5, 8))
    w, e, _ = route(logits, cfg)
    np.testing.assert_array_equal(e, jax.lax.top_k(logits, 2)[1])
    p = jax.nn.softmax(logits, -1)
    picked = jnp.take_along_axis(p, e, -1)
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    assert math.isclose(cfg.routed_scaling_factor, 1.0)
