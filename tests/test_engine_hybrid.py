"""The generation engine on a hybrid stack (attention.linear=gated_deltanet: Qwen3-Next /
Qwen3.5's layout) against `Sampler.generate`, token for token: the linear layers' state slots
(one per engine slot, beside the full layers' pages; `engine.programs` module doc), taken by
requests that come and go, and the engine's refusals for these models.

Greedy parity is exact (argmax equality): the engine prefills in chunks of 16 from the slot's
state and the sampler in one call, so their sums differ by float rounding (~1e-6), far below
the logit gaps of the randomised model (`tests.test_hybrid._randomized`, N(0, 0.3^2) params).
One model of 2 layers (linear, gated full) and one set of engine sizes: the programs (prefill
chunks of 1 and 2 rows, the 4-row decode step) compile once for the module.
"""

import numpy as np
import pytest
from flax import nnx

from moe_jax.inference.engine import Engine, EngineError, SamplingParams
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from tests.helpers import tiny_config
from tests.test_engine import SIZES, run_staggered
from tests.test_hybrid import HYBRID, _randomized

N_NEW = 8
LENGTHS = (5, 11, 30, 19, 3, 40)  # 6 requests for 4 slots; 30 and 40: 2 and 3 prefill chunks
SMALL = ("model.n_layers=2", "model.max_seq_len=64", "train.seq_len=64")


@pytest.fixture(scope="module")
def hybrid():
    cfg = tiny_config(*HYBRID, *SMALL)
    assert [cfg.is_linear(i) for i in range(2)] == [True, False]
    sampler = Sampler(_randomized(Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in LENGTHS]
    # the prefix cache's: the 30-token prompt extended, and changed in its first token
    prompts += [prompts[2] + prompts[0], [(prompts[2][0] + 1) % 64] + prompts[2][1:]]
    greedy = sampler.generate(prompts, N_NEW, temperature=0).sequences()
    return sampler, prompts[:6], greedy[:6], prompts[6:], greedy[6:]


def _slots(engine) -> list:
    """Every linear layer's state pool (the blocks' [slots + snapshots, H, K, V])."""
    return [d["state"] for ds in engine.programs.pages["blocks"] for d in ds if "state" in d]


def _with_logprobs(engine, prompts) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log-probabilities, all submitted at once."""
    rids = [engine.submit(p, SamplingParams(max_tokens=N_NEW)) for p in prompts]
    out = {r: ([], []) for r in rids}
    while engine.has_work():
        for e in engine.step():
            out[e.rid][0].append(e.token)
            out[e.rid][1].append(e.logprob)
    return [out[r] for r in rids]


def test_greedy_requests_coming_and_going_equal_the_sampler(hybrid):
    """Requests joining at different steps, more than the slots (a finished request's slot
    is taken by a new one, which starts from a zero state), then all at once into a pool of
    1.5 contexts (requests are preempted and prefilled again from position 0): every
    request's tokens are the sampler's."""
    sampler, prompts, greedy, *_ = hybrid
    engine = Engine(sampler, **SIZES)
    pools = _slots(engine)
    assert len(pools) == 1 and pools[0].shape == (3 * SIZES["max_slots"], 4, 8, 6)
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=N_NEW)) == greedy
    assert engine.pool.in_use() == 0 and not engine.has_work()
    assert np.abs(np.asarray(_slots(engine)[0])).max() > 0  # the slots were written
    assert engine.generate(prompts, SamplingParams(max_tokens=N_NEW)) == greedy
    assert engine.preempted > 0 and engine.pool.in_use() == 0


def test_sampled_requests_equal_the_sampler(hybrid):
    """Sampled requests (top-k and top-p; one rule, so one sampling mode to compile), each
    keyed as its row of a Sampler batch: the tokens that batch draws, whatever ran beside
    them in the engine."""
    sampler, prompts, *_ = hybrid
    rule = dict(temperature=1.2, top_k=5, top_p=0.9, seed=5)
    want = sampler.generate(prompts, N_NEW, **rule).sequences()
    params = [SamplingParams(max_tokens=N_NEW, row=r, **rule) for r in range(len(prompts))]
    assert run_staggered(Engine(sampler, **SIZES), prompts, params) == want


def test_a_prefix_cache_hit_restores_a_kept_state_and_gives_the_tokens_of_a_miss(hybrid):
    """A 30-token prompt (pages of 8) prefills in chunks ending at 16 and 24 (its last full
    page before its last token: `Snapshots.boundary`), keeping the state at both. Then the
    same prompt and one extending it are admitted with its 3 pages and the state at 24: only
    their tails are prefilled, and their tokens are those of a miss (the sampler's). A kept
    state is found only by its whole prefix: a prompt changed in its first token restores
    none.
    Speculative decoding is refused by name (a rejected draft would roll the state back)."""
    sampler, prompts, greedy, (longer, changed), want = hybrid
    engine = Engine(sampler, **SIZES)
    base = prompts[2]  # 30 tokens; `longer` 35
    miss = _with_logprobs(engine, [base])
    assert miss[0][0] == greedy[2]
    assert len(engine.snapshots.rows) == 2 and len(engine.pool.by_hash) == 3
    before = engine.prefilled
    hits = _with_logprobs(engine, [base, longer])
    assert [t for t, _ in hits] == [greedy[2], want[0]] and engine.preempted == 0
    assert engine.prefilled - before == (30 - 24) + (35 - 24)
    # the log-probs too: a state restored wrongly may keep the argmax, not the values
    # (1e-4: float32 sums in other chunkings, ~1e-6 apart)
    np.testing.assert_allclose(hits[0][1], miss[0][1], rtol=0, atol=1e-4)
    before = engine.prefilled
    assert _with_logprobs(engine, [changed])[0][0] == want[1]
    assert engine.prefilled - before == 30  # a miss
    assert not any(engine.snapshots.pins.values()) and engine.pool.in_use() == 0
    with pytest.raises(EngineError, match="roll the linear-attention layers' states back"):
        Engine(sampler, **SIZES, speculative=True)
