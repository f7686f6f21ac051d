"""int8 weight-only quantisation: per-channel reconstruction bounds, which weights are int8,
parameter bytes, logits and validation perplexity of a trained tiny model against float, the
compiled decode loop reading int8 (no float copy of the weights), the quantise CLI and
sample.py on int8 runs.

Budget: ~35 s on 2 CPU cores, most of it training the tiny model of tests/test_train.py for
150 steps on the embedded corpus (shared by every test here through one module fixture).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import load_config
from moe_jax.data import load_data
from moe_jax.data.corpus import eval_batches
from moe_jax.inference.load import load_run
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.quantize import (
    Int8Param,
    QuantizeError,
    is_quantized,
    param_bytes,
    quantize_model,
    quantize_tensor,
)
from moe_jax.quantize import main as quantize_main
from moe_jax.run.layout import RunError
from moe_jax.run.policy import inspect_run
from moe_jax.train.loop import train
from tests.helpers import dequantised_copy, forward, tiny_config
from tests.test_sampling import greedy_reference
from tests.test_train import _cfg

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_MAIN = runpy.run_path(str(ROOT / "sample.py"))["main"]
STEPS = 150


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model (2 layers: dense + MoE, qkv and router biases) trained for 150 steps on
    the embedded corpus (val loss ~2.3 nats against a unigram entropy of ~2.95), and its int8
    copy written by the CLI."""
    root = tmp_path_factory.mktemp("quantize")
    run, run_int8 = root / "run", root / "run_int8"
    train(_cfg(run, "train.log_every=50", "train.eval_batches=4"), stop_at=STEPS)
    assert quantize_main([str(run), "--out", str(run_int8)]) == 0
    return run, run_int8


def _int8_names(model) -> set[str]:
    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, Int8Param))}


# ----------------------------------------------------------------------------- the scheme


@pytest.mark.parametrize(
    "shape, axes",
    [((3, 8, 24), (-3, -2)), ((2, 5, 24, 16), (-2,))],  # like wo; stacked experts' w_up
)
def test_per_channel_reconstruction_is_within_half_a_step(shape, axes):
    w = jax.random.normal(jax.random.key(0), shape) * jnp.exp(
        jax.random.normal(jax.random.key(1), shape[-1:])  # channels of very different scales
    )
    w = w.at[..., 0].set(0.0)  # an all-zero output channel
    out = quantize_tensor(w, axes)
    q, scale = np.asarray(out["q"]), np.asarray(out["scale"])
    assert q.dtype == np.int8 and np.abs(q).max() <= 127
    assert scale.shape == tuple(1 if i - len(shape) in axes else n for i, n in enumerate(shape))
    # Symmetric absmax: each channel's largest |w| maps to +-127 exactly; rounding to the
    # nearest step leaves at most half a step (plus float32 rounding of w / scale).
    np.testing.assert_array_equal(np.abs(q).max(axis=axes, keepdims=True)[..., 1:], 127)
    err = np.abs(np.asarray(w) - scale * q)
    assert np.all(err <= scale * (0.5 + 1e-5))
    assert np.all(q[..., 0] == 0) and np.all(scale[..., 0] == 1.0)  # zero stays exactly zero


def test_matmul_weights_are_int8_embeddings_norms_router_biases_stay_float():
    cfg = tiny_config(
        "model.n_layers=4",
        "model.scan_layers=true",
        "attention.nope_interval=2",  # blocks of 2 layers: [dense, MoE] x 2 stacked
        "attention.qkv_bias=true",
        "moe.router_bias=true",
        "moe.expert_bias=true",
        "moe.shared_expert_hidden=24",
    )
    build = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build)  # shapes and types suffice here
    qmodel = nnx.eval_shape(lambda: quantize_model(build()))
    assert is_quantized(qmodel) and not is_quantized(model)
    mlp = ("w_gate", "w_up", "w_down")
    assert _int8_names(qmodel) == (
        {f"blocks.layers.{j}.attn.{w}" for j in (0, 1) for w in ("wq", "wk", "wv", "wo")}
        | {f"blocks.layers.0.ffn.{w}" for w in mlp}
        | {f"blocks.layers.1.ffn.{e}.{w}" for e in ("experts", "shared") for w in mlp}
        | {"head"}
    )
    floats = nnx.to_flat_state(nnx.state(qmodel, nnx.Param))
    float_names = {".".join(map(str, p)) for p, v in floats if not isinstance(v, Int8Param)}
    assert {"embed.embedding", "blocks.layers.1.ffn.router", "final_norm.scale"} <= float_names
    assert all(v.dtype == jnp.float32 for p, v in floats if not isinstance(v, Int8Param))
    # Scales per output channel, the stacked layer axis included: wq [2, D, H, hd] -> [2, 1, H, hd]
    wq = qmodel.blocks.layers[0].attn.wq.get_raw_value()
    assert wq["q"].shape == (2, 32, 4, 8) and wq["scale"].shape == (2, 1, 4, 8)
    w_down = qmodel.blocks.layers[1].ffn.experts.w_down.get_raw_value()  # [2, E, F, D]
    assert w_down["scale"].shape == (2, 4, 1, 32)
    with pytest.raises(QuantizeError, match="already quantised"):
        quantize_model(qmodel)
    with pytest.raises(QuantizeError, match="unknown quantization 'int4'; use one of: int8"):
        quantize_model(model, "int4")


# The input (contracted) axes of each weight in the model's einsums, from the end; the scale
# is 1 there and a channel everywhere else. Written out here as the spec, not read from the code.
INPUT_AXES = {
    "wq": (-3,),  # btd,dhk->bthk
    "wk": (-3,),
    "wv": (-3,),
    "wo": (-3, -2),  # bthk,hkd->btd
    "w_gate": (-2,),  # ...d,df->...f (experts: [E, D, F])
    "w_up": (-2,),
    "w_down": (-2,),  # ...f,fd->...d
    "head": (-2,),  # btd,dv->btv
}


def test_every_int8_weight_is_scaled_per_output_channel_and_reads_back_exactly():
    """Every int8 weight: scales of the output channels' shape, at most half a step from the
    float weight everywhere. And the int8 model computes exactly what a float model holding
    the dequantised weights computes (float32 reassociation only: 1e-5), on the expert
    buffers (a prompt) and on the gathered picked experts (one token each, 2 x 2 < 8 experts)."""
    overrides = ["moe.n_experts=8", "moe.shared_expert_hidden=24", "moe.capacity_factor=0"]
    # a dense and a MoE layer hold every kind of weight (more layers: more compiling only)
    overrides += ["model.n_layers=2", "model.init_std=0.05", "attention.nope_interval=0"]
    cfg = tiny_config(*overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    qmodel = quantize_model(model)
    floats = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    seen = set()
    for path, v in nnx.to_flat_state(nnx.state(qmodel, Int8Param)):
        raw, w = v.get_raw_value(), np.asarray(floats[path][...])
        axes = INPUT_AXES[path[-1]]
        seen.add(path[-1])
        want = tuple(1 if i - w.ndim in axes else n for i, n in enumerate(w.shape))
        assert raw["scale"].shape == want, path
        scale = np.asarray(raw["scale"])
        assert np.all(np.abs(w - scale * np.asarray(raw["q"])) <= scale * (0.5 + 1e-5)), path
    assert seen == set(INPUT_AXES)

    dequantised = dequantised_copy(model, qmodel)
    for tokens in (jnp.array([[5, 17, 99, 200, 3, 8]] * 2), jnp.array([[5], [200]])):
        np.testing.assert_allclose(
            forward(qmodel, tokens)[0], forward(dequantised, tokens)[0], rtol=1e-5, atol=1e-5
        )


def test_parameter_bytes_are_about_a_quarter_of_float32():
    cfg = load_config(ROOT / "benchmarks/configs/small.yaml")
    float_bytes = param_bytes(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    qmodel = nnx.eval_shape(lambda: quantize_model(Transformer(cfg, rngs=nnx.Rngs(0))))
    # Each int8 tensor: 1 byte per weight + a float32 scale per output channel, i.e. exactly
    # 1/4 + 1/K of its float32 bytes (K = the contracted size).
    for path, v in nnx.to_flat_state(nnx.state(qmodel, Int8Param)):
        raw = v.get_raw_value()
        n, K = raw["q"].size, raw["q"].size // raw["scale"].size
        assert raw["q"].size + 4 * raw["scale"].size == pytest.approx(4 * n * (1 / 4 + 1 / K))
        assert K >= 256, path  # contracted over d_model, n_heads * head_dim or a hidden dim
    # The whole benchmark "small" model (byte vocabulary, so the float embedding is small):
    # 0.25 + ~1/256 for scales + the float embedding, norms and routers.
    ratio = param_bytes(qmodel) / float_bytes
    assert 0.25 < ratio < 0.27, ratio


# ----------------------------------------------------------------------------- trained model


def test_logits_and_validation_perplexity_match_float(trained):
    run, run_int8 = trained
    cfg, model, tokenizer = load_run(run)
    _, qmodel, _ = load_run(run_int8)
    data = load_data(cfg, tokenizer)
    val = eval_batches(data.val, cfg.train.seq_len, cfg.train.batch_size, 8)  # as in training
    logits = np.stack([forward(model, jnp.asarray(b[:, :-1]))[0] for b in val])
    qlogits = np.stack([forward(qmodel, jnp.asarray(b[:, :-1]))[0] for b in val])
    # Weight errors of at most 1/254 of each channel's largest weight, through 2 layers and
    # the head, move the logits (std ~2.6 here) by ~0.02 (0.024 at most in most runs): 0.1
    # allowed. A routing decision within that perturbation of a tie flips, though: a top-2
    # pick, or a capacity drop near the boundary (drops go in sequence order, so one flip
    # can move later tokens' drops). Such a position's logits move wholesale (0.37 seen, at 3
    # of 2048 positions in one CI run). So at most 0.5% of the positions may be off by more
    # than 0.1, and the typical and mean errors stay small.
    position_err = np.abs(qlogits - logits).max(axis=-1)  # [N, B, T]
    assert np.mean(position_err > 0.1) <= 0.005, np.sort(position_err.ravel())[-10:]
    assert np.median(position_err) < 0.05, np.median(position_err)
    assert np.mean(np.abs(qlogits - logits)) < 0.01  # 0.004 measured

    targets = np.stack(val)[..., 1:]

    def mean_ce(logits_NBTV):
        logz = jax.nn.logsumexp(logits_NBTV, axis=-1)
        picked = np.take_along_axis(logits_NBTV, targets[..., None], axis=-1)[..., 0]
        return float(np.mean(logz - picked))

    float_ce, int8_ce = mean_ce(logits), mean_ce(qlogits)
    # The model has learned something: 0.5-0.7 nats under the unigram baseline on Python
    # 3.11's standard library (the embedded corpus), 0.28 on 3.12's, whose first files differ.
    assert float_ce < data.val_unigram_entropy - 0.2
    assert abs(np.exp(int8_ce - float_ce) - 1) < 0.02  # perplexity within 2% (0.03% measured)


def test_int8_decode_loop_is_exact_and_holds_no_float_copy_of_the_weights():
    # Two stacked blocks of [RoPE dense, NoPE MoE], no capacity drops (as generation runs),
    # logits spread enough (init_std 0.05) for greedy margins. The reference runs the stacked
    # int8 layers with lax.scan; the sampler unrolls them.
    overrides = ["model.n_layers=4", "attention.nope_interval=2", "model.scan_layers=true"]
    cfg = tiny_config(*overrides, "moe.capacity_factor=0", "model.init_std=0.05")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    qmodel = quantize_model(model)
    sampler = Sampler(qmodel)
    prompts = [[5, 17, 99, 200, 3]]  # batch 1: the decode step gathers the picked experts
    got = sampler.generate(prompts, 8, temperature=0).tokens
    np.testing.assert_array_equal(got, greedy_reference(qmodel, prompts, 8))

    # The same program's buffers (a persistent-cache hit, not a second compile). XLA would
    # hoist the loop-invariant dequantisation out of the decode loop, keeping a float copy
    # of every weight alive for the whole loop, or do every layer's at once; the model ties
    # each layer's weights to its input, so about one layer's float copy exists at a time.
    lowered = sampler.lower(prompts, 8, temperature=0)
    memory = lowered.compile().memory_analysis()
    float_bytes_of_int8 = sum(
        4 * a.size for a in jax.tree.leaves(nnx.state(qmodel, Int8Param)) if a.dtype == jnp.int8
    )
    assert memory.argument_size_in_bytes < 0.45 * param_bytes(model)  # int8 in (0.37 measured)
    # All temporaries (activations, KV cache, a layer's float weights) come to 51% of the
    # float bytes of the int8 weights (the float program's alone: 26%); a hoisted or up-front
    # dequantisation would add 100% to the float program's.
    assert memory.temp_size_in_bytes < 0.75 * float_bytes_of_int8


# ----------------------------------------------------------------------------- CLIs


def test_quantized_run_directory_loads_as_int8_and_refuses_training(trained):
    run, run_int8 = trained
    assert (run_int8 / "config.yaml").read_text().startswith("# int8 copy of ")
    cfg, model, tok = load_run(run)
    qcfg, qmodel, qtok = load_run(run_int8)
    assert qcfg == cfg and qtok.to_dict() == tok.to_dict() and is_quantized(qmodel)
    # Reading an int8 weight gives the dequantised float32 weight, as the model code expects.
    head = qmodel.head.get_raw_value()
    np.testing.assert_array_equal(qmodel.head[...], head["q"].astype(np.float32) * head["scale"])
    got, expected = nnx.state(qmodel, nnx.Param), nnx.state(quantize_model(model), nnx.Param)
    assert not is_quantized(model)  # quantize_model leaves its argument as it was
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [p.name for p in (run_int8 / "checkpoints").iterdir()] == [str(STEPS)]
    with pytest.raises(RunError, match="int8 copy of a run for inference only; train the float"):
        inspect_run(_cfg(run_int8))


def test_sample_cli_on_an_int8_run_equals_quantize_on_load(trained, capsys):
    run, run_int8 = trained
    flags = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    assert SAMPLE_MAIN(["--run", str(run_int8), *flags]) == 0
    from_run = capsys.readouterr().out
    assert SAMPLE_MAIN(["--run", str(run), "sample.weights=int8", *flags]) == 0
    assert capsys.readouterr().out == from_run and from_run.startswith("def ")


def test_mxfp4_copy_restores_packed_and_samples_as_quantising_on_load(tmp_path, capsys):
    """`--mode mxfp4`: the run directory holds the experts packed (and says so), restores
    them packed (no float copy first), and samples what `sample.weights=mxfp4` of the float
    run samples."""
    from moe_jax.inference.load import load_sampler
    from moe_jax.model.int8 import Mxfp4Param

    run, packed = tmp_path / "run", tmp_path / "run_mxfp4"
    train(_cfg(run, "moe.expert_hidden=32"), stop_at=2)
    assert quantize_main([str(run), "--out", str(packed), "--mode", "mxfp4"]) == 0
    assert "mxfp4 copy of" in capsys.readouterr().out
    assert (packed / "config.yaml").read_text().startswith("# mxfp4 copy of ")
    _, sampler, _ = load_sampler(packed)
    params = nnx.to_flat_state(nnx.state(sampler.inference_model(), Mxfp4Param))
    assert {p[-1] for p, _ in params} == {"w_gate", "w_up", "w_down"}
    _, on_load, _ = load_sampler(run, ["sample.weights=mxfp4"])
    prompts = [[5, 17, 99], [7, 1, 2, 3]]
    np.testing.assert_array_equal(
        sampler.generate(prompts, 6, temperature=0).tokens,
        on_load.generate(prompts, 6, temperature=0).tokens,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{run}", "--out", "{run_int8}"], "--out '{run_int8}' already exists"),
        (["{run}", "--out", "{run}"], "--out '{run}' already exists"),
        (["{tmp}/missing", "--out", "{tmp}/x"], "run directory '{tmp}/missing' does not exist"),
        (["{run_int8}", "--out", "{tmp}/x"], "'{run_int8}' is already int8-quantised"),
        (["{run}", "--out", "{tmp}/x", "--step", "7"], "no checkpoint for step 7"),
        (["{run}", "--out", "{tmp}/x", "--mode", "mxfp4"], "moe.expert_hidden (40) must be"),
    ],
)
def test_quantize_cli_bad_input_is_one_line_exit_2_nothing_written(
    trained, tmp_path, capsys, argv, message
):
    run, run_int8 = trained
    fill = lambda s: s.format(run=run, run_int8=run_int8, tmp=tmp_path)
    before = sorted(p.relative_to(run_int8) for p in run_int8.rglob("*"))
    assert quantize_main([fill(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fill(message) in err
    assert not (tmp_path / "x").exists()
    assert sorted(p.relative_to(run_int8) for p in run_int8.rglob("*")) == before
