"""GRPO's loss options (moe_jax/posttrain/rl/aggregate.py, correction.py, grpo.py, passes.py):
- rl.loss_agg's four reductions (TRL's loss_type grpo, bnpo, dr_grpo, dapo) at token and
  sequence level, with the KL, against float64 numpy and against TRL's own
  `GRPOTrainer._compute_loss` called on the same tensors (a stand-in for the model);
- rl.correction tis / mis per token and per sequence: the weights, the drift metrics, the
  loss (numpy and TRL, fed the weights as its importance_sampling_ratio) and its gradient
  (float64 central differences of the numpy loss); with equal log-probs it is none;
- dynamic sampling: the rows of a zero-variance group dropped equal those rows sliced out,
  denominators included (dapo's through `passes.batch_tokens`, against TRL's
  num_items_in_batch / steps_per_generation);
- one trained run (a module fixture: tis + dynamic sampling + dapo, 2 epochs a batch): each
  update's loss numpy's on the log-probs of the params it starts from, the second's weights
  and pi_old the trainer's at the sampler's params (the forward before the passes), and the
  drift metrics and dropped-group fraction numpy's.
Budget: ~25 s on 2 CPU cores (the fixture's two train step compiles most of it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import ConfigError, RLConfig
from moe_jax.posttrain.rl.collect import informative
from moe_jax.posttrain.rl.correction import importance_weights
from moe_jax.posttrain.rl.grpo import clipped_objective, group_advantages
from moe_jax.posttrain.rl.passes import batch_tokens

R, T, MAX_LEN = 8, 9, 12
AGGS = ("grpo", "bnpo", "dr_grpo", "dapo")
# float32 against float64: the sums run over ~50 terms of O(1), so 1e-5 relative
RTOL = 1e-5


def case(seed: int = 0) -> dict:
    """Log-probs with ratios beyond the clip (per token and, a row's shift, per sequence),
    rollout log-probs off the trainer's by ~0.3, ragged completions, advantages."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 1.0, (R, T))
    logp = old + rng.normal(0, 0.3, (R, T)) + rng.normal(0, 0.3, (R, 1))
    mask = (np.arange(T) < rng.integers(2, T + 1, (R, 1))).astype(np.float64)
    return {
        "logp": logp, "old": old, "mask": mask, "adv": rng.normal(0, 1, R),
        "ref": old + rng.normal(0, 0.2, (R, T)), "rollout": old + rng.normal(0, 0.3, (R, T)),
    }  # fmt: skip


def rl_config(**kw) -> RLConfig:
    return RLConfig(clip_eps=0.2, clip_eps_high=0.28, max_new_tokens=MAX_LEN, **kw)


def reference_loss(c, agg, level, w=None, beta=0.0, n_batch=None, clip=(0.8, 1.28)):
    """The loss one token at a time in float64: the clipped term (times the importance weight
    w, [R, T] or [R, 1]) plus beta x k3, reduced as rl.loss_agg says."""
    R, T = c["logp"].shape
    terms = np.zeros((R, T))
    for r in range(R):
        toks = [t for t in range(T) if c["mask"][r, t]]
        seq = np.exp(np.mean([c["logp"][r, t] - c["old"][r, t] for t in toks])) if toks else 0
        for t in toks:
            rho = seq if level == "sequence" else np.exp(c["logp"][r, t] - c["old"][r, t])
            a = c["adv"][r]
            term = -min(rho * a, min(max(rho, clip[0]), clip[1]) * a)
            if w is not None:
                term *= np.broadcast_to(w, (R, T))[r, t]
            d = c["ref"][r, t] - c["logp"][r, t]
            terms[r, t] = term + beta * (np.exp(d) - d - 1)
    rows = [r for r in range(R) if c["mask"][r].sum()]
    return {
        "grpo": lambda: np.mean([terms[r].sum() / c["mask"][r].sum() for r in rows]),
        "bnpo": lambda: terms.sum() / c["mask"].sum(),
        "dr_grpo": lambda: terms.sum() / (len(rows) * MAX_LEN),
        "dapo": lambda: terms.sum() / n_batch,
    }[agg]()


def trl_loss(c, agg, level, w=None, beta=0.0, n_batch=None, steps_per_generation=1):
    """TRL's GRPOTrainer._compute_loss on the same tensors (float64), the model's log-probs
    handed in by a stand-in; `w` its importance_sampling_ratio (the vLLM correction). None
    where TRL is not installed (the newest leg), which then checks against numpy alone."""
    if importlib.util.find_spec("trl") is None:
        return None
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)
    logp = t(c["logp"])
    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=beta, loss_type=agg, epsilon_low=0.2, epsilon_high=0.28, use_vllm=w is not None,
        vllm_importance_sampling_correction=w is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN,
        accelerator=accelerator, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None,
                             steps_per_generation=steps_per_generation),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros((R, 0), dtype=torch.long), "prompt_mask": torch.zeros((R, 0)),
        "completion_ids": torch.zeros((R, T), dtype=torch.long),
        "completion_mask": t(c["mask"]), "advantages": t(c["adv"]),
        "old_per_token_logps": t(c["old"]), "ref_per_token_logps": t(c["ref"]),
        "num_items_in_batch": t(n_batch if n_batch is not None else c["mask"].sum()),
    }  # fmt: skip
    if w is not None:
        inputs["importance_sampling_ratio"] = t(w)
    return GRPOTrainer._compute_loss(trainer, None, inputs).item()


def ours(c, rl, w=None, n_batch=None):
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    loss, metrics = clipped_objective(
        f32(c["logp"]), f32(c["old"]), f32(c["adv"]), f32(c["mask"]), rl, f32(c["ref"]),
        None if w is None else f32(w), None if n_batch is None else f32(n_batch),
    )  # fmt: skip
    return float(loss)


def loss_of_logp(c, rl, w=None):
    """The loss as a function of the trainer's log-probs (no KL), for its gradient."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    fixed = (f32(c["old"]), f32(c["adv"]), f32(c["mask"]), rl, None, w)
    return lambda logp: clipped_objective(logp, *fixed)[0]


def test_loss_aggregation_equals_numpy_and_trl():
    """Each rl.loss_agg at each rl.level, with the KL (beta 0.05; TRL's bias correction of the
    KL off, which ours has not): numpy float64 and TRL to 1e-5. dapo's normaliser a batch's
    sampled tokens larger than this update's (as with rl.minibatches)."""
    c = case()
    n_batch = 1.7 * c["mask"].sum()
    for agg in AGGS:
        for level in ("token", "sequence"):
            rl = rl_config(loss_agg=agg, level=level, kl_beta=0.05)
            got = ours(c, rl, n_batch=n_batch)
            want = reference_loss(c, agg, level, beta=0.05, n_batch=n_batch)
            np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"{agg} {level}")
            if (trl := trl_loss(c, agg, level, beta=0.05, n_batch=n_batch)) is not None:
                np.testing.assert_allclose(got, trl, rtol=RTOL, err_msg=f"TRL {agg} {level}")
    # the reductions differ on ragged completions (else the test could not tell them apart)
    values = [reference_loss(c, a, "token", n_batch=n_batch) for a in AGGS]
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]) > 1e-3


def reference_weights(c, correction, level, lo, hi):
    """TRL's importance_sampling_ratio (its *_truncate / *_mask modes) in float64."""
    d = (c["old"] - c["rollout"]) * c["mask"]  # c["old"]: the trainer's at the sampler's params
    ratio = np.exp(d.sum(axis=1, keepdims=True) if level == "sequence" else d)
    if correction == "tis":
        return np.clip(ratio, lo, hi), ratio
    return np.where((ratio < lo) | (ratio > hi), 0.0, ratio), ratio


def fd_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_mismatch_correction_equals_numpy_and_trl_with_its_gradient(correction):
    """rl.correction per token and per sequence: the weights TRL's formulas give (float64),
    the loss (bnpo and grpo) numpy's and TRL's with those weights, the gradient d loss /
    d logp float64 central differences' of the numpy loss (1e-4: float32 against a 1e-6 step),
    the drift metrics numpy's; with the rollout's log-probs equal to the trainer's, the loss
    and gradient those of rl.correction=none and every weight 1."""
    c = case(1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    for level, lo, hi in (("token", 0.0, 1.2), ("sequence", 0.5, 1.5)):
        rl = rl_config(correction=correction, correction_level=level, correction_min=lo,
                       correction_max=hi)  # fmt: skip
        w, metrics = importance_weights(f32(c["old"]), f32(c["rollout"]), f32(c["mask"]), rl)
        want_w, ratio = reference_weights(c, correction, level, lo, hi)
        np.testing.assert_allclose(np.asarray(w) * (c["mask"] if level == "token" else 1),
                                   want_w * (c["mask"] if level == "token" else 1),
                                   rtol=1e-5, atol=1e-7)  # fmt: skip
        units = c["mask"] if level == "token" else np.ones((R, 1))
        outside = ((ratio < lo) | (ratio > hi)) * units
        assert 0 < outside.sum() < units.sum()  # the case truncates (masks) some, not all
        d = (c["old"] - c["rollout"]) * c["mask"]
        shown = want_w * units
        drift = {
            "logp_diff_mean": np.abs(d).sum() / c["mask"].sum(),
            "logp_diff_max": np.abs(d).max(),
            "mismatch_kl": ((np.exp(d) - d - 1) * c["mask"]).sum() / c["mask"].sum(),
            "mismatch_frac": outside.sum() / units.sum(),
            "is_ess": shown.sum() ** 2 / (units.sum() * (shown**2).sum()),
        }
        for k, v in drift.items():
            np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, err_msg=k)
        for agg in ("bnpo", "grpo"):
            r = dataclasses.replace(rl, loss_agg=agg)
            got = ours(c, r, want_w)
            np.testing.assert_allclose(got, reference_loss(c, agg, "token", want_w), rtol=RTOL)
            if (trl := trl_loss(c, agg, "token", want_w)) is not None:
                np.testing.assert_allclose(got, trl, rtol=RTOL)
            grad = jax.grad(loss_of_logp(c, r, f32(want_w)))(f32(c["logp"]))
            numpy_loss = lambda lp, a=agg, w=want_w: reference_loss(c | {"logp": lp}, a, "token", w)
            want = fd_grad(numpy_loss, c["logp"])
            np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-6)
        # no mismatch: every weight 1, the loss and gradient without a correction
        w1, m1 = importance_weights(f32(c["old"]), f32(c["old"]), f32(c["mask"]), rl)
        assert np.all(np.asarray(w1) == 1.0) and float(m1["mismatch_frac"]) == 0.0
        assert float(m1["is_ess"]) == pytest.approx(1.0) and float(m1["mismatch_kl"]) == 0.0
        (a, ga), (b, gb) = (
            jax.value_and_grad(loss_of_logp(c, rl, w))(f32(c["logp"])) for w in (w1, None)
        )
        assert float(a) == float(b)
        np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))


def test_dynamic_sampling_drops_zero_variance_groups_with_their_denominators():
    """`informative` keeps a group whose rewards differ and drops one all alike; its rows
    masked out give each reduction the loss of the batch without them (dapo's normaliser from
    `passes.batch_tokens`: the kept tokens of the whole batch / rl.minibatches, TRL's
    num_items_in_batch over steps_per_generation splits)."""
    rewards_PG = np.array([[1.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(informative(rewards_PG), [1.0, 0.0])
    assert np.all(group_advantages(rewards_PG)[1] == 0)
    c = case(2)
    keep = np.repeat([1.0, 0.0], 4)  # rows 4-7: the group all alike
    kept = {k: v[:4] for k, v in c.items()}
    masked = c | {"mask": c["mask"] * keep[:, None]}
    rl = rl_config(dynamic_sampling=True, minibatches=2, kl_beta=0.05)
    batch = {"mask": np.pad(c["mask"], ((0, 0), (1, 0))), "keep": keep}  # targets at [:, 1:]
    n_batch = float(batch_tokens(batch, rl))
    np.testing.assert_allclose(n_batch, kept["mask"].sum() / 2)
    for agg in AGGS:
        got = ours(masked, dataclasses.replace(rl, loss_agg=agg), n_batch=n_batch)
        want = reference_loss(kept, agg, "token", beta=0.05, n_batch=n_batch)
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=agg)
        if agg == "dapo":  # TRL: the whole batch's kept tokens over 2 steps a generation
            trl = trl_loss(masked, agg, "token", beta=0.05, n_batch=kept["mask"].sum(),
                           steps_per_generation=2)  # fmt: skip
            if trl is not None:
                np.testing.assert_allclose(got, trl, rtol=RTOL)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"loss_agg": "sum"}, "rl.loss_agg='sum' is not supported"),
        ({"correction": "is"}, "rl.correction='is' is not supported"),
        ({"correction_level": "word"}, "rl.correction_level"),
        ({"correction_min": 2.0}, "range is empty"),
    ],
)
def test_bad_loss_options_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        RLConfig(**kw).check()


@pytest.fixture(scope="module")
def trained():
    """Two epochs of updates on one batch (rl.correction=tis with cap 1.2, dynamic sampling,
    loss_agg=dapo, clip_eps 0.05, a constant LR), and the same config's single update: the
    batch the model's own (tests/test_grpo_updates.py) with the rollout log-probs moved off
    the trainer's by N(0, 0.3) and group 0's rewards all equal."""
    from moe_jax.train.step import init_state, make_optimizer, make_train_step
    from tests.test_grpo_updates import S, config, logps, rollouts

    opts = ["train.warmup_steps=0", "train.min_lr_ratio=1.0", "rl.clip_eps=0.05",
            "rl.correction=tis", "rl.correction_max=1.2", "rl.dynamic_sampling=true",
            "rl.loss_agg=dapo"]  # fmt: skip
    runs = {}
    for epochs in (1, 2):
        cfg = config(*opts, f"rl.epochs={epochs}")
        tx = make_optimizer(cfg.train, "float32", cfg.rl)
        graphdef, state = init_state(cfg, tx)
        if not runs:
            batch = rollouts(graphdef, state["params"], cfg, seed=4)
            rng = np.random.default_rng(4)
            batch["old_logp"][:, 1:] += rng.normal(0, 0.3, (R, S - 1)) * batch["mask"][:, 1:]
            rewards_PG = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.5, 0.0]])
            batch |= {
                "rewards": rewards_PG.reshape(-1).astype(np.float32),
                "adv": group_advantages(rewards_PG).reshape(-1),
                "keep": np.repeat(informative(rewards_PG), 4),
            }
            lp0 = logps(graphdef, state["params"], batch)
        state, metrics = make_train_step(cfg, graphdef, tx)(state, batch)
        runs[epochs] = (jax.device_get(metrics), state["params"])
    lp1 = logps(graphdef, runs[1][1], batch)
    return batch, lp0, lp1, runs[1][0], runs[2][0]


def test_a_trained_step_corrects_drops_and_logs_the_drift(trained):
    """The fixture's run against numpy: the single update's loss that of the trainer's
    log-probs at the start (ratio 1, weights min(exp(lp0 - rollout), 1.2), the equal group's
    rows out of the loss and of dapo's token count); the two-epoch step's mean loss that and
    the second update's, whose pi_old and weights stay lp0's (the forward before the passes),
    not its own; the drift metrics of lp0 against the rollout's log-probs over every sampled
    token; the dropped groups' fraction. 1e-4: the params after one update come from two
    programs (the one-update step's and the passes' scan), equal to float rounding."""
    batch, lp0, lp1, one, two = trained
    mask, rollout = np.float64(batch["mask"][:, 1:]), np.float64(batch["old_logp"][:, 1:])
    kept = mask * batch["keep"][:, None]
    d = (lp0 - rollout) * mask
    w = np.clip(np.exp(d), 0.0, 1.2)
    c = {"logp": lp0, "old": lp0, "mask": kept, "adv": batch["adv"], "ref": lp0}
    loss = lambda c: reference_loss(c, "dapo", "token", w, n_batch=kept.sum(), clip=(0.95, 1.05))
    first, second = loss(c), loss(c | {"logp": lp1})
    own = loss(c | {"logp": lp1, "old": lp1})  # had the second update taken its own pi_old
    assert abs(second - own) > 1e-3
    np.testing.assert_allclose(one["loss"] - one["aux_loss"], first, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        two["loss"] - two["aux_loss"], (first + second) / 2, rtol=1e-4, atol=1e-6
    )
    assert one["clip_frac"] == 0 and two["clip_frac"] > 0  # the second update clips
    outside = (np.exp(d) > 1.2) * mask
    drift = {
        "logp_diff_mean": np.abs(d).sum() / mask.sum(),
        "logp_diff_max": np.abs(d).max(),
        "mismatch_kl": ((np.exp(d) - d - 1) * mask).sum() / mask.sum(),
        "mismatch_frac": outside.sum() / mask.sum(),
        "is_ess": (w * mask).sum() ** 2 / (mask.sum() * (w**2 * mask).sum()),
    }
    assert 0 < drift["mismatch_frac"] < 1
    for k, v in drift.items():
        for m in (one, two):  # the first update's, in both
            np.testing.assert_allclose(m[k], v, rtol=1e-4, err_msg=k)
    assert one["zero_var_groups"] == two["zero_var_groups"] == 0.5


def test_rollouts_mark_the_groups_dynamic_sampling_keeps(tmp_path):
    """`Rollouts` with rl.dynamic_sampling: "keep" 1 on the rows of a group whose rewards
    differ, 0 on those of a group all alike (a stand-in draw: prompt 0's completions rewarded
    1, 0, 1, 1; prompt 1's all 0.5); without it no "keep" (the batch as before)."""
    from moe_jax.data.prompts import load_prompts
    from moe_jax.inference.sampling import Generation
    from moe_jax.posttrain.rl.collect import Rollouts
    from tests.test_grpo import grpo_config, sums, write_jsonl

    path = write_jsonl(tmp_path / "p.jsonl", sums(8))
    G, N = 4, 6

    def draw(params, index, seed):
        prompts = [[5, 6, 7]] * (len(index) * G)
        gen = Generation(np.ones((len(prompts), N), np.int32), np.full(len(prompts), 2), 1,
                         routes=np.zeros((1, len(prompts), 16 + N, 2), np.int32),
                         logprobs=np.zeros((len(prompts), N), np.float32))  # fmt: skip
        return prompts, gen, np.array([1.0, 0.0, 1.0, 1.0] + [0.5] * G)

    for dynamic in (True, False):
        cfg = grpo_config(path, f"rl.dynamic_sampling={str(dynamic).lower()}")
        rollouts = Rollouts(cfg, None, load_prompts(cfg))
        rollouts._draw = draw
        rows = rollouts({"params": None}, {"index": np.array([0, 1])}, step=0)
        assert ("keep" in rows) == dynamic
        if dynamic:
            np.testing.assert_array_equal(rows["keep"], [1.0] * G + [0.0] * G)
        np.testing.assert_array_equal(rows["adv"][G:], 0.0)
