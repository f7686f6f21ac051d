"""The generation engine (moe_jax/engine): continuous batching over the paged KV cache against
`Sampler.generate` (sample.py's program), token for token.

Greedy parity is exact (argmax equality): the engine's chunked prefill and paged attention
sum in another order than the sampler's (~1e-6 apart), and the models use init_std 0.05 so
logits spread far beyond that (as tests/test_sampling.py does). Each engine shape (prefill
chunk, decode step, table width, sampling mode) is one compile, shared by the engines of a
model, so the tests share models and engine sizes. Budget: ~40 s on 2 CPU cores.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax.inference.engine import Engine, EngineError, QueueFull, SamplingParams
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.model.int8 import quantize_model
from moe_jax.sharding import make_mesh, state_shardings
from tests.helpers import tiny_config

N_NEW = 10
# RoPE with chunked attention (chunks of 8) then a NoPE MoE layer with temperature tuning;
# a context of 64 positions: 8 pages of 8.
BASE = [
    "model.init_std=0.05",
    "model.n_layers=2",
    "attention.nope_interval=2",
    "attention.floor_scale=4",
    "attention.chunk_size=8",
    "model.max_seq_len=64",
    "train.seq_len=64",
]
LENGTHS = (5, 11, 30, 19, 3, 40)  # 40: three prefill chunks of 16
# 12 pages: 1.5 contexts for 4 slots, so long requests preempt others now and then. (Every
# engine here has these sizes: a pool of another size would compile the programs again.)
# min_decode_rows: every decode step runs the 4 slots' rows (one shape; the server's tests
# run the default buckets of 1, 2 and 4 rows); prefill_rows: prefills of 1 and 2 rows.
SIZES = dict(max_slots=4, page_size=8, chunk=16, n_pages=12, min_decode_rows=4, prefill_rows=2)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def sampler_of(*overrides):
    return Sampler(Transformer(tiny_config(*BASE, *overrides), rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def base():
    sampler = sampler_of()
    prompts = prompts_of(LENGTHS)
    greedy = sampler.generate(prompts, N_NEW, temperature=0).sequences()
    return sampler, prompts, greedy


def run_staggered(engine, prompts, params, first=2, every=3):
    """Submit `first` prompts, then one more every `every` steps: requests join while others
    prefill or decode. -> each request's tokens, in prompt order."""
    rids, out, step = [], {}, 0
    each = params if isinstance(params, list) else [params] * len(prompts)
    pending = list(zip(prompts, each, strict=True))
    while pending or engine.has_work():
        while pending and (len(rids) < first or step % every == 0):
            rids.append(engine.submit(*pending.pop(0)))
            if len(rids) >= first and step % every == 0:
                break
        for e in engine.step():
            out.setdefault(e.rid, []).append(e.token)
        step += 1
    return [out[r] for r in rids]


def test_engine_equals_sampler_greedy_for_requests_joining_at_different_steps(base):
    sampler, prompts, greedy = base
    engine = Engine(sampler, **SIZES)
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=N_NEW)) == greedy
    assert engine.pool.in_use() == 0 and not engine.has_work()  # every page back


def test_a_short_pool_preempts_and_still_gives_the_same_tokens(base):
    sampler, prompts, greedy = base
    engine = Engine(sampler, **SIZES)
    assert engine.generate(prompts, SamplingParams(max_tokens=N_NEW)) == greedy
    assert engine.preempted > 0 and engine.pool.in_use() == 0


def _kv_of(engine, pages: list[int]) -> list[np.ndarray]:
    """Every layer's K and V of `pages` (the page axis: -4 of [..., N, PS, K, hd]), copied."""
    leaves = jax.tree.leaves(engine.programs.pages)
    assert all(leaf.shape[-4] == engine.pool.n_pages for leaf in leaves)  # no ring layers
    return [np.take(np.asarray(leaf), pages, axis=-4) for leaf in leaves]


def _assert_tables_meet_in_hashed_pages(engine) -> None:
    """Running requests' page tables share only hashed pages (a prefix's, never written
    again), each counted once per holder at least."""
    held = [s.pages for s in engine.slots if s is not None]
    for i, a in enumerate(held):
        for b in held[i + 1 :]:
            both = set(a) & set(b)
            assert all(p in engine.pool.hash_of for p in both), both
    holders = np.bincount(np.concatenate([[-1], *held]) + 1, minlength=engine.pool.n_pages + 1)
    assert np.all(engine.pool.refs >= holders[1:])


def test_prefix_pages_are_shared_by_hash_and_counted(base):
    """A prompt prefix's full pages are found by hash and shared, counted per holder; their
    K/V are byte for byte the same after the sharers ran (no request writes a page it
    shares), and the running requests' tables meet only in those hashed pages."""
    sampler, _, _ = base
    common = prompts_of([24], seed=5)[0]
    prompts = [common + tail for tail in prompts_of([3, 9, 1], seed=6)]
    greedy = sampler.generate(prompts, N_NEW, temperature=0).sequences()
    engine = Engine(sampler, **SIZES)
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=N_NEW))
    # The first request's 3 full prompt pages stay findable after it ends, then are shared.
    assert first == greedy[:1] and len(engine.pool.by_hash) == 3
    rids = [engine.submit(p, SamplingParams(max_tokens=N_NEW)) for p in prompts[1:]]
    out = {r: [] for r in rids}
    for e in engine.step():  # admitted: both hold the 3 shared pages
        out[e.rid].append(e.token)
    shared = [engine.pool.by_hash[h] for h in list(engine.pool.by_hash)[:3]]
    assert all(engine.pool.refs[p] == 2 for p in shared)
    kv = _kv_of(engine, shared)
    _assert_tables_meet_in_hashed_pages(engine)
    while engine.has_work():
        for e in engine.step():
            out[e.rid].append(e.token)
        _assert_tables_meet_in_hashed_pages(engine)
    for before, after in zip(kv, _kv_of(engine, shared), strict=True):
        assert before.tobytes() == after.tobytes(), "a shared page was written"
    assert [out[r] for r in rids] == greedy[1:]
    assert all(engine.pool.refs[p] == 0 for p in shared) and engine.pool.in_use() == 0


def test_sampled_requests_equal_the_sampler_alone_whatever_runs_beside_them(base):
    """A request's draws depend on its seed and step only: alone in the sampler, or beside
    greedy and other sampled requests in the engine, the same tokens."""
    sampler, prompts, _ = base
    rules = [dict(temperature=0.8, seed=3), dict(temperature=1.2, top_k=5, top_p=0.9, seed=5)]
    alone = [
        sampler.generate([p], N_NEW, **r).sequences()[0]
        for p, r in zip(prompts, rules, strict=False)
    ]
    params = [SamplingParams(max_tokens=N_NEW, **r) for r in rules]
    params += [SamplingParams(max_tokens=N_NEW)] * (len(prompts) - len(rules))
    got = run_staggered(Engine(sampler, **SIZES), prompts, params)
    assert got[: len(rules)] == alone


def test_stop_ids_and_max_tokens_end_a_request_and_free_its_slot(base):
    sampler, prompts, greedy = base
    engine = Engine(sampler, **SIZES)
    stop = greedy[0][3]
    out = engine.generate(
        prompts[:2],
        [SamplingParams(max_tokens=N_NEW, stop_ids=(stop,)), SamplingParams(max_tokens=4)],
    )
    assert out == [greedy[0][: greedy[0].index(stop) + 1], greedy[1][:4]]
    assert engine.running() == 0 and engine.pool.in_use() == 0


def test_bad_requests_and_a_full_queue_are_refused(base):
    sampler, prompts, _ = base
    engine = Engine(sampler, **SIZES, max_queue=1)
    with pytest.raises(EngineError, match="context"):
        engine.submit(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(EngineError, match="vocabulary"):
        engine.submit([300])
    with pytest.raises(EngineError, match="non-empty"):
        engine.submit([])
    with pytest.raises(EngineError, match="top_p"):
        engine.submit([1], SamplingParams(temperature=1.0, top_p=0))
    engine.submit(prompts[0])
    with pytest.raises(QueueFull):
        engine.submit(prompts[1])
    assert engine.cancel(0) and not engine.has_work()


@pytest.mark.parametrize(
    "overrides",
    [
        # layer 1 in a window of 6 (its own pool of pages, released behind the window),
        # layer 2 global (gpt-oss' alternation)
        ["attention.sliding_window=6", "attention.full_attention_interval=2"],
        [
            "attention.kind=mla",
            "attention.qk_norm=none",
            "attention.nope_interval=0",
            "attention.chunk_size=0",
            "attention.kv_lora_rank=16",
            "attention.qk_nope_head_dim=8",
            "attention.qk_rope_head_dim=8",
            "attention.v_head_dim=6",
        ],
        ["int8"],  # the base model's weights as int8 (moe_jax.quantize's form)
    ],
    ids=["sliding_window", "mla", "int8"],
)
def test_sliding_window_mla_and_int8_models_page_too(overrides):
    if overrides == ["int8"]:
        sampler = Sampler(quantize_model(Transformer(tiny_config(*BASE), rngs=nnx.Rngs(0))))
    else:
        sampler = sampler_of(*overrides)
    prompts = prompts_of((13, 20, 4), seed=2)  # 20: two chunks; all within 4 pages
    greedy = sampler.generate(prompts, N_NEW, temperature=0).sequences()
    engine = Engine(sampler, **SIZES)
    held, spanned = [], []
    step = engine.step

    def watched_step():  # the window pages each slot holds, against those its length spans
        events = step()
        for seq in filter(None, engine.slots):
            held.append(sum(p >= 0 for p in seq.window_pages))
            spanned.append(len(seq.window_pages))
        return events

    engine.step = watched_step
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=N_NEW)) == greedy
    if "attention.sliding_window=6" in overrides:  # 30 positions span 4 pages; a window
        assert engine.window == 6  # of 6 needs at most 2 of them (and the one written)
        assert max(spanned) == 4 and max(held) <= 3 and engine.window_pool.in_use() == 0


def test_on_a_mesh_the_engine_gives_the_same_tokens(base):
    """The params sharded over 8 devices (experts over `expert`, heads over `tensor`): the
    MoE layers take the expert-parallel path, the pages split their kv heads over `tensor`."""
    sampler, prompts, greedy = base
    model = sampler.inference_model()
    cfg = model.cfg
    mesh_cfg = dataclasses.replace(cfg.mesh, expert=4, tensor=2)
    mesh = make_mesh(dataclasses.replace(cfg, mesh=mesh_cfg))
    graphdef, params = nnx.split(model, nnx.Param)
    sharded = nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))
    engine = Engine(Sampler(sharded, mesh=mesh), **SIZES)
    k_pages = engine.programs.pages["blocks"][0][0]["k"]  # [N, PS, K, hd]
    assert k_pages.sharding.spec[2] == "tensor"
    some = [0, 1, 3, 4]  # within 4 pages: one table width to compile
    got = engine.generate([prompts[i] for i in some], SamplingParams(max_tokens=N_NEW))
    assert got == [greedy[i] for i in some]
