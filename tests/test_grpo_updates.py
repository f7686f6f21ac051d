"""GRPO's train step on a fixed batch of rollouts (moe_jax/posttrain/rl/passes.py, grpo.py):
- a full fine-tune's KL to its frozen reference (posttrain/reference_policy.py): 0 at the
  first step, then the k3 of numpy over the two models' log-probs of the sampled tokens,
  both forwards replaying the rollout's experts;
- rl.epochs x rl.minibatches updates in one step: each update's objective and clip fraction
  against numpy on the log-probs of the params that update starts from, those params a
  sequence of one-update steps on the splits in order (rows m, m + M, ...); the clip acts;
- MTP under GRPO: the MTP loss is off and the MTP layers stay bit for bit as they were, the
  rest of the step that of the same model without them.
The batch: prompts and completions of random tokens, the rollout's experts and log-probs the
model's own (as the sampler records them), advantages drawn. Budget: ~15 s on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.posttrain.reference_policy import reference_params
from moe_jax.posttrain.rl.rollouts import token_logps
from moe_jax.train.step import init_state, make_optimizer, make_train_step
from tests.test_grpo import grpo_config, reference_objective

R, S = 8, 12  # rollouts (train.batch_size 2 x rl.group_size 4), positions


def config(*overrides):
    return grpo_config("unused.jsonl", "train.lr=1e-2", *overrides)


@jax.jit
def _logps(params, graphdef, tokens, routes):
    model = nnx.merge(graphdef, params)
    return token_logps(model, tokens, routes=jnp.swapaxes(routes, 0, 1))


def logps(graphdef, params, batch) -> np.ndarray:
    """The model's log-probs of the batch's targets [R, S - 1], its experts replayed."""
    return np.asarray(_logps(params, graphdef, batch["tokens"], batch["routes"])[0])


def rollouts(graphdef, params, cfg, seed: int) -> dict:
    """A batch as `rl.collect` hands it over: prompts of 3-5 tokens, completions up to the
    row's end, the model's own experts and log-probs of the sampled tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (R, S)).astype(np.int32)
    start = rng.integers(3, 6, R)[:, None]
    end = start + rng.integers(3, S - 5, R)[:, None]
    mask = ((np.arange(S) >= start) & (np.arange(S) < end)).astype(np.float32)
    model = nnx.merge(graphdef, params)
    routes = np.asarray(jax.jit(lambda m, t: m(t)[1]["routes"])(model, tokens))  # [L, R, S, K]
    batch = {"tokens": tokens, "mask": mask, "routes": np.swapaxes(routes, 0, 1)}
    old = np.zeros((R, S), np.float32)
    old[:, 1:] = logps(graphdef, params, batch) * mask[:, 1:]
    adv = rng.normal(0, 1, R).astype(np.float32)
    return batch | {"old_logp": old, "adv": adv, "rewards": adv + 0.5}


def copy(tree):
    return jax.tree.map(jnp.copy, tree)  # the step donates its state


def test_kl_to_a_full_fine_tunes_frozen_reference():
    """rl.kl_beta without LoRA: the optimizer state holds a copy of the starting params; the
    first step's KL is 0 (policy = reference), the second's the numpy k3 of the stepped
    policy against the copy, both replaying the rollout's experts; the copy never moves."""
    cfg = config("rl.kl_beta=0.1")
    tx = make_optimizer(cfg.train, "float32", cfg.rl)
    graphdef, state = init_state(cfg, tx)
    start = copy(state["params"])
    step = make_train_step(cfg, graphdef, tx)
    state, first = step(state, rollouts(graphdef, state["params"], cfg, seed=0))
    assert abs(float(first["kl"])) < 1e-12
    policy = copy(state["params"])
    batch = rollouts(graphdef, policy, cfg, seed=1)
    state, second = step(state, batch)
    ref = np.float64(logps(graphdef, start, batch))
    d = (ref - np.float64(logps(graphdef, policy, batch))) * batch["mask"][:, 1:]
    want = np.sum(np.exp(d) - d - 1) / batch["mask"][:, 1:].sum()
    assert want > 1e-4  # the step moved the policy away from its reference
    np.testing.assert_allclose(float(second["kl"]), want, rtol=2e-5)
    kept = reference_params(state["opt_state"])
    jax.tree.map(np.testing.assert_array_equal, kept, start)


def test_epochs_and_minibatches_equal_updates_one_split_at_a_time():
    """rl.epochs=2 x rl.minibatches=2 (4 updates in one step) against 4 one-update steps on
    splits 0, 1, 0, 1 (rows m, m + 2, ...; LR held constant): the same params (1e-6), and
    the step's mean objective and clip fraction those of numpy on each update's log-probs.
    The first update's ratio is 1 (nothing clipped); later ones clip (rl.clip_eps=0.05)."""
    const = ["train.warmup_steps=0", "train.min_lr_ratio=1.0", "rl.clip_eps=0.05"]
    cfg = config(*const, "rl.epochs=2", "rl.minibatches=2")
    tx = make_optimizer(cfg.train, "float32", cfg.rl)
    graphdef, state = init_state(cfg, tx)
    batch = rollouts(graphdef, state["params"], cfg, seed=2)

    one = config(*const)
    one_tx = make_optimizer(one.train, "float32", one.rl)
    one_step = make_train_step(one, graphdef, one_tx)
    seq = copy(state)
    losses, fracs = [], []
    for m in (0, 1, 0, 1):
        rows = {k: v[m::2] for k, v in batch.items()}
        logp = logps(graphdef, seq["params"], rows)
        mask, old = rows["mask"][:, 1:], rows["old_logp"][:, 1:]
        loss, frac = reference_objective(logp, old, rows["adv"], mask, 0.05, 0.05, "token")
        losses.append(loss)
        fracs.append(frac)
        seq, _ = one_step(seq, rows)
    assert fracs[0] == 0 and min(fracs[1:]) > 0.05

    state, metrics = make_train_step(cfg, graphdef, tx)(state, batch)
    got = float(metrics["loss"] - metrics["aux_loss"])
    np.testing.assert_allclose(got, np.mean(losses), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_frac"]), np.mean(fracs), rtol=1e-6)
    assert int(state["opt_state"][1][0].count) == 4  # AdamW's count: four updates
    for (p, a), (_, b) in zip(
        nnx.to_flat_state(state["params"]), nnx.to_flat_state(seq["params"]), strict=True
    ):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-5, atol=1e-6, err_msg=str(p))


def test_mtp_layers_stay_frozen_under_grpo():
    """model.mtp_depth=1 with train.objective=grpo: a step (weight decay on) leaves every MTP
    param bit for bit as it was, and its loss and the other params' update are those of the
    same model without MTP layers."""
    cfg = config("model.mtp_depth=1", "train.weight_decay=0.1")
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=0))
    runs = []
    for c in (cfg, plain):
        tx = make_optimizer(c.train, "float32", c.rl)
        graphdef, state = init_state(c, tx)
        before = dict(nnx.to_flat_state(copy(state["params"])))
        if not runs:
            batch = rollouts(graphdef, state["params"], c, seed=3)
        state, metrics = make_train_step(c, graphdef, tx)(state, batch)
        runs.append((before, dict(nnx.to_flat_state(state["params"])), metrics))
    (before, after, metrics), (_, plain_after, plain_metrics) = runs
    mtp = [p for p in before if p[0] == "mtp"]
    assert len(mtp) > 5
    for p in mtp:
        np.testing.assert_array_equal(after[p][...], before[p][...], err_msg=str(p))
    np.testing.assert_allclose(float(metrics["loss"]), float(plain_metrics["loss"]), rtol=1e-6)
    assert "mtp_ce" not in metrics
    moved = 0
    for p, v in plain_after.items():
        np.testing.assert_allclose(after[p][...], v[...], rtol=1e-6, atol=1e-7, err_msg=str(p))
        moved += not np.array_equal(v[...], before[p][...])
    assert moved > 5
