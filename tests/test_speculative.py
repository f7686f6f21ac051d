"""Speculative decoding with the model's MTP module (moe_jax/inference/speculative.py, its rule in
moe_jax/inference/acceptance.py). Greedy: the plain sampler's tokens at every drafting depth (1,
2, 3), every draft the full forward's over the text and the drafts before it, the per-depth
counts a host simulation's; the caches (full, sliding-window ring, MLA) through kept drafts,
rejections and hypothetical entries; stop tokens, streaming, a mesh, the CLI, the refusals.
At a temperature: the plain sampler's distribution exactly (4096 rows against probabilities
enumerated from the model's logits, within stated bounds), with and without top-k / top-p,
drafts mostly rejected and mostly kept, and each depth kept as often as expected.

Budget: tiny models (d_model 32, 2 layers), under a minute and a half on 2 cores. Models are
built (one trained, 50 steps on random sentences) once and shared (`setup`), as are their
compiled programs: a compile is most of a test's time.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import io
import math
import runpy
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.config import ConfigError
from moe_jax.data.corpus import train_iterator
from moe_jax.inference.next_token import Mode, filtered_logits
from moe_jax.inference.sampling import Sampler, SamplingError
from moe_jax.inference.speculative import SpeculativeSampler
from moe_jax.model import Transformer
from moe_jax.model.mtp import mtp_hidden
from moe_jax.run.checkpoints import Checkpointer
from moe_jax.sharding import make_mesh, state_shardings
from moe_jax.tokenizer import ByteTokenizer
from moe_jax.train.step import init_state, make_optimizer, make_train_step
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
# tiny.yaml at 2 layers: layer 1 dense, layer 2 MoE (NoPE with temperature tuning), so the
# MTP layers (the last layer's kind) are MoE with NoPE.
TWO_LAYERS = ["model.n_layers=2"]
DEPTH = 3  # the MTP depths of the models here
with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
    import this

ZEN = np.frombuffer(codecs.decode(this.s, "rot13").encode(), np.uint8).astype(np.int32)
PROMPTS = [ZEN[3:9].tolist(), ZEN[20:31].tolist()]
# The trained model's text: sentences drawn at random, each predictable but at a few forks
# ("the" or "a", "cat" or "dog", ...), so that after 50 steps every depth's drafts are mostly
# right, and wrong where a fork comes before the token they draft.
SENTENCES = ["the cat sat. ", "the cat ran. ", "a dog sat. ", "the dog ran. ", "a cat hid. "]
_TEXT = "".join(np.random.default_rng(0).choice(SENTENCES, 400))
CORPUS = np.frombuffer(_TEXT.encode(), np.uint8).astype(np.int32)
CORPUS_PROMPTS = [CORPUS[3:9].tolist(), CORPUS[20:31].tolist()]
N_NEW = 32
V_SMALL = 8  # the vocabulary of the model whose distributions are enumerated
ROWS, N_TOKENS = 4096, 5  # its prompt, once a row, sampled in one call: the first 5 tokens
# The sharp models' prompts: 11, 16 (its bucket full: drafts up to the cache's end) and 1
# token (the deeper depths start at position 0, not p + 1 - k)
SHARP_PROMPTS = [PROMPTS[1], ZEN[40:56].tolist(), PROMPTS[1][:1]]
SHARP = [*TWO_LAYERS, f"model.mtp_depth={DEPTH}", "model.init_std=0.3"]
# The cache kinds: full caches (layer 2 NoPE with temperature tuning: absolute positions
# matter); a sliding window of 4 (ring caches, prompts and decoding past it) with the layers
# in a scan; DeepSeek-V3's kind (MLA's latent caches, a dense first layer, sigmoid routing
# with the correction bias, MoE in the MTP layers).
VARIANTS = {
    "full_cache": [],
    "window_ring": [
        "attention.sliding_window=4",
        "attention.nope_interval=0",
        "attention.temperature_tuning=false",
        "model.scan_layers=true",
    ],
    "deepseek_mla": [
        "attention.kind=mla",
        "attention.q_lora_rank=16",
        "attention.kv_lora_rank=16",
        "attention.qk_nope_head_dim=8",
        "attention.qk_rope_head_dim=4",
        "attention.v_head_dim=8",
        "attention.qk_norm=none",
        "attention.nope_interval=0",
        "attention.temperature_tuning=false",
        "moe.first_dense_layers=1",
        "moe.interleave_step=1",
        "moe.score=sigmoid",
        "moe.correction_bias=true",
    ],  # fmt: skip
}


# ----------------------------------------------------------------------------- references


def full_forward(model):
    """A jitted full forward without caches (as in training) over token rows [R, S] -> the
    main model's logits [R, S-D, V] and the D = DEPTH MTP depths' [D, R, S-D, V]: depth k at
    position t takes token t+k of the row (t < S - D: every depth has its token)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, seq_RS):
        m = nnx.merge(graphdef, state)
        T = seq_RS.shape[1] - DEPTH
        x, _ = m(seq_RS[:, :T], head=False)
        hs = mtp_hidden(m, x, [seq_RS[:, k : k + T] for k in range(1, DEPTH + 1)])
        mtp = [layer.logits(h, m.head_weight()) for layer, (h, _) in zip(m.mtp, hs, strict=True)]
        return m.logits(x), jnp.stack(mtp)

    return lambda seq_RS: jax.device_get(run(state, jnp.asarray(seq_RS, jnp.int32)))


def chained_draft_logits(forward, prompts, tokens_BN, K: int, n_vocab=None):
    """Full forwards over each row's prompt and tokens 0..j, for every j, and the greedy
    drafts of depths 1..k after them (the hypothesis the program's MTP layers see) -> the
    logits (of ids below n_vocab) at the predecessor of token j: the main model's, of token
    j [B, N, V], and depth k+1's, of the draft when token j is the newest [B, N, K, V]."""
    B, N = tokens_BN.shape
    width = max(map(len, prompts)) + N + DEPTH  # one shape: one compile
    seq = np.zeros((B, N, width), np.int32)
    s = np.zeros((B, N), int)  # the predecessor of each newest token
    for b, (prompt, tokens) in enumerate(zip(prompts, tokens_BN, strict=True)):
        for j in range(N):
            seq[b, j, : len(prompt) + j + 1] = [*prompt, *tokens[: j + 1]]
            s[b, j] = len(prompt) + j - 1
    seq, s, rows = seq.reshape(B * N, width), s.reshape(-1), np.arange(B * N)
    drafts = []
    for k in range(K):
        main, mtp = forward(seq)
        logits = mtp[k, rows, s, :n_vocab]  # depth k+1 at s
        seq[rows, s + k + 2] = np.argmax(logits, axis=-1)  # its draft is token s+k+2
        drafts.append(logits)
        if k == 0:
            greedy = main[rows, s, :n_vocab].reshape(B, N, -1)
    return greedy, np.stack(drafts, axis=1).reshape(B, N, K, -1)


def simulate(tokens, draft_logits, K: int):
    """One row's greedy speculation on the host over its greedy tokens (no stop token) with
    the drafts `draft_logits` [N, K, V] pick: the per-depth (drafts checked [K], kept [K]),
    the steps, the draft each token was checked against [N] (-1: none), and the logits of
    the checked drafts [C, V], for their margins."""
    N = len(tokens)
    drafted, kept, checked, used = np.zeros(K, int), np.zeros(K, int), np.full(N, -1), []
    n, steps = 1, 0
    while n < N:
        drafts, steps, a = np.argmax(draft_logits[n - 1], axis=-1), steps + 1, 0
        for i in range(1, min(K, N - n) + 1):  # draft i is token n+i-1, if the row has room
            drafted[i - 1] += 1
            checked[n + i - 1] = drafts[i - 1]
            used.append(draft_logits[n - 1, i - 1])
            if drafts[i - 1] != tokens[n + i - 1]:
                break
            kept[i - 1], a = kept[i - 1] + 1, a + 1
        n += min(a + 1, N - n)  # the kept drafts and the main model's next token
    return drafted, kept, steps, checked, np.stack(used)


def check_against_full_forwards(forward, prompts, spec, K: int, n_vocab=None):
    """The tokens are the full forwards' greedy text (each the argmax after the ones before
    it), every draft the program checked is the full forward's greedy pick over the
    hypothesis (so are the drafts before it, which it was drafted from), and the counts,
    steps and checked drafts are the host simulation's with those drafts. A pick must lead
    the runner-up by 1e-4, so that float noise (cached or not, 4 positions or 30) cannot
    flip it."""
    greedy, logits = chained_draft_logits(forward, prompts, spec.tokens, K, n_vocab)
    np.testing.assert_array_equal(np.argmax(greedy, axis=-1), spec.tokens)
    runs = [simulate(t, lg, K) for t, lg in zip(spec.tokens, logits, strict=True)]
    drafted, kept, steps, checked, used = zip(*runs, strict=True)
    picks = np.concatenate([greedy.reshape(-1, greedy.shape[-1]), *used])
    top2 = np.sort(picks, axis=-1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 1e-4), "a pick too close to a tie"
    np.testing.assert_array_equal(spec.drafts, np.stack(checked))
    np.testing.assert_array_equal(spec.drafted_by_depth, np.stack(drafted))
    np.testing.assert_array_equal(spec.accepted_by_depth, np.stack(kept))
    assert spec.steps == max(steps)


def counts_from_tokens(tokens, drafts, K: int):
    """Per-depth (checked [K], kept [K]) and steps of one row, read back from its tokens and
    the drafts they were checked against: a step's i-th token was checked against its
    depth-i draft, kept where equal to it (a rejection's replacement never is), and a step
    ends at a token unlike its draft (a rejection's or the bonus, whose draft is -1) or
    where the row ends."""
    checked, kept, steps, depth = np.zeros(K, int), np.zeros(K, int), 0, 1
    for i in range(1, int(np.sum(tokens >= 0))):
        if drafts[i] >= 0:
            checked[depth - 1] += 1
            kept[depth - 1] += drafts[i] == tokens[i]
        if drafts[i] == tokens[i]:
            depth += 1
        else:
            steps, depth = steps + 1, 1
    return checked, kept, steps + (depth > 1)  # a last step of kept drafts only


# ----------------------------------------------------------------------------- models


def trained(steps):
    """A 2-layer dense model with DEPTH MTP depths after `steps` steps on CORPUS (MTP loss
    weight DEPTH: each depth weighs as the main loss). Dense: its programs compile in half
    the time, and the MoE is the sharp models' below."""
    cfg = tiny_config(*TWO_LAYERS, f"model.mtp_depth={DEPTH}", "train.batch_size=8",
                      "train.seq_len=32", "moe.n_experts=0", f"train.steps={steps}",
                      "train.lr=1e-2", f"train.mtp_loss_weight={DEPTH}")  # fmt: skip
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx)
    step = make_train_step(cfg, graphdef, tx)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        starts = rng.integers(0, len(CORPUS) - 33, 8)
        state, _ = step(state, jnp.asarray(np.stack([CORPUS[s : s + 33] for s in starts])))
    return nnx.merge(graphdef, state["params"])


class Setup:
    """A model with its plain sampler, full forward and speculative samplers (one per
    drafting depth, each compiling its programs once), shared by the tests (`setup`)."""

    def __init__(self, model):
        self.model, self.plain = model, Sampler(model)
        self.forward = full_forward(self.plain.inference_model())
        self.speculative = functools.cache(lambda K: SpeculativeSampler(model, draft_depth=K))


@functools.cache
def setup(name: str) -> Setup:
    """ "trained": the dense model trained 50 steps on CORPUS; a VARIANTS name: the untrained
    model of that cache kind at init_std 0.3, whose attention is sharp enough that a draft
    depends on every key in the MTP layers' caches (a cache not carried from step to step,
    or a slot left stale, changes most drafts); "dense_small": such a model with dense
    layers and a vocabulary of V_SMALL tokens. Built once per run of the module (a build, a
    training, a compile is most of a test's time)."""
    if name == "trained":
        return Setup(trained(50))
    if name == "dense_small":  # the MoE computes every expert for every token at sampling
        overrides = ["moe.n_experts=0", f"model.vocab_size={V_SMALL}"]
        return Setup(Transformer(tiny_config(*SHARP, *overrides), rngs=nnx.Rngs(0)))
    return Setup(Transformer(tiny_config(*SHARP, *VARIANTS[name]), rngs=nnx.Rngs(0)))


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("K", [1, 2, 3])
def test_trained_drafts_give_plain_greedy_token_for_token(K):
    """Drafting with the first K depths of the trained model: the plain sampler's tokens
    (itself checked against full forwards in test_sampling.py) in fewer steps, every depth's
    drafts both kept and rejected (up to K+1 tokens a step), every draft the full forward's,
    the per-depth counts the host simulation's."""
    trained = setup("trained")
    plain = trained.plain.generate(CORPUS_PROMPTS, N_NEW, temperature=0)
    spec = trained.speculative(K).generate(CORPUS_PROMPTS, N_NEW, temperature=0)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    check_against_full_forwards(trained.forward, CORPUS_PROMPTS, spec, K)
    kept_K, checked_K = spec.accepted_by_depth.sum(0), spec.drafted_by_depth.sum(0)
    assert np.all((kept_K > 0) & (kept_K < checked_K)), (kept_K, checked_K)
    np.testing.assert_allclose(spec.acceptance_rates, kept_K / checked_K, rtol=1e-12)
    assert spec.acceptance_rate == kept_K.sum() / checked_K.sum()
    assert spec.steps < plain.steps


def test_stop_tokens_and_streaming_at_every_depth():
    """All depths drafting (the default): a stop token that ends row 0 early (the plain
    sampler's tokens and lengths), and the stream: K+1 calls a step, in order, the row's
    tokens where not -1."""
    trained = setup("trained")
    plain = trained.plain.generate(CORPUS_PROMPTS, N_NEW, temperature=0)
    sampler = trained.speculative(DEPTH)
    assert SpeculativeSampler(trained.model).draft_depth == DEPTH  # the default: every depth
    stop = [int(plain.tokens[0, 9])]
    plain_stop = trained.plain.generate(CORPUS_PROMPTS, N_NEW, temperature=0, stop_tokens=stop)
    spec_stop = sampler.generate(CORPUS_PROMPTS, N_NEW, temperature=0, stop_tokens=stop)
    np.testing.assert_array_equal(spec_stop.tokens, plain_stop.tokens)
    np.testing.assert_array_equal(spec_stop.lengths, plain_stop.lengths)
    assert spec_stop.lengths[0] < N_NEW
    seen = []
    on_token = lambda step, tokens_B: seen.append((step, tokens_B[0]))
    streamed = sampler.generate(CORPUS_PROMPTS, N_NEW, temperature=0, on_token=on_token)
    assert [s for s, _ in seen] == list(range(1 + (DEPTH + 1) * streamed.steps))
    np.testing.assert_array_equal([t for _, t in seen if t >= 0], plain.tokens[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_mtp_caches_stay_right_through_acceptances_and_rejections(variant):
    """The sharp untrained model, all 3 depths drafting, for prompts of 11, 16 and 1 tokens
    (16: its bucket full, drafts up to the cache's end; 1: the deeper depths start at
    position 0, not p + 1 - k): the greedy text of full forwards (the plain sampler's,
    which test_sampling.py checks against them), every draft checked the full forward's,
    over the whole vocabulary (drafts nearly always rejected) and over ids below
    2 or 3 (vocab_size: texts of 2 or 3 letters, drafts right half or a third of the time),
    so that every depth is both kept and rejected, through steps that kept drafts (their
    slots kept), rejected them (the slots written again) and left hypothetical entries (the
    next step writes them again)."""
    sharp = setup(variant)
    prompts = SHARP_PROMPTS
    sampler = sharp.speculative(DEPTH)
    kept_K = checked_K = 0
    for n_vocab in (None, 2, 3):  # a traced value: one program
        spec = sampler.generate(prompts, N_NEW, temperature=0, vocab_size=n_vocab)
        check_against_full_forwards(sharp.forward, prompts, spec, DEPTH, n_vocab)
        if n_vocab:
            kept_K = kept_K + spec.accepted_by_depth.sum(0)
            checked_K = checked_K + spec.drafted_by_depth.sum(0)
    assert np.all((kept_K > 0) & (kept_K < checked_K)), (kept_K, checked_K)


def test_speculation_on_a_mesh_equals_full_forwards():
    """tensor 2 x expert 2 x data 2, the params sharded over the mesh (as `create_sharded`
    shards them), all 3 depths drafting: the greedy text of full forwards, and every draft
    the full forward's (the sharp model: its drafts depend on every cached key)."""
    sharp = setup("full_cache")
    cfg = tiny_config(*SHARP, "mesh.tensor=2", "mesh.expert=2", "mesh.data=2")
    mesh = make_mesh(cfg, inference=True)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    _, state = nnx.split(sharp.model)
    sharded = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh)))
    assert sharded.mtp[0].eh_proj[...].sharding.spec == P(None, ("fsdp", "expert"))
    spec = SpeculativeSampler(sharded, mesh=mesh).generate(SHARP_PROMPTS, N_NEW, temperature=0)
    check_against_full_forwards(sharp.forward, SHARP_PROMPTS, spec, DEPTH)


# ----------------------------------------------------------------------------- sampling


def rule_probs(logits, temperature, top_k, top_p, n_vocab):
    """The sampling rule by its definition, in float64 numpy, over the last axis: ids from
    n_vocab on out, sharpen, keep the top k, then the smallest most likely set whose mass
    reaches top_p (ties by lower id), renormalise."""
    z = np.asarray(logits, np.float64)[..., :n_vocab] / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, -1)
    keep = np.arange(n_vocab) < (top_k or n_vocab)
    ranked_kept = np.where(keep, ranked, 0)
    ranked_kept /= ranked_kept.sum(-1, keepdims=True)  # top-p over the top-k renormalised
    mass_before = np.cumsum(ranked_kept, -1) - ranked_kept
    keep = keep & (mass_before < top_p)
    out = np.zeros_like(p)
    np.put_along_axis(out, order, np.where(keep, ranked, 0), -1)
    return out / out.sum(-1, keepdims=True)


def test_filtered_logits_are_the_rules_distribution():
    """`draws.filtered_logits` (the speculative rule's p and q) against the numpy
    definition on random logits with ties: the same kept set, probabilities to 1e-6."""
    logits = np.round(np.random.default_rng(0).normal(size=(64, 12)) * 2, 1).astype(np.float32)
    for temperature, top_k, top_p in [(1.0, 0, 0.8), (0.5, 4, 1.0), (2.0, 5, 0.7), (1.0, 0, 1.0)]:
        mode = Mode(False, top_k > 0, top_p < 1)
        got = jax.nn.softmax(filtered_logits(jnp.asarray(logits), temperature, top_k, top_p, mode))
        want = rule_probs(logits, temperature, top_k, top_p, 12)
        np.testing.assert_array_equal(np.asarray(got) > 0, want > 0)
        np.testing.assert_allclose(got, want, atol=1e-6)


def bernstein(p, n: int, delta: float):
    """t with P(|k/n - p| >= t) <= delta for k ~ Binomial(n, p) (Bernstein's inequality:
    2 exp(-n t^2 / (2 p (1 - p) + 2 t / 3)) <= delta for this t)."""
    log = math.log(2 / delta)
    return np.sqrt(2 * p * (1 - p) * log / n) + 2 * log / (3 * n)


def exact_distributions(forward, prompt, K, temperature, top_k, top_p):
    """From full forwards over the prompt and every x1..x4 in [0, 8)^4: the plain sampler's
    joint of the first 5 tokens [8]*5, and the expected count of depth-k drafts kept in the
    first step, k = 1..K (depth k is checked after depths 1..k-1 were kept; it draws x_{k+1}
    from q_k, the depth at the prompt's last position with tokens x1..x_k ahead)."""
    L, V, M = len(prompt), V_SMALL, N_TOKENS - 1
    grid = np.stack(np.meshgrid(*[np.arange(V)] * M, indexing="ij"), -1).reshape(-1, M)
    pad = np.zeros((len(grid), DEPTH), int)
    main, mtp = forward(np.concatenate([np.tile(prompt, (len(grid), 1)), grid, pad], 1))
    rule = partial(rule_probs, temperature=temperature, top_k=top_k, top_p=top_p, n_vocab=V)
    p = rule(main[:, L - 1 : L + M]).reshape(*[V] * M, M + 1, V)  # [x1..x4, t, next]
    q = rule(mtp[:, :, L - 1]).reshape(DEPTH, *[V] * M, V)  # [k, x1..x4, next]
    # p_t: the distribution of x_{t+1} given x1..x_t, [V]*t + [V] (it reads x1..x_t only)
    p_t = [p[(slice(None),) * t + (0,) * (M - t) + (t,)] for t in range(M + 1)]
    joint = p_t[0]
    for t in range(1, M + 1):
        joint = joint[..., None] * p_t[t]
    # P(the first step keeps drafts 1..k and they are x2..x_{k+1}), summed over those tokens
    reach, expected = p_t[0], []
    for k in range(1, K + 1):
        q_k = q[k - 1][(slice(None),) * k + (0,) * (M - k)]  # [x1..x_k, next]
        reach = reach[..., None] * np.minimum(p_t[k], q_k)  # ... and draft k kept
        expected.append(reach.sum())
    return joint, np.array(expected)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept_range",
    [
        (2.0, 3, 0.7, (0.0, 0.5)),  # drafts mostly rejected; both filters cut most mass
        (8.0, 0, 1.0, (0.8, 1.0)),  # flat p and q, no filters: drafts mostly kept
    ],
)
def test_sampling_has_the_plain_samplers_distribution(temperature, top_k, top_p, kept_range):
    """The sharp untrained model with dense layers and 8 tokens (its MTP unrelated to its
    main model), all 3 depths drafting, one prompt in 4096 rows: the frequency of each value
    of each of the first 5 tokens and of each pair of adjacent ones against the plain
    sampler's probability from the model's logits, within Bernstein's bound for 4096 exact
    draws at 1e-6 / 296 (every cell of these 5 x 8 + 4 x 64 together: < 1e-6 of failing
    where the distribution is right; the seed is fixed, so the test is deterministic), and
    never a token the filters leave out; the first step's depth-k drafts kept as often as
    expected (within the bound at 1e-7 each); the per-depth counts those the tokens and
    their drafts give. Step 1 checks x2..x4 (rows have room), so these tokens come from kept
    drafts, rejections' replacements and bonus tokens, of the first step and the next."""
    small, K = setup("dense_small"), DEPTH
    prompt = [t % V_SMALL for t in PROMPTS[1]]
    sampler = small.speculative(K)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    spec = sampler.generate([prompt] * ROWS, N_TOKENS, **kw)
    tokens = spec.tokens
    assert np.all(spec.lengths == N_TOKENS)
    joint, expected = exact_distributions(small.forward, prompt, K, temperature, top_k, top_p)
    assert kept_range[0] < expected[0] < kept_range[1], expected
    margins = [(t,) for t in range(N_TOKENS)] + [(t, t + 1) for t in range(N_TOKENS - 1)]
    delta = 1e-6 / (N_TOKENS * V_SMALL + (N_TOKENS - 1) * V_SMALL**2)
    for axes in margins:
        others = tuple(a for a in range(N_TOKENS) if a not in axes)
        exact = joint.sum(axis=others).reshape(-1)
        cells = np.ravel_multi_index(tokens[:, list(axes)].T, (V_SMALL,) * len(axes))
        freq = np.bincount(cells, minlength=exact.size) / ROWS
        excess = np.abs(freq - exact) / bernstein(exact, ROWS, delta)
        assert np.all(excess < 1) and not np.any(freq[exact == 0]), (axes, freq, exact)
    kept_first_step = np.cumprod(spec.drafts[:, 1 : K + 1] == tokens[:, 1 : K + 1], axis=1)
    excess = np.abs(kept_first_step.mean(0) - expected) / bernstein(expected, ROWS, 1e-7)
    assert np.all(excess < 1), (kept_first_step.mean(0), expected)
    counts = [counts_from_tokens(t, d, K) for t, d in zip(tokens, spec.drafts, strict=True)]
    checked, kept, steps = zip(*counts, strict=True)
    np.testing.assert_array_equal(spec.drafted_by_depth, np.stack(checked))
    np.testing.assert_array_equal(spec.accepted_by_depth, np.stack(kept))
    assert spec.steps == max(steps)


def test_same_seed_same_text_other_seed_other_text():
    """At a temperature the tokens come from the seed's keys only (the trained model)."""
    sampler = setup("trained").speculative(DEPTH)
    run = lambda seed: sampler.generate(CORPUS_PROMPTS, N_NEW, temperature=1.0, seed=seed)
    first, again, other = run(0), run(0), run(1)
    np.testing.assert_array_equal(again.tokens, first.tokens)
    np.testing.assert_array_equal(again.drafts, first.drafts)
    assert np.any(other.tokens != first.tokens)


# ----------------------------------------------------------------------------- CLI, refusals


def test_sample_cli_speculates_and_reports_the_acceptance_per_depth(tmp_path, capsys):
    """sample.py with sample.speculative=true, the trained model's weights: the greedy text,
    and the rates on stderr, per depth; a draft depth beyond the model's or below 1 is a
    one-line error (exit 2)."""
    trained = setup("trained")
    run = tmp_path / "run"
    cfg = dataclasses.replace(trained.model.cfg, run_dir=str(run))
    _, state = init_state(cfg, make_optimizer(cfg.train))
    meta = {"config": cfg, "tokenizer": ByteTokenizer(), "fingerprint": "test"}
    ckpt = Checkpointer(cfg)
    batches = train_iterator(CORPUS, 16, 4, cfg.seed)
    ckpt.save(1, nnx.state(trained.model, nnx.Param), state["opt_state"], batches, meta)
    ckpt.close()
    sample = runpy.run_path(str(ROOT / "sample.py"))["main"]
    flags = ["--run", str(run), "--prompt", "the cat ", "--max-new-tokens", str(N_NEW)]
    flags += ["--temperature", "0", "--num-samples", "2"]
    assert sample(flags) == 0
    greedy = capsys.readouterr().out
    assert sample([*flags, "sample.speculative=true"]) == 0
    out = capsys.readouterr()
    assert out.out == greedy
    per_depth = [f"depth {k}: " for k in range(1, DEPTH + 1)]
    assert "drafts accepted (" in out.err and all(d in out.err for d in per_depth), out.err
    for depth, message in [(4, "draft_depth 4 is not within [1, 3]"), (0, "must be >= 1")]:
        assert sample([*flags, "sample.speculative=true", f"sample.draft_depth={depth}"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err


def test_refusals_are_one_line():
    with pytest.raises(SamplingError, match="model.mtp_depth=0") as e:
        SpeculativeSampler(Transformer(tiny_config(*TWO_LAYERS), rngs=nnx.Rngs(0)))
    assert "\n" not in str(e.value)
    model = Transformer(tiny_config(*TWO_LAYERS, "model.mtp_depth=2"), rngs=nnx.Rngs(0))
    for depth in (0, 3):
        match = rf"draft_depth {depth} is not within \[1, 2\]"
        with pytest.raises(SamplingError, match=match) as e:
            SpeculativeSampler(model, draft_depth=depth)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="sample.draft_depth must be >= 1") as e:
        tiny_config("sample.draft_depth=0")
    assert "\n" not in str(e.value)
