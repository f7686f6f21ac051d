"""Speculative decoding in the engine (`Engine(speculative=True)`,
moe_jax/inference/engine/speculation.py and draft_programs.py) against `Sampler.generate`
(sample.py's plain program), the plain engine and `SpeculativeSampler` (sample.speculative's),
on a tiny DeepSeek-style model: MLA's latent caches, a dense first layer, sigmoid routing with
the correction bias, 2 MTP depths of the MoE layer's kind.

Greedy: the plain sampler's and the plain engine's tokens, token for token, and every token
checked against the draft `SpeculativeSampler` checked it against (the drafts depend on every
MTP cache entry: a stale, shared or hypothetical entry gone wrong changes them), for requests
joining at different steps, preempted (a pool of 8 pages for 4 slots), cut by stop ids and
max_tokens inside a step's kept drafts, sharing prompt pages, and on a mesh. The engine's
counts of drafts checked and kept per depth are those each request's tokens and drafts give
(`counts_from_tokens`). Sampled: each request draws what `SpeculativeSampler` draws for its
row and seed (greedy and other rules beside it), and the first 3 tokens of 512 requests have
the plain sampling rule's distribution from the model's logits (Bernstein bounds).

Requests generate from ids below 3 (the engine's vocab_size; the sampler's too), so that
drafts are both kept and rejected by an untrained model. Every engine has the sizes of `SIZES`
and every request stays within 4 pages: one compile per program, shared by the tests.
Budget: ~60 s on 2 CPU cores, most of it compiling.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.inference.engine import Engine, EngineError, SamplingParams
from moe_jax.inference.sampling import Sampler
from moe_jax.inference.speculative import SpeculativeSampler
from moe_jax.model import Transformer
from moe_jax.sharding import make_mesh, state_shardings
from tests.helpers import forward, tiny_config
from tests.test_speculative import VARIANTS, bernstein, counts_from_tokens, rule_probs

K = 2  # the model's MTP depths, all drafting
N_NEW = 10
N_VOCAB = 3
DEEPSEEK = [
    "model.init_std=0.05",
    "model.n_layers=2",
    f"model.mtp_depth={K}",
    "model.max_seq_len=64",
    "train.seq_len=64",
    *VARIANTS["deepseek_mla"],  # MLA, a dense first layer, sigmoid routing, correction bias
]
# 17: two prefill chunks, the first ending K positions early (at 15, not 16, so that the
# MTP layers over it see prompt tokens only); 1: the last chunk is the prompt's only token.
LENGTHS = (5, 11, 20, 17, 1, 14)
# 8 pages of 8 for 4 slots (one full context): requests preempt others; a request's 20 +
# 10 positions stay within a table of 4 pages.
SIZES = dict(max_slots=4, page_size=8, chunk=16, n_pages=8, min_decode_rows=4, prefill_rows=2)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def setup():
    model = Transformer(tiny_config(*DEEPSEEK), rngs=nnx.Rngs(0))
    sampler, spec = Sampler(model), SpeculativeSampler(model)
    prompts = prompts_of(LENGTHS)
    greedy = sampler.generate(prompts, N_NEW, temperature=0, vocab_size=N_VOCAB).sequences()
    drafted = spec.generate(prompts, N_NEW, temperature=0, vocab_size=N_VOCAB)
    return sampler, spec, prompts, greedy, drafted


def engine_of(sampler, **kw):
    return Engine(sampler, **SIZES, vocab_size=N_VOCAB, speculative=True, **kw)


def run_staggered(engine, prompts, params, first=2, every=3):
    """Submit `first` prompts, then one more every `every` steps -> each request's tokens and
    the drafts they were checked against, in prompt order."""
    rids, out, step = [], {}, 0
    each = params if isinstance(params, list) else [params] * len(prompts)
    pending = list(zip(prompts, each, strict=True))
    while pending or engine.has_work():
        while pending and (len(rids) < first or step % every == 0):
            rids.append(engine.submit(*pending.pop(0)))
            out[rids[-1]] = ([], [])
            if len(rids) >= first and step % every == 0:
                break
        for e in engine.step():
            out[e.rid][0].append(e.token)
            out[e.rid][1].append(e.draft)
        step += 1
    return [out[r][0] for r in rids], [out[r][1] for r in rids]


def assert_counts_are_the_tokens(engine, tokens, drafts):
    """The engine's drafts checked and kept per depth are those the requests' tokens and the
    drafts they were checked against give, and both kinds happened at every depth."""
    counts = [
        counts_from_tokens(np.array(t), np.array(d), K) for t, d in zip(tokens, drafts, strict=True)
    ]
    checked = sum(c[0] for c in counts)
    kept = sum(c[1] for c in counts)
    np.testing.assert_array_equal(engine.speculation.drafted, checked)
    np.testing.assert_array_equal(engine.speculation.accepted, kept)
    return checked, kept


def test_greedy_equals_the_samplers_and_the_plain_engine_as_requests_come_and_go(setup):
    """Staggered requests through a short pool (preemptions): the plain sampler's tokens,
    each checked against `SpeculativeSampler`'s draft; the plain engine's tokens."""
    sampler, _, prompts, greedy, spec = setup
    engine = engine_of(sampler)
    tokens, drafts = run_staggered(engine, prompts, SamplingParams(max_tokens=N_NEW))
    assert tokens == greedy
    assert drafts == [row[:N_NEW].tolist() for row in spec.drafts]
    checked, kept = assert_counts_are_the_tokens(engine, tokens, drafts)
    assert np.all((kept > 0) & (kept < checked)), (kept, checked)
    np.testing.assert_array_equal(checked, spec.drafted_by_depth.sum(0))
    assert engine.speculation.acceptance_rate == kept.sum() / checked.sum()
    assert engine.preempted > 0 and engine.pool.in_use() == 0 and not engine.has_work()
    plain = Engine(sampler, **SIZES, vocab_size=N_VOCAB)
    assert plain.generate(prompts, SamplingParams(max_tokens=N_NEW)) == greedy


def test_stop_ids_and_max_tokens_end_a_request_inside_a_step(setup):
    """A stop id that a kept draft emits before another kept draft, and a max_tokens that
    falls inside a step's kept drafts: the request ends there (the tokens after it, kept or
    not, neither emitted nor counted), as `SpeculativeSampler` ends it."""
    sampler, spec_sampler, prompts, greedy, spec = setup
    # A row r and token value whose first emission (token j) is a kept draft: the step would
    # emit more after it.
    r, j = next(
        (r, list(row).index(v))
        for r, row in enumerate(spec.tokens)
        for v in range(N_VOCAB)
        if v in row[1:] and spec.drafts[r, list(row).index(v)] == v
    )
    stop = int(spec.tokens[r, j])
    stopped = spec_sampler.generate(
        prompts, N_NEW, temperature=0, vocab_size=N_VOCAB, stop_tokens=[stop]
    )  # the setup's program (stop ids are values)
    want = dataclasses.replace(
        stopped, tokens=stopped.tokens[r : r + 1], lengths=stopped.lengths[r : r + 1],
        drafts=stopped.drafts[r : r + 1],
    )  # fmt: skip
    assert want.lengths[0] < N_NEW
    engine = engine_of(sampler)
    params = [
        SamplingParams(max_tokens=N_NEW, stop_ids=(stop,)),
        SamplingParams(max_tokens=j + 1),  # ends on the first kept draft of that step
    ]
    tokens, drafts = run_staggered(engine, [prompts[r]] * 2, params)
    assert tokens == [want.sequences()[0], greedy[r][: j + 1]]
    assert drafts == [want.drafts[0, : want.lengths[0]].tolist(), spec.drafts[r, : j + 1].tolist()]
    assert_counts_are_the_tokens(engine, tokens, drafts)
    assert engine.running() == 0 and engine.pool.in_use() == 0


def test_shared_prompt_pages_keep_the_drafts_the_samplers(setup):
    """Prompts of a common 17-token prefix: a later request shares its first page (2 full
    pages matched, the last dropped: its MTP entries were made from the first prompt's
    tokens after it) and writes none of it; tokens and drafts are the sampler's."""
    sampler, spec_sampler, _, _, _ = setup
    common = prompts_of([17], seed=5)[0]
    prompts = [common + tail for tail in prompts_of([3, 2], seed=6)]
    want = spec_sampler.generate(prompts * 3, N_NEW, temperature=0, vocab_size=N_VOCAB)
    engine = engine_of(sampler)
    first, first_drafts = run_staggered(engine, prompts[:1], SamplingParams(max_tokens=N_NEW))
    shared = engine.pool.by_hash[next(iter(engine.pool.by_hash))]  # the first page's
    rid = engine.submit(prompts[1], SamplingParams(max_tokens=N_NEW))
    events = engine.step()  # admitted: holds the shared page, prefilled from position 8
    assert engine.pool.refs[shared] == 1 and engine.slots[0].pages[0] == shared
    assert engine.slots[0].done == len(prompts[1])
    while engine.has_work():
        events += engine.step()
    second = [e.token for e in events if e.rid == rid], [e.draft for e in events if e.rid == rid]
    assert [first[0], second[0]] == want.sequences()[:2]
    assert [first_drafts[0], second[1]] == [row[:N_NEW].tolist() for row in want.drafts[:2]]
    assert engine.pool.refs[shared] == 0 and engine.pool.in_use() == 0


# At a temperature with both filters (cutting the 3 ids to 2 or 1 now and then), so that
# every sampled call compiles one mode.
RULE = dict(temperature=1.5, top_k=2, top_p=0.9)


def test_sampled_requests_draw_what_the_speculative_sampler_draws(setup):
    """Requests at a temperature beside greedy ones, admitted at different steps, some
    preempted and refilled: each request's tokens and drafts are `SpeculativeSampler`'s for
    its row and seed (its keys, split per step as the sampler's; a refill drafts again with
    the keys it drafted with)."""
    sampler, spec_sampler, prompts, greedy, _ = setup
    want = spec_sampler.generate(prompts, N_NEW, vocab_size=N_VOCAB, seed=3, **RULE)
    params = [SamplingParams(max_tokens=N_NEW, row=r, seed=3, **RULE) for r in range(6)]
    engine = engine_of(sampler)
    tokens, drafts = run_staggered(
        engine, prompts + prompts[:2], params + [SamplingParams(max_tokens=N_NEW)] * 2, first=4
    )
    assert tokens == want.sequences() + greedy[:2]
    assert drafts[:6] == [
        row[:n].tolist() for row, n in zip(want.drafts, want.lengths, strict=True)
    ]
    assert_counts_are_the_tokens(engine, tokens, drafts)
    assert engine.preempted > 0


def test_sampled_first_tokens_have_the_plain_rules_distribution(setup):
    """512 requests of one prompt at `RULE` (seeds 0..511): the frequency of each of the
    first 3 tokens' 27 joint values, and of each token's 3, against the plain rule's
    probabilities from full forwards of the model (`rule_probs`: the rule by its definition),
    within Bernstein's bound at 1e-6 / 36 (every cell together: < 1e-6 of failing where the
    distribution is right), and never a token the filters leave out."""
    sampler, _, prompts, _, _ = setup
    prompt, R, V = prompts[1], 512, N_VOCAB
    engine = engine_of(sampler)
    params = [SamplingParams(max_tokens=3, seed=s, **RULE) for s in range(R)]
    tokens = np.array(engine.generate([prompt] * R, params))
    assert engine.speculation.accepted.sum() > 0
    # p(x1), p(x2 | x1), p(x3 | x1, x2) from one forward over every (x1, x2)
    grid = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    rows = jnp.asarray([prompt + list(g) for g in grid])
    logits = np.asarray(forward(sampler.inference_model(), rows)[0])
    L = len(prompt)
    probs = rule_probs(
        logits[:, L - 1 : L + 2], RULE["temperature"], RULE["top_k"], RULE["top_p"], V
    )
    p1, p2, p3 = probs[0, 0], probs[::V, 1], probs[:, 2].reshape(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    delta = 1e-6 / (V**3 + 3 * V)
    for axes in [(0, 1, 2), (0,), (1,), (2,)]:
        others = tuple(a for a in range(3) if a not in axes)
        exact = joint.sum(axis=others).reshape(-1)
        cells = np.ravel_multi_index(tokens[:, list(axes)].T, (V,) * len(axes))
        freq = np.bincount(cells, minlength=exact.size) / R
        excess = np.abs(freq - exact) / bernstein(exact, R, delta)
        assert np.all(excess < 1) and not np.any(freq[exact == 0]), (axes, freq, exact)


def test_on_a_mesh_speculation_gives_the_same_tokens_and_drafts(setup):
    """The params sharded over 8 devices (experts over `expert`, heads over `tensor`): the
    MoE layers, the MTP layers' too, take the expert-parallel path."""
    sampler, _, prompts, greedy, spec = setup
    model = sampler.inference_model()
    cfg = model.cfg
    mesh = make_mesh(
        dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, expert=4, tensor=2))
    )
    graphdef, params = nnx.split(model, nnx.Param)
    sharded = nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))
    engine = engine_of(Sampler(sharded, mesh=mesh))
    tokens, drafts = run_staggered(engine, prompts, SamplingParams(max_tokens=N_NEW))
    assert tokens == greedy
    assert drafts == [row[:N_NEW].tolist() for row in spec.drafts]


def test_sliding_window_rings_page_the_mtp_layers_too():
    """Every layer in a window of 6, so the MTP layers' pages are read through the window
    pool's table too and released once behind every query's window (the MTP layers' queries
    start K - 1 positions before the newest token): `SpeculativeSampler`'s tokens and drafts,
    and each slot holds few window pages however long its text."""
    window = ["attention.sliding_window=6", "attention.chunk_size=0"]
    model = Transformer(tiny_config(*DEEPSEEK[:5], *window), rngs=nnx.Rngs(0))
    sampler = Sampler(model)
    prompts = prompts_of((13, 20, 4), seed=2)
    want = SpeculativeSampler(model).generate(prompts, N_NEW, temperature=0, vocab_size=N_VOCAB)
    engine = engine_of(sampler)
    held, step = [], engine.step

    def watched_step():  # the window pages each slot holds
        events = step()
        held.extend(sum(p >= 0 for p in s.window_pages) for s in filter(None, engine.slots))
        return events

    engine.step = watched_step
    tokens, drafts = run_staggered(engine, prompts, SamplingParams(max_tokens=N_NEW))
    assert tokens == want.sequences()
    assert drafts == [row[:n].tolist() for row, n in zip(want.drafts, want.lengths, strict=True)]
    assert_counts_are_the_tokens(engine, tokens, drafts)
    # 30 positions span 4 pages; the window's 6 (+ K - 1) and the K + 1 a step writes, 3
    assert engine.window == 6 and max(held) <= 3 and engine.window_pool.in_use() == 0


def test_refusals_are_one_line(setup):
    sampler = setup[0]
    plain = Sampler(Transformer(tiny_config("model.n_layers=2"), rngs=nnx.Rngs(0)))
    for make, match in [
        (lambda: Engine(plain, speculative=True), "model.mtp_depth=0"),
        (
            lambda: Engine(sampler, speculative=True, draft_depth=3),
            r"draft_depth 3 is not within \[1, 2\]",
        ),
        (lambda: Engine(sampler, speculative=True, chunk=1), "chunk 1 is below draft_depth 2"),
    ]:
        with pytest.raises(EngineError, match=match) as e:
            make()
        assert "\n" not in str(e.value)
