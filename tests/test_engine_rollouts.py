"""GRPO's rollouts on the generation engine (issue 53): the engine's record (each position's
experts, each sampled token's log-prob) against `Sampler.generate(record=True)`, through a
preemption; the training forward replaying the engine's rows gives its log-probs; G samples
of one prompt submitted together prefill it once and share its pages; a GRPO run drawing
through the engine (rl.rollout_engine=true).

Routes compare exactly and log-probs within 1e-5: the engine's chunked prefill and paged
attention sum in another order than the sampler's (~1e-6 apart), and the model's init_std 0.05
spreads the router's logits far beyond that (as tests/test_engine.py's tokens).
Budget: ~40 s on 2 loaded CPU cores (the GRPO run, its train step compiled, ~16 s of it).
"""

import numpy as np
import pytest
from flax import nnx

from moe_jax.inference.engine import Engine, EngineError, SamplingParams
from moe_jax.posttrain.rl.rollouts import rollout_rows, token_logps
from tests.helpers import assert_same_rollout_rows, tiny_config
from tests.test_engine import N_NEW, SIZES, prompts_of, sampler_of

LENGTHS = (5, 11, 30, 19, 3, 40)  # 40: three prefill chunks of 16; SIZES' pool preempts


@pytest.fixture(scope="module")
def sampler():
    return sampler_of("moe.top_k=2")


def test_recorded_routes_and_logprobs_equal_the_samplers_through_a_preemption(sampler):
    prompts = prompts_of(LENGTHS)
    want = sampler.generate(prompts, N_NEW, temperature=0, record=True)
    engine = Engine(sampler, record=True, **SIZES)
    got = engine.generate_recorded(prompts, [SamplingParams(max_tokens=N_NEW)] * len(prompts))
    assert engine.preempted > 0 and engine.pool.in_use() == 0 and not engine.records
    assert got.sequences() == want.sequences()
    width = want.routes.shape[2]
    ours, theirs = rollout_rows(prompts, got, width), rollout_rows(prompts, want, width)
    np.testing.assert_array_equal(ours["tokens"], theirs["tokens"])
    np.testing.assert_array_equal(ours["mask"], theirs["mask"])
    np.testing.assert_array_equal(ours["routes"], theirs["routes"])
    np.testing.assert_allclose(ours["old_logp"], theirs["old_logp"], atol=1e-5, rtol=0)
    # Every fed position recorded, nothing beyond: the row's last token is fed by no step.
    n_fed_B = np.array(list(map(len, prompts))) + got.lengths - 1
    fed_BS = np.arange(width)[None, :] < n_fed_B[:, None]
    recorded_LBS = ours["routes"][..., 0] >= 0
    np.testing.assert_array_equal(recorded_LBS, np.broadcast_to(fed_BS, recorded_LBS.shape))


def test_replaying_the_engines_rows_gives_its_logprobs(sampler):
    """Sampled at temperature 0.7 (each row's seed): the trainer's log-probs of the sampled
    tokens, replaying the engine's experts, equal the engine's within 1e-5."""
    prompts = prompts_of(LENGTHS[:4], seed=1)
    params = [SamplingParams(max_tokens=N_NEW, temperature=0.7, seed=9, row=r) for r in range(4)]
    engine = Engine(sampler, record=True, **SIZES)
    gen = engine.generate_recorded(prompts, params)
    rows = rollout_rows(prompts, gen)
    replayed = nnx.jit(token_logps, static_argnames="temperature")
    logp_BT, _ = replayed(
        sampler.inference_model(), rows["tokens"], routes=rows["routes"], temperature=0.7
    )
    mask = rows["mask"][:, 1:]
    assert mask.sum() == sum(gen.lengths)
    got = np.where(mask > 0, np.asarray(logp_BT), 0.0)
    np.testing.assert_allclose(got, rows["old_logp"][:, 1:], atol=1e-5, rtol=0)


def test_a_speculative_engine_and_a_plain_one_refuse_to_record(sampler):
    with pytest.raises(EngineError, match="speculative engine does not record"):
        Engine(sampler_of(), speculative=True, record=True)
    with pytest.raises(EngineError, match="record=True"):
        Engine(sampler, **SIZES).generate_recorded([[1, 2]], [SamplingParams()])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_g_samples_of_one_prompt_submitted_together_prefill_it_once(sampler, temperature):
    """4 copies of a 19-token prompt (pages of 8: 2 full pages before its last token): the
    first prefills all 19 positions, the others wait for its pages and prefill their last 3;
    the 2 pages are held by all 4. Each copy draws as row r of the Sampler's batch (seed,
    row r): greedy, 4 equal completions; sampled, 4 different ones. Their records equal the
    Sampler's, the shared pages' experts included."""
    G, prompt = 4, prompts_of([19], seed=3)[0]
    want = sampler.generate([prompt] * G, N_NEW, temperature=temperature, seed=7, record=True)
    engine = Engine(sampler, record=True, **SIZES)
    params = [
        SamplingParams(max_tokens=N_NEW, temperature=temperature, seed=7, row=r) for r in range(G)
    ]
    rids = [engine.submit(prompt, q) for q in params]
    out = {r: [] for r in rids}
    held = []  # each step: the pages in use, and the most holders of one page
    while engine.has_work():
        for e in engine.step():
            out[e.rid].append(e.token)
        held.append((engine.pool.in_use(), int(engine.pool.refs.max())))
    assert engine.prefilled == 19 + (G - 1) * 3 and engine.preempted == 0
    # All 4 admitted: 2 shared pages + 4 of their own; at most 10 once decoding (29 positions)
    assert (6, G) in held and max(n for n, _ in held) == 2 + G * 2
    completions = [out[r] for r in rids]
    assert completions == want.sequences()
    assert len({tuple(c) for c in completions}) == (1 if temperature == 0 else G)
    records = [engine.records.pop(r) for r in rids]
    width = len(prompt) + N_NEW
    np.testing.assert_array_equal(
        np.stack([r.routes_LSK for r in records], 1), want.routes[:, :, :width]
    )
    for record, logp in zip(records, want.logprobs, strict=True):
        np.testing.assert_allclose(record.logprobs, logp[: len(record.logprobs)], atol=1e-5)


def test_rollouts_through_the_engine_equal_the_samplers_rows(tmp_path):
    """Rollouts with rl.rollout_engine=true against the sampler's, from the same params at
    the same step: the same draws (row r keyed by (seed, step, r)), so the same rows, keys,
    shapes and dtypes (routes exactly, old_logp within 1e-5), rewards and advantages."""
    from flax import nnx

    from moe_jax.data.prompts import load_prompts
    from moe_jax.model import Transformer
    from moe_jax.posttrain.rl.collect import Rollouts
    from tests.test_grpo import grpo_config, sums, write_jsonl

    path = write_jsonl(tmp_path / "p.jsonl", sums(8))
    rows = {}
    for engine in (False, True):
        cfg = grpo_config(path, "model.init_std=0.05", f"rl.rollout_engine={str(engine).lower()}")
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        rollouts = Rollouts(cfg, graphdef, load_prompts(cfg))
        rows[engine] = rollouts({"params": params}, {"index": np.array([0, 3])}, step=5)
    assert_same_rollout_rows(rows[True], rows[False])


def test_a_grpo_run_draws_through_the_engine_and_refuses_what_it_cannot(tmp_path):
    """train.py's GRPO with rl.rollout_engine=true: 2 steps whose trainer replays the
    engine's experts (agreement 1, log-probs within 1e-5 of the engine's); the key without
    GRPO, and aot's figures (it compiles the sampler's program), refused in one line."""
    import json

    from moe_jax.aot.grpo import rollout_shape
    from moe_jax.config import ConfigError
    from moe_jax.train.loop import train
    from tests.test_grpo import grpo_config, sums, write_jsonl

    path = write_jsonl(tmp_path / "p.jsonl", sums(12))
    run = tmp_path / "run"
    cfg = grpo_config(
        path, f"run_dir={run}", "train.steps=2", "train.log_every=1", "train.eval_every=100",
        "checkpoint.every=100", "train.trackers=[]", "rl.rollout_engine=true",
    )  # fmt: skip
    assert train(cfg).step == 2
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    trains = [r for r in records if r["kind"] == "train"]
    assert len(trains) == 2
    for r in trains:
        assert r["expert_agreement"] == 1.0 and r["logp_diff_max"] < 1e-5
        assert r["completion_len"] > 0
    with pytest.raises(ConfigError, match="train.objective=lm draws none"):
        tiny_config("rl.rollout_engine=true")
    with pytest.raises(ConfigError, match="set rl.rollout_engine=false"):
        rollout_shape(grpo_config(path, "rl.rollout_engine=true", "rl.max_prompt_len=8"))
