"""Sampling a run restored onto a mesh: the weights sharded as they are read (bf16, int8 or
fp32), decode under expert, tensor and fsdp parallelism; the reference is the same run sampled
on one device. Greedy tokens must agree exactly: the sharded program sums the same products in
another order (fp32 differences ~1e-6), far below the reference's top-2 logit margins, which
`greedy_reference` in test_sampling.py shows are > 1e-4 for these seeds.

Budget: ~40 s (one tiny run written, then a handful of tiny compiles)."""

from __future__ import annotations

import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import sampling_config
from moe_jax.data.corpus import train_iterator
from moe_jax.inference.load import load_run, load_sampler
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.model.int8 import Int8Param
from moe_jax.run.checkpoints import Checkpointer
from moe_jax.run.layout import RunError
from moe_jax.sharding import make_mesh, state_shardings
from moe_jax.tokenizer import ByteTokenizer
from moe_jax.train.step import make_optimizer
from tests.helpers import forward, randomize_biases, tiny_config

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_MAIN = runpy.run_path(str(ROOT / "sample.py"))["main"]
N_NEW = 10
# Two layers, both MoE (4 experts, top-2, with biases), stored as a layer scan; 8 devices hold
# meshes of expert 4 x data 2, tensor 2 x expert 2 x data 2, and fsdp 8.
RUN = [
    "model.n_layers=2",
    "moe.interleave_step=1",
    "attention.nope_interval=0",
    "model.scan_layers=true",
    "moe.expert_bias=true",  # random (see save_run): a bias must be added once, not per shard
]
MESHES = {
    "expert": ["mesh.expert=4", "mesh.data=2"],
    "tensor": ["mesh.tensor=2", "mesh.expert=2", "mesh.data=2"],
    "fsdp": ["mesh.fsdp=8"],
}


def prompts(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    return [rng.integers(0, 256, n).tolist() for n in (5, 11, 13, 7, 9, 3, 12, 6)[:batch]]


def save_run(run_dir: Path, mesh_overrides=()) -> None:
    """A run of randomly initialised params (std 0.05, so greedy picks are not near-ties),
    saved from params sharded over the mesh `mesh_overrides` describes (if any)."""
    cfg = tiny_config(*RUN, "model.init_std=0.05", f"run_dir={run_dir}", *mesh_overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    randomize_biases(model)
    graphdef, params = nnx.split(model, nnx.Param)
    if mesh_overrides:
        params = jax.device_put(params, state_shardings(params, make_mesh(cfg)))
    it = train_iterator(np.arange(4096, dtype=np.int32) % 256, 16, 8, 0)
    ckpt = Checkpointer(cfg)
    try:
        meta = {"config": cfg, "tokenizer": ByteTokenizer(), "fingerprint": "f00d"}
        ckpt.save(1, params, make_optimizer(cfg.train).init(params), it, meta)
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    save_run(run_dir)
    return run_dir


def sample(run_dir, overrides=(), batch=8, weights="float32"):
    """Greedy tokens of `prompts(batch)` from the run restored as `overrides` say, and the
    model as the sampler holds it."""
    _, sampler, _ = load_sampler(run_dir, [*overrides, f"sample.weights={weights}"])
    tokens = sampler.generate(prompts(batch), N_NEW, temperature=0).tokens
    return tokens, sampler.inference_model()


@pytest.fixture(scope="module")
def single(run):
    """Single-device greedy tokens: batch 8 (expert-parallel on the meshes: rows split over
    the batch axes) and batch 1 (tokens replicated, each device running its own experts)."""
    return {b: sample(run, batch=b)[0] for b in (8, 1)}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("batch", [8, 1])
def test_sharded_greedy_equals_single_device(run, single, mesh, batch):
    tokens, model = sample(run, MESHES[mesh], batch)
    np.testing.assert_array_equal(tokens, single[batch])


@pytest.mark.parametrize("mesh", ["expert", "tensor", "fsdp"])
def test_sharded_forward_logits_equal_single_device(run, mesh):
    """The MoE layers' mesh paths, value for value: a batch of 4 rows (expert-parallel where
    the batch axes split it: the tensor mesh's 4 batch shards; replicated on the others) and of
    1 row (replicated: each device its own experts) give the single-device logits, to float32
    summation-order tolerance (1e-5; the logits are O(1))."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 16)), jnp.int32)
    _, alone, _ = load_sampler(run)
    want = forward(alone.inference_model(), tokens)[0]
    _, sharded, _ = load_sampler(run, MESHES[mesh])
    with jax.set_mesh(sharded.mesh):
        model = sharded.inference_model()
        got4, got1 = forward(model, tokens)[0], forward(model, tokens[:1])[0]
    np.testing.assert_allclose(got4, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got1, want[:1], rtol=1e-5, atol=1e-5)


def test_restored_weights_are_sharded_and_the_stacked_copy_freed(run):
    cfg = sampling_config(load_run(run)[0], MESHES["expert"])
    mesh = make_mesh(cfg, inference=True)
    _, model, _ = load_run(run, cfg=cfg, mesh=mesh)
    w_gate = model.blocks.layers[0].ffn.experts.w_gate[...]  # [block, expert, D, F]
    assert w_gate.sharding.spec[1] == "expert" and w_gate.sharding.mesh == mesh
    assert w_gate.addressable_shards[0].data.shape == (2, 1, *w_gate.shape[2:])  # 1 of 4
    # Inference never splits the non-expert weights' model dim over `expert` (each decode
    # step would gather them): attention weights are whole on every device here.
    wq = model.blocks.layers[0].attn.wq[...]
    assert wq.addressable_shards[0].data.shape == wq.shape
    sampler = Sampler(model, mesh=mesh, consume=True)
    assert w_gate.is_deleted()  # held once: the per-block split replaced the stacked array
    assert sampler.param_blocks[0]["layers"][0]["ffn"]["experts"]["w_gate"].sharding.spec[0]


def test_bf16_weights_change_nothing_under_a_bf16_compute(run):
    """`auto` weights with model.dtype=bfloat16 are bf16 (half the bytes), and since the
    model casts every matmul weight to its compute dtype anyway, the tokens are the fp32
    weights' exactly (not merely close)."""
    bf16 = ["model.dtype=bfloat16"]
    want, _ = sample(run, bf16, weights="float32")
    got, model = sample(run, bf16, weights="auto")
    np.testing.assert_array_equal(got, want)
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    assert model.blocks.layers[0].ffn.router[...].dtype == jnp.float32
    assert model.final_norm.scale[...].dtype == jnp.float32


def test_int8_sharded_equals_int8_single_device(run):
    want, _ = sample(run, weights="int8")
    got, model = sample(run, MESHES["tensor"], weights="int8")
    np.testing.assert_array_equal(got, want)
    w = model.blocks.layers[0].ffn.experts.w_gate
    assert isinstance(w, Int8Param) and w.get_raw_value()["q"].sharding.spec[1] == "expert"


def test_an_int8_run_restores_sharded(run, tmp_path):
    """A run written by `moe_jax.quantize` restores its int8 values and scales onto the mesh
    (split like the float weights), and samples as quantising on load does (on the mesh of
    the test above: the programs are the same, compiled once)."""
    from moe_jax.quantize import quantize_run

    quantize_run(run, tmp_path / "int8")
    want, _ = sample(run, weights="int8")
    got, model = sample(tmp_path / "int8", MESHES["tensor"])
    np.testing.assert_array_equal(got, want)
    raw = model.blocks.layers[0].ffn.experts.w_gate.get_raw_value()
    assert raw["q"].sharding.spec[1] == "expert" and raw["scale"].sharding.spec[1] == "expert"


def test_a_run_saved_on_one_mesh_samples_on_another(tmp_path, single):
    run_dir = tmp_path / "run"
    save_run(run_dir, MESHES["expert"])  # written from expert-sharded params
    tokens, _ = sample(run_dir, MESHES["tensor"])
    np.testing.assert_array_equal(tokens, single[8])
    tokens, _ = sample(run_dir)  # and onto one device
    np.testing.assert_array_equal(tokens, single[8])


def test_cli_samples_on_a_mesh(run, capsys):
    argv = ["--run", str(run), "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0"]
    assert SAMPLE_MAIN(argv) == 0
    alone = capsys.readouterr().out
    assert SAMPLE_MAIN([*argv, *MESHES["expert"]]) == 0  # streamed from the sharded program
    assert capsys.readouterr().out == alone


@pytest.mark.parametrize(
    "extra, message",
    [
        (["mesh.expert=3"], "moe.n_experts (4) must be divisible by mesh.expert (3)"),
        (["mesh.expert=2"], "has 2 devices but 8 are available"),
        (["model.d_model=64"], "'model.d_model' cannot be set when sampling"),
        (["sample.weights=int4"], "sample.weights"),
    ],
)
def test_cli_bad_mesh_or_override_is_one_line(run, capsys, extra, message):
    assert SAMPLE_MAIN(["--run", str(run), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_weights_that_do_not_fit_are_refused_before_reading(run, monkeypatch, capsys):
    """CPU devices share the host's memory: all shards together must fit what it has."""
    import moe_jax.inference.weights

    cfg = load_run(run)[0]
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    fp32_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    monkeypatch.setattr(moe_jax.inference.weights, "host_memory", lambda: fp32_bytes)
    load_run(run)  # exactly enough
    monkeypatch.setattr(moe_jax.inference.weights, "host_memory", lambda: fp32_bytes - 1)
    with pytest.raises(RunError, match="the weights need .* GiB per device"):
        load_run(run)
    load_run(run, weights="bfloat16")  # smaller: fits
    # 8 devices, fsdp-sharded: the same bytes in all; bf16 + int8 (quantised after): more
    assert SAMPLE_MAIN(["--run", str(run), "mesh.fsdp=8"]) == 2
    assert "sample.weights=bfloat16 or int8" in capsys.readouterr().err
    assert SAMPLE_MAIN(["--run", str(run), "sample.weights=int8"]) == 2


def test_kv_cache_splits_over_batch_and_kv_heads():
    from moe_jax.inference.decoding import shard_cache

    cfg = tiny_config(*RUN, "mesh.tensor=2", "mesh.expert=2", "mesh.data=2")
    mesh = make_mesh(cfg, inference=True)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    with jax.set_mesh(mesh):
        cache = jax.jit(lambda: shard_cache(model.init_cache(4, 32)))()
        k = cache["blocks"][0]["k"]  # [block, B, S, kv heads, head_dim]
        want = NamedSharding(mesh, P(None, ("data", "expert"), None, "tensor", None))
        assert k.sharding.is_equivalent_to(want, k.ndim)
        odd = jax.jit(lambda: shard_cache(model.init_cache(3, 32)))()  # 3 rows: replicated
        want = NamedSharding(mesh, P(None, None, None, "tensor", None))
        assert odd["blocks"][0]["k"].sharding.is_equivalent_to(want, k.ndim)


def test_prefill_computes_the_head_only_at_each_rows_last_position():
    """No [B, P, V] logits anywhere in the program: the head runs on [B, 1, D]."""
    cfg = tiny_config(*RUN)
    sampler = Sampler(Transformer(cfg, rngs=nnx.Rngs(0)))
    text = sampler.lower(prompts(4), N_NEW).as_text()  # prompts bucketed to 16 positions
    V = cfg.model.vocab_size
    assert f"tensor<4x1x{V}xf32>" in text and f"tensor<4x16x{V}xf32>" not in text
