"""Sampling: the compiled prefill + decode loop against repeated full forwards, the sampling
rules on a hand-made distribution, stop tokens, prompt buckets and bad requests.

Token parity is exact (argmax equality). The loop and the reference compute the same logits
with sums in a different order (~1e-6 apart), so every reference step also asserts that its
top-2 logit margin is far above that (1e-4): a failure then means a wrong token, not a tie.
Models use init_std 0.05 so logits spread enough for such margins.
Budget: ~40 s on 2 CPU cores (tiny models; each distinct shape/mode is one ~1-2 s compile).
"""

import dataclasses
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.data.corpus import train_iterator
from moe_jax.data.windows import bucket
from moe_jax.inference.next_token import Mode, sample_tokens
from moe_jax.inference.sampling import Sampler, SamplingError
from moe_jax.model import Transformer
from moe_jax.run.checkpoints import Checkpointer
from moe_jax.sharding import make_mesh, state_shardings
from moe_jax.tokenizer import CharTokenizer
from moe_jax.train.step import init_state, make_optimizer
from tests.helpers import forward, tiny_config
from tests.test_config import run_importing

MARGIN = 1e-4
N_NEW = 12

# Layer kinds exercised by the parity tests (on top of tiny.yaml: QK rms-norm, 4 experts,
# top-2, capacity factor 1.25 as trained).
KINDS = {
    # Layer 1: RoPE, chunked attention (chunks of 8, crossed by the prompts and the decode
    # loop at 8, 16 and 24), dense SwiGLU. Layer 2: NoPE (global) with temperature tuning
    # (floor_scale 4, so the temperature varies), MoE.
    "base": [
        "model.n_layers=2",
        "attention.nope_interval=2",
        "attention.floor_scale=4",
        "attention.chunk_size=8",
    ],
    # Llama-4-like: every layer MoE, sigmoid top-1 scaling the expert input, shared expert,
    # interleaved RoPE, L2 QK-norm; a sliding window of 6; stored as a 2-block layer scan.
    "window_llama4_scan": [
        "model.n_layers=2",
        "attention.sliding_window=6",
        "attention.nope_interval=0",
        "attention.qk_norm=l2",
        "attention.rope_style=interleaved",
        "moe.interleave_step=1",
        "moe.score=sigmoid",
        "moe.top_k=1",
        "moe.renormalize=false",
        "moe.route_scale=input",
        "moe.shared_expert_hidden=24",
        "model.scan_layers=true",
    ],
}
PROMPT_LENS = (5, 11, 13, 7)  # one bucket (16); 13 + 12 new tokens crosses 8, 16 and 24


def make_sampler(*overrides, seed=0):
    cfg = tiny_config("model.init_std=0.05", *overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    return model, Sampler(model)


def prompts_of(lengths, seed=0, V=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, n).tolist() for n in lengths]


def greedy_reference(model, prompts, n_new):
    """Argmax of repeated full forwards (no cache): one fixed-size buffer, so one compile.
    Positions past a row's current length hold zeros, which causal attention never sees."""
    lens = [len(p) for p in prompts]
    buf = np.zeros((len(prompts), max(lens) + n_new), np.int32)
    for row, p in zip(buf, prompts, strict=True):
        row[: len(p)] = p
    out = np.zeros((len(prompts), n_new), np.int32)
    for t in range(n_new):
        logits = np.asarray(forward(model, jnp.asarray(buf))[0])
        for b, n in enumerate(lens):
            top2 = np.sort(logits[b, n + t - 1])[-2:]
            assert top2[1] - top2[0] > MARGIN, "reference step too close to a tie; change seed"
            out[b, t] = buf[b, n + t] = np.argmax(logits[b, n + t - 1])
    return out


@pytest.fixture(scope="module")
def base():
    """The default tiny model and its greedy tokens for four mixed-length prompts."""
    model, sampler = make_sampler(*KINDS["base"])
    prompts = prompts_of(PROMPT_LENS)
    greedy = sampler.generate(prompts, N_NEW, temperature=0)
    return model, sampler, prompts, greedy


# ----------------------------------------------------------------------------- parity


def test_llama4_window_scan_greedy_equals_repeated_full_forwards():
    _, sampler = make_sampler(*KINDS["window_llama4_scan"])
    prompts = prompts_of(PROMPT_LENS, seed=1)
    out = sampler.generate(prompts, N_NEW, temperature=0)
    ref = greedy_reference(sampler.inference_model(), prompts, N_NEW)
    np.testing.assert_array_equal(out.tokens, ref)
    np.testing.assert_array_equal(out.lengths, N_NEW)
    assert out.steps == N_NEW - 1


def test_compiled_program_never_materialises_the_stacked_layers():
    """Decode speed rests on the loop not copying weights: the program gets the layer blocks
    one at a time and re-stacks them only for slices that fold away (see unstack_blocks), so
    no array with the stacked [n_blocks, ...] shape of a weight or cache exists in it."""
    model, sampler = make_sampler(*KINDS["window_llama4_scan"])
    assert model.blocks.layers[0].ffn.experts.w_gate.shape == (2, 4, 32, 40)  # 2 blocks
    B, P, N = 2, 16, 8
    hlo = sampler.lower([[0] * P] * B, N, temperature=0).compile().as_text()
    assert "f32[4,32,40]" in hlo  # the per-block expert weights are there...
    assert "f32[2,4,32,40]" not in hlo  # ...never stacked
    # The window layers' cache is a ring of the window (6) [B, 6, K, hd] per block, never
    # [n_blocks, B, 6, K, hd], and no [B, P + N, ...] cache exists at all.
    kv = f"{B},6,2,8]"
    assert f"f32[{kv}" in hlo and f"f32[2,{kv}" not in hlo
    assert f"f32[{B},{P + N},2,8]" not in hlo


def test_mixed_length_batch_equals_each_prompt_alone_and_full_forwards(base):
    model, sampler, prompts, greedy = base
    np.testing.assert_array_equal(
        greedy.tokens, greedy_reference(sampler.inference_model(), prompts, N_NEW)
    )
    # Alone, batch 1 reads only the picked experts (gathered path); batch 4 uses the buffers.
    for p, row in zip(prompts, greedy.tokens, strict=True):
        np.testing.assert_array_equal(sampler.generate([p], N_NEW, temperature=0).tokens[0], row)
    # The trained model's capacity (1.25) drops assignments on these very sequences, so a
    # sampler that kept it would depend on batch composition and padding; generation doesn't.
    seqs = [p + row.tolist() for p, row in zip(prompts, greedy.tokens, strict=True)]
    batch = jnp.asarray([s + [0] * (32 - len(s)) for s in seqs])
    assert float(jnp.max(forward(model, batch)[1]["dropped_frac"])) > 0


def test_params_sharded_over_the_mesh_give_the_same_tokens(base):
    """The same params sharded by their logical axes (experts over `expert`, hidden dims over
    `tensor`), generating under `jax.set_mesh`: the MoE layers then route through the
    expert-parallel all_to_all path (batch 4 splits into the 4 `expert` shards)."""
    model, _, prompts, greedy = base
    mesh_cfg = dataclasses.replace(model.cfg.mesh, expert=4, tensor=2)
    mesh = make_mesh(dataclasses.replace(model.cfg, mesh=mesh_cfg))
    graphdef, params = nnx.split(model, nnx.Param)
    sharded = nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))
    assert sharded.blocks.layers[1].ffn.experts.w_gate[...].sharding.spec[1] == "expert"
    with jax.set_mesh(mesh):
        out = Sampler(sharded).generate(prompts, N_NEW, temperature=0)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1e-4), dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-6)],
    ids=["temperature_to_0", "top_k_1", "top_p_tiny"],
)
def test_degenerate_sampling_equals_greedy(base, settings):
    _, sampler, prompts, greedy = base
    out = sampler.generate(prompts, N_NEW, seed=3, **settings)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)


def test_top_k_beyond_the_vocabulary_is_off(base):
    _, sampler, prompts, _ = base
    run = lambda k: sampler.generate(prompts, N_NEW, temperature=1.0, top_k=k, seed=4).tokens
    np.testing.assert_array_equal(run(2**40), run(0))  # beyond int32 too


def test_same_seed_same_text_other_seed_other_text(base):
    _, sampler, prompts, _ = base
    run = lambda seed: sampler.generate(prompts, N_NEW, temperature=1.0, top_k=50, seed=seed)
    a, b, c = run(0), run(0), run(1)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_vocab_size_keeps_sampling_inside_a_smaller_alphabet(base):
    _, sampler, prompts, _ = base
    out = sampler.generate(prompts, N_NEW, temperature=2.0, top_k=50, vocab_size=7)
    assert out.tokens.min() >= 0 and out.tokens.max() < 7


def test_streaming_emits_the_generated_tokens_in_order(base):
    _, sampler, prompts, greedy = base
    seen = []
    out = sampler.generate(
        prompts[:1], N_NEW, temperature=0, on_token=lambda step, t: seen.append((step, t[0]))
    )
    assert [s for s, _ in seen] == list(range(N_NEW))
    np.testing.assert_array_equal([t for _, t in seen], out.tokens[0])
    np.testing.assert_array_equal(out.tokens[0], greedy.tokens[0])


# ----------------------------------------------------------------------------- stop tokens


def expected_stop(tokens, stops):
    """From an unstopped run: per-row length up to and including the first stop token."""
    lengths = []
    for row in tokens:
        hits = [i for i, t in enumerate(row) if t in stops]
        lengths.append(hits[0] + 1 if hits else len(row))
    return np.array(lengths)


def test_stop_token_ends_its_sequence_only(base):
    _, sampler, prompts, greedy = base
    stops = [int(greedy.tokens[0, 2])]  # row 0 stops at its 3rd token (or earlier)
    lengths = expected_stop(greedy.tokens, stops)
    assert lengths.max() == N_NEW  # some row runs on: the loop must not end early
    out = sampler.generate(prompts, N_NEW, temperature=0, stop_tokens=stops)
    np.testing.assert_array_equal(out.lengths, lengths)
    assert out.steps == N_NEW - 1
    for row, ref, n in zip(out.tokens, greedy.tokens, lengths, strict=True):
        np.testing.assert_array_equal(row[:n], ref[:n])
        assert (row[n:] == -1).all()


def test_loop_exits_early_when_every_sequence_stopped(base):
    _, sampler, prompts, greedy = base
    stops = sorted({int(t) for t in greedy.tokens[:, 3]})  # every row stops by its 4th token
    lengths = expected_stop(greedy.tokens, stops)
    out = sampler.generate(prompts, N_NEW, temperature=0, stop_tokens=stops)
    np.testing.assert_array_equal(out.lengths, lengths)
    # The first token comes from the prefill; each loop iteration adds one.
    assert out.steps == lengths.max() - 1 < N_NEW - 1
    assert out.sequences() == [r[:n].tolist() for r, n in zip(greedy.tokens, lengths, strict=True)]


# ----------------------------------------------------------------------------- rules


# Hand-made distribution over 6 tokens, most likely first: 1, 3, 4, 2, then 0 and 5 tied.
PROBS = np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])


def allowed_distribution(temperature, top_k, top_p):
    """The definition, in numpy: sharpen, keep top-k, keep the smallest set reaching top_p."""
    p = PROBS ** (1 / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(6, bool)
    keep[order[: top_k or 6]] = True
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    mass = 0.0
    for i in order:
        if keep[i] and mass >= top_p:
            keep[i] = False
        mass += q[i]
    return np.where(keep, p, 0) / np.where(keep, p, 0).sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, allowed",
    [
        (1.0, 2, 1.0, {1, 3}),
        (1.0, 0, 0.7, {1, 3, 4}),  # mass before token 4 is 0.65 < 0.7; before token 2, 0.8
        (1.0, 2, 0.7, {1, 3}),  # top-p over the top-k renormalised: 0.4/0.65 then 0.25/0.65
        (0.5, 0, 0.7, {1, 3}),  # temperature first: sharpened, 1 and 3 hold 0.85 of the mass
        (1.0, 5, 0.99, {0, 1, 2, 3, 4}),  # the tie 0 / 5 at rank 5 goes to the lower id
    ],
)
def test_top_k_top_p_draw_only_and_all_of_the_allowed_set(temperature, top_k, top_p, allowed):
    n = 20_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (n, 6))
    keys = jax.random.split(jax.random.key(0), n)
    mode = Mode(greedy=False, top_k=top_k > 0, top_p=top_p < 1)
    draws = np.asarray(sample_tokens(logits, keys, temperature, top_k, top_p, mode))
    assert set(draws.tolist()) == allowed
    # Frequencies follow the renormalised distribution: within 5 binomial standard deviations.
    want = allowed_distribution(temperature, top_k, top_p)
    assert set(np.flatnonzero(want)) == allowed  # the numpy definition agrees on the set
    freq = np.bincount(draws, minlength=6) / n
    np.testing.assert_array_less(np.abs(freq - want), 5 * np.sqrt(want * (1 - want) / n) + 1e-9)


def test_greedy_and_top_k_1_break_ties_by_lowest_id():
    logits = jnp.array([[0.0, 2.0, 1.0, 2.0]] * 64)
    keys = jax.random.split(jax.random.key(0), 64)
    greedy = sample_tokens(logits, keys, 1.0, 0, 1.0, Mode(True, False, False))
    top1 = sample_tokens(logits, keys, 1.0, 1, 1.0, Mode(False, True, False))
    assert set(np.asarray(greedy).tolist()) == set(np.asarray(top1).tolist()) == {1}


# ----------------------------------------------------------------------------- buckets


def test_prompt_buckets_reuse_one_compiled_program(base):
    _, sampler, _, _ = base
    assert [bucket(n, 1000) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert bucket(300, 400) == 400  # capped so prompt + new tokens fit the context
    compiled = sampler.compiled._cache_size()
    sampler.generate(prompts_of([20]), 2, temperature=0.7, top_k=5)  # new bucket (32): compiles
    assert sampler.compiled._cache_size() == compiled + 1
    # Another length in the bucket, other sampling values, seed and stop tokens: no compile.
    sampler.generate(prompts_of([31], seed=5), 2, temperature=0.9, top_k=7, seed=2, stop_tokens=[3])
    assert sampler.compiled._cache_size() == compiled + 1


# ----------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[1] * 500], dict(max_new_tokens=20), "exceeds the model's context"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 256]], {}, r"outside \[0, 256\)"),
        ([], {}, "non-empty list"),
        ([[1]], dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        ([[1]], dict(temperature=-1.0), r"temperature must be 0 \(greedy\) or within \[1e-06"),
        ([[1]], dict(temperature=float("inf")), "temperature must be 0 .greedy. or within"),
        ([[1]], dict(temperature=1e-39), "temperature must be 0 .greedy. or within"),  # float32: 0
        ([[1]], dict(temperature=1e39), "temperature must be 0 .greedy. or within"),  # float32: inf
        ([[1]], dict(seed=2**32), r"seed must be within \[0, 2\^32\)"),
        ([[1]], dict(top_k=-2), "top_k must be >= 0"),
        ([[1]], dict(top_p=0.0), r"top_p must be within \(0, 1\]"),
        ([[1]], dict(stop_tokens=[999]), "stop_tokens must be token ids"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_message(base, prompts, kwargs, message):
    _, sampler, _, _ = base
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(SamplingError, match=message):
        sampler.generate(prompts, **kwargs)


# ----------------------------------------------------------------------------- sample.py

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_MAIN = runpy.run_path(str(ROOT / "sample.py"))["main"]
CORPUS = "the quick brown fox jumps over the lazy dog.\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as train.py leaves it (config.yaml + an Orbax checkpoint with params,
    optimizer, data position and a char tokenizer), holding the initial params: training a
    step would add a ~10 s compile and change nothing that sample.py does."""
    run = tmp_path_factory.mktemp("sample_cli") / "run"
    cfg = tiny_config(
        *KINDS["base"], "data.tokenizer=char", "sample.batch_size=3", f"run_dir={run}"
    )
    tokenizer = CharTokenizer.from_text(CORPUS)
    _, state = init_state(cfg, make_optimizer(cfg.train))
    batches = train_iterator(tokenizer.encode(CORPUS * 4), 16, 4, cfg.seed)
    ckpt = Checkpointer(cfg)
    meta = {"config": cfg, "tokenizer": tokenizer, "fingerprint": "test"}
    ckpt.save(1, state["params"], state["opt_state"], batches, meta)
    ckpt.close()
    return run


def test_loading_a_sampler_reads_the_runs_checkpoint_meta_once(run_dir, monkeypatch):
    from moe_jax.inference import load
    from moe_jax.inference.load import load_sampler

    reads = []
    real = load.read_meta
    monkeypatch.setattr(load, "read_meta", lambda *a: reads.append(a[1]) or real(*a))
    cfg, sampler, _ = load_sampler(run_dir, ["sample.weights=float32"])
    assert reads == [1]  # step 1's meta, once: for the config and the weights alike
    assert cfg.sample.weights == "float32" and sampler.cfg.model.d_model == cfg.model.d_model


def test_cli_streams_one_sample_and_batches_several(run_dir, capsys):
    flags = ["--run", str(run_dir), "--prompt", "the ", "--max-new-tokens", "9"]
    assert SAMPLE_MAIN([*flags, "--temperature", "0", "--num-samples", "1"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.startswith("the ") and len(streamed) == len("the ") + 9 + 1  # 1 char/token
    # The model's vocabulary is 256 but only the alphabet's ids are sampled (random params).
    assert set(streamed) <= set(CORPUS)
    # Greedy: the batch of 2 (no streaming) prints the same text twice.
    assert SAMPLE_MAIN([*flags, "--temperature", "0", "--num-samples", "2"]) == 0
    texts = capsys.readouterr().out.split("-" * 40)
    assert [t.strip("\n") for t in texts] == [streamed.strip("\n")] * 2
    # Without the flag, the run's sample.batch_size (3 here) is the number of samples.
    assert SAMPLE_MAIN([*flags, "--temperature", "0"]) == 0
    texts = capsys.readouterr().out.split("-" * 40)
    assert [t.strip("\n") for t in texts] == [streamed.strip("\n")] * 3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--run", "{tmp}/missing"], "run directory '{tmp}/missing' does not exist"),
        (["--run", "{tmp}"], "no checkpoint in '{tmp}'"),
        (["--run", "{run}", "--prompt", "the fox!?"], "not in the char tokenizer's vocabulary"),
        (
            ["--run", "{run}", "--max-new-tokens", "600"],
            "the prompt's 1 tokens + --max-new-tokens 600 exceed the model's context "
            "(model.max_seq_len=512); shorten the prompt or lower --max-new-tokens",
        ),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys, flags, message):
    fill = lambda s: s.format(tmp=tmp_path, run=run_dir)
    assert SAMPLE_MAIN([fill(f) for f in flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert fill(message) in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or within [1e-06, 1e+06]"),
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or within"),
        (["--top-k", "-1"], "--top-k must be >= 0 (0 = off), got -1"),
        (["--top-p", "1.5"], "--top-p must be within (0, 1] (1 = off), got 1.5"),
        (["--seed", "-1"], "--seed must be within [0, 2^32), got -1"),
        (["--prompt", ""], "--prompt is empty; give at least one character"),
        (["--prompt-file", "{tmp}/none.txt"], "cannot read --prompt-file '{tmp}/none.txt'"),
    ],
)
def test_cli_bad_flag_is_named_before_the_run_is_read(tmp_path, capsys, flags, message):
    """The run directory does not exist: the flag's error comes first, nothing is loaded."""
    fill = lambda s: s.format(tmp=tmp_path)
    assert SAMPLE_MAIN(["--run", str(tmp_path / "missing"), *map(fill, flags)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {fill(message)}") and err.count("\n") == 1


def test_cli_bad_flag_fails_before_importing_jax(tmp_path):
    """A mistake costs a fraction of a second, not jax's import (seconds): run sample.py as a
    user would, with `-X importtime` listing every module the process imported."""
    argv = ["sample.py", "--run", str(tmp_path), "--top-p", "0"]
    code, err, modules = run_importing(*argv)
    assert (code, err) == (2, ["error: --top-p must be within (0, 1] (1 = off), got 0.0"])
    assert "numpy" in modules and not {"jax", "flax", "orbax"} & modules
