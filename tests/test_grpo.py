"""GRPO (moe_jax/posttrain/rl/): advantages and the clipped objective against hand-written numpy
(token level, GRPO; sequence level, GSPO; the k3 KL), the rollout rows the trainer gets from
the sampler, config and data refused in one line (rl.max_prompt_len's bound too), and a
GRPO run stopped and resumed equal to an uninterrupted one (rollouts drawn from the state's
params, with routing replay; a full fine-tune's KL reference and 2 x 2 passes a step, the
stop asked for mid-batch). The train step on fixed batches: tests/test_grpo_updates.py.
Budget: ~45 s of CPU on 2 cores (the resume test's three train() calls most of it).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import ConfigError, RLConfig
from moe_jax.posttrain.rl.grpo import clipped_objective, group_advantages
from moe_jax.tokenizer import DataError
from tests.helpers import tiny_config


def grpo_config(path, *overrides):
    return tiny_config(
        "train.objective=grpo", "data.sft=prompts", f"data.path={path}",
        "rl.rewards=[tests.grpo_rewards:exact,tests.grpo_rewards:digits]",
        "rl.reward_weights=[1.0,0.5]", "rl.group_size=4", "rl.max_new_tokens=6",
        "model.n_layers=2", "attention.nope_interval=0", "moe.capacity_factor=0",
        "train.seq_len=16", "train.batch_size=2", "data.val_fraction=0.25",
        "train.warmup_steps=1", *overrides,
    )  # fmt: skip


def sums(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rng.integers(0, 10, (n, 2))]


def write_jsonl(path, values) -> str:
    path.write_text("".join(json.dumps(v) + "\n" for v in values))
    return str(path)


def test_group_advantages_equal_a_hand_written_reference():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 0.0]])
    for scale in (True, False):
        want = np.zeros_like(rewards)
        for p, group in enumerate(rewards):
            mean = sum(group) / len(group)
            std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5
            for g, r in enumerate(group):
                want[p, g] = (r - mean) / (std + 1e-4) if scale else r - mean
        np.testing.assert_allclose(group_advantages(rewards, scale), want, rtol=1e-6)
    assert np.all(group_advantages(rewards)[1] == 0)  # a group all alike teaches nothing


def reference_objective(logp, old, adv, mask, eps_lo, eps_hi, level, ref=None, beta=0.0):
    """The loss and clip fraction, one token (or sequence) at a time."""
    terms, clipped_n, n_tok = [], 0, mask.sum()
    for r in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[r, t]]
        if level == "sequence":
            if not toks:
                continue
            ratios = [np.exp(np.mean([logp[r, t] - old[r, t] for t in toks]))]
        else:
            ratios = [np.exp(logp[r, t] - old[r, t]) for t in toks]
        for rho in ratios:
            a = adv[r]
            un, cl = rho * a, min(max(rho, 1 - eps_lo), 1 + eps_hi) * a
            terms.append(-min(un, cl))
            clipped_n += cl < un
    loss, frac = sum(terms) / len(terms), clipped_n / len(terms)
    if ref is not None:
        kl = sum(
            np.exp(ref[r, t] - logp[r, t]) - (ref[r, t] - logp[r, t]) - 1
            for r in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[r, t]
        ) / n_tok  # fmt: skip
        loss += beta * kl
    return loss, frac


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps_high", [0.0, 0.28])
@pytest.mark.parametrize("kl", [0.0, 0.05])
def test_clipped_objective_equals_a_hand_written_reference(level, eps_high, kl):
    rng = np.random.default_rng(0)
    R, T = 6, 7
    old = rng.normal(-2.0, 1.0, (R, T)).astype(np.float32)
    # ratios beyond the clip, per token and (a row's shift) per sequence
    logp = (old + rng.normal(0, 0.3, (R, T)) + rng.normal(0, 0.3, (R, 1))).astype(np.float32)
    ref = (old + rng.normal(0, 0.2, (R, T))).astype(np.float32)
    adv = rng.normal(0, 1, R).astype(np.float32)
    mask = (rng.random((R, T)) < 0.7).astype(np.float32)
    mask[3] = 0  # a completion without tokens counts in neither mean
    rl = RLConfig(clip_eps=0.2, clip_eps_high=eps_high, level=level, kl_beta=kl)
    loss, metrics = clipped_objective(
        jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), rl,
        jnp.asarray(ref) if kl else None,
    )  # fmt: skip
    want, frac = reference_objective(
        logp, old, adv, mask, 0.2, eps_high or 0.2, level, ref if kl else None, kl
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_frac"]), frac, rtol=1e-6)
    assert 0 < frac < 1  # the case clips some and not others


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.sft=none"], "set both or neither"),
        (["rl.rewards=[]", "rl.reward_weights=[]"], "needs rl.rewards"),
        (["rl.rewards=[tests.grpo_rewards]"], "as pkg.module:function"),
        (["rl.reward_weights=[1.0]"], "1 weights for 2 rl.rewards"),
        (["rl.minibatches=3"], "does not divide a batch's 8 rollouts"),
        (["rl.epochs=0"], "rl.epochs must be positive"),
        (["rl.group_size=1"], "sample at least 2"),
        (["rl.level=word"], "rl.level"),
        (["train.grad_accum=2"], "train.grad_accum=1"),
    ],
)
def test_bad_grpo_config_is_refused(tmp_path, overrides, message):
    path = write_jsonl(tmp_path / "p.jsonl", sums(4))
    with pytest.raises(ConfigError, match=message):
        grpo_config(path, *overrides)


@pytest.mark.parametrize(
    ("line", "message", "error"),
    [
        ('{"answer": "3"}', "line 2 has no 'prompt' field", DataError),
        ('{"prompt": 3}', "line 2 has a 'prompt' that is neither", DataError),
        ('{"prompt": ""}', "line 2 has an empty prompt", DataError),
        ('{"prompt": "' + "x" * 600 + '"}', "line 2: its prompt is 600 tokens", DataError),
        ('{"prompt": "1+1="', "line 2 is not JSON", DataError),
    ],
)
def test_bad_prompts_are_refused_by_line(tmp_path, line, message, error):
    from moe_jax.data.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(sums(1)[0]) + "\n" + line + "\n")
    with pytest.raises(error, match=message):
        load_prompts(grpo_config(str(path)))


def test_max_prompt_len_fixes_the_rows_width_and_refuses_longer_prompts(tmp_path):
    """rl.max_prompt_len: rows are its sampler bucket + max_new_tokens wide whatever the
    prompts (what aot compiles); a longer prompt is refused by line."""
    from moe_jax.data.prompts import load_prompts

    path = write_jsonl(tmp_path / "p.jsonl", sums(4))  # 4-character prompts
    assert load_prompts(grpo_config(path)).bucket == 16  # the data's: the smallest bucket
    assert load_prompts(grpo_config(path, "rl.max_prompt_len=20")).bucket == 32
    path = write_jsonl(tmp_path / "q.jsonl", [*sums(2), {"prompt": "1+" * 12 + "1="}])
    with pytest.raises(DataError, match="line 3: its prompt is 26 tokens; .* rl.max_prompt_len"):
        load_prompts(grpo_config(path, "rl.max_prompt_len=20"))


def test_a_reward_that_does_not_import_or_miscounts_is_named(tmp_path):
    from moe_jax.data.prompts import load_prompts, load_rewards
    from moe_jax.posttrain.rl.collect import RewardError, score

    path = write_jsonl(tmp_path / "p.jsonl", sums(4))
    with pytest.raises(ConfigError, match="cannot import tests.grpo_rewards:nothing"):
        load_prompts(
            grpo_config(path, "rl.rewards=[tests.grpo_rewards:nothing]", "rl.reward_weights=[]")
        )
    bad = load_rewards(
        grpo_config(path, "rl.rewards=[tests.grpo_rewards:too_few]", "rl.reward_weights=[]")
    )
    with pytest.raises(RewardError, match="too_few must return one number per completion"):
        score(bad, ["a", "b"], ["1", "2"], {})
    ok = load_rewards(grpo_config(path))
    total, means = score(ok, ["1+2=", "1+1="], ["3", "x2"], {"answer": ["3", "3"]})
    np.testing.assert_allclose(total, [1.0 + 0.5, 0.5 * 0.5])


def test_a_grpo_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    """train.py with train.objective=grpo on a data x expert x tensor mesh, a full fine-tune
    with its KL to a frozen reference (in the optimizer state) and 2 epochs x 2 minibatches
    of updates a step: 4 straight steps; then back to step 2's checkpoint (train.resume_step:
    the prompt position, the params the rollouts are drawn from, the optimizer state and the
    reference) with SIGTERM sent while step 3's rollouts are scored, which stops the run at
    the batch boundary after step 3's four updates (its checkpoint); resumed from it, step 4
    ends bit for bit where the straight run's did (each draw seeded by its step). The GRPO
    metrics reach metrics.jsonl; the sampler's and the trainer's log-probs agree on the first
    update (routing replayed through the expert exchange)."""
    import signal

    from flax import nnx

    from moe_jax.inference.load import load_run
    from moe_jax.train.loop import train
    from tests import grpo_rewards

    path = write_jsonl(tmp_path / "p.jsonl", sums(12))
    cfg = lambda run, *more: grpo_config(
        path, f"run_dir={run}", "train.steps=4", "train.log_every=1", "train.eval_every=100",
        "train.eval_batches=1", "checkpoint.every=2", "train.trackers=[]",
        "train.peak_flops=1e11", "train.lr=1e-2", "train.batch_size=4", "mesh.data=2",
        "mesh.expert=2", "mesh.tensor=2", "rl.kl_beta=0.05", "rl.epochs=2",
        "rl.minibatches=2",
        "rl.rewards=[tests.grpo_rewards:exact_or_stop,tests.grpo_rewards:digits]", *more,
    )  # fmt: skip
    params = lambda: dict(nnx.to_flat_state(nnx.state(load_run(run, 4)[1], nnx.Param)))
    run = tmp_path / "run"
    train(cfg(run))  # 4 straight steps, saving at 2 and 4
    straight = params()
    monkeypatch.setattr(grpo_rewards, "calls", 0)
    monkeypatch.setenv("GRPO_SIGTERM_AT_CALL", "1")  # the first step this call runs: 3
    stopped = train(cfg(run, "train.resume_step=2"))
    assert (stopped.step, stopped.stopped_by) == (3, signal.SIGTERM)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [
        2, 3,
    ]  # fmt: skip
    monkeypatch.delenv("GRPO_SIGTERM_AT_CALL")
    assert train(cfg(run)).step == 4  # resumed from 3
    resumed = params()
    for p, v in straight.items():
        np.testing.assert_array_equal(resumed[p][...], v[...], err_msg=str(p))
    records = (run / "metrics.jsonl").read_text().splitlines()
    trains = [r for r in map(json.loads, records) if r["kind"] == "train"]
    assert {"reward_mean", "reward_std", "kl", "clip_frac", "logp_diff_max"} <= set(trains[-1])
    for r in trains:
        assert r["expert_agreement"] == 1.0 and r["logp_diff_max"] < 1e-4
        assert r["completion_len"] > 0
    assert trains[-1]["kl"] > 1e-4  # the policy leaves its reference
    assert max(r["clip_frac"] for r in trains) > 0  # later updates' ratios leave the range


@pytest.mark.parametrize("eval_batches, want", [(8, 10.0), (1, 9.5)])
def test_the_held_out_reward_is_the_validation_prompts_mean(tmp_path, eval_batches, want):
    """Rollouts.held_out (GRPO's eval: train/evaluation.py): rl.group_size completions of
    each validation prompt (12 prompts, 9 train: prompts 9, 10, 11), drawn batch_size = 2
    prompts at a time, as a step's (the last batch filled with a repeat, left out of the
    mean), at most train.eval_batches batches, all from the run's seed. A stand-in draw
    rewards prompt i's completions with i."""
    from moe_jax.data.prompts import load_prompts
    from moe_jax.posttrain.rl.collect import Rollouts

    path = write_jsonl(tmp_path / "p.jsonl", sums(12))
    cfg = grpo_config(path, f"train.eval_batches={eval_batches}", "seed=5")
    data = load_prompts(cfg)
    assert (data.n_train, len(data.ids), cfg.rl.group_size) == (9, 12, 4)
    rollouts, calls = Rollouts(cfg, None, data), []

    def draw(params, index, seed):
        calls.append((list(index), seed))
        return None, None, np.repeat(np.asarray(index, np.float64), cfg.rl.group_size)

    rollouts._draw = draw
    assert rollouts.held_out({"params": None}) == want
    assert calls == [([9, 10], 5), ([11, 11], 5)][:eval_batches]
