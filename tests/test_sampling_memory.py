"""Sampling bf16 weights on CPU (issue 49): XLA:CPU neither multiplies nor gathers bf16, so
each weight is converted to float32 where it is used; those copies must exist a part at a
time, not all at once, and nothing sampled may change (`moe_jax.model.in_turn`).

Memory is read from the compiled program (`memory_analysis()`: its temporaries, not a run).
Tokens and log-probs are compared with the same weights held as float32 (the bf16 values
exactly): what the sampler computed before, every bf16 weight converted whole. The converted
values are the same; only the head's matmul is cut into chunks of the vocabulary, which
XLA:CPU sums in another order where several rows share it (log-probs 5e-7 apart at batch 4,
equal at batch 1), so the tokens are equal and the log-probs within float32 rounding.
Budget: ~15 s on 2 CPU cores (tiny models; six sampler compiles).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import backends
from moe_jax.inference.sampling import Sampler
from moe_jax.inference.weights import to_kind
from moe_jax.model import Transformer
from moe_jax.model import in_turn as convert
from tests.helpers import tiny_config

# Four MoE layers (8 experts, top-2) whose weights together are several times the largest one
# (the head [64, 4096], and the embedding as large): every layer's float32 copies at once
# would show. Layers alternate RoPE / NoPE.
CONFIG = [
    "model.init_std=0.05",
    "model.n_layers=4",
    "model.d_model=64",
    "model.vocab_size=4096",
    "attention.nope_interval=2",
    "moe.interleave_step=1",
    "moe.n_experts=8",
    "moe.expert_hidden=128",
]
ONE = [[5, 17, 99, 200, 3]]  # batch 1: the decode step gathers its 2 experts' weights
# Batch 4, bucket 64: the prefill runs each expert on its filled rows (256 slots); decoding,
# 4 x 2 assignments reach all 8 experts' buffers (a batched matmul over the experts).
FOUR = [list(range(1, 6)), list(range(1, 41)), list(range(7, 20)), list(range(9, 16))]
N_NEW = 6


@pytest.fixture(scope="module")
def models():
    """The model with bf16 weights (sample.weights=bfloat16; computing in float32 on CPU),
    and the same values as float32 weights."""
    cfg = tiny_config(*CONFIG)
    bf16 = to_kind(Transformer(cfg, rngs=nnx.Rngs(0)), "bfloat16")
    f32 = Transformer(cfg, rngs=nnx.Rngs(1))
    nnx.update(f32, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(bf16, nnx.Param)))
    return bf16, f32


def largest_f32_bytes(model) -> int:
    return 4 * max(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


def temp_bytes(sampler: Sampler, prompts) -> int:
    compiled = sampler.lower(prompts, N_NEW, temperature=0).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_bf16_weights_are_converted_a_part_at_a_time_never_all_at_once(models, monkeypatch):
    bf16, _ = models
    largest = largest_f32_bytes(bf16)  # the head's float32 copy, 1 MiB
    weights = sum(a.nbytes for a in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
    assert weights > 2.5 * largest  # the bf16 weights: 2.6x the largest's float32 copy
    # Whole, each weight converted in its turn: about one float32 copy of the largest at a
    # time (1.04x measured). Before: every weight's float32 copy, for the whole decode loop
    # (5.5x: hoisted out of it, and every layer's scheduled up front).
    assert temp_bytes(Sampler(bf16), ONE) < 2 * largest
    # In parts of at most 1/32 of it (the head in 32 chunks, the experts one at a time): no
    # weight's whole float32 copy exists (0.31x measured: the activations, the KV cache and
    # about one layer's attention weights).
    monkeypatch.setattr(convert, "CHUNK_BYTES", largest // 32)
    assert temp_bytes(Sampler(bf16), ONE) < 0.5 * largest


# Batch 1 with the weights whole (the first program above again); batch 4 with the head in 5
# chunks of 820 columns (the last overlapping the one before) and the decode step's batched
# matmul over the experts 4 at a time (the largest group dividing 8 within the bytes; the
# prefill's experts run one at a time on their filled rows, each converted whole).
@pytest.mark.parametrize(
    "prompts, chunk_bytes", [(ONE, convert.CHUNK_BYTES), (FOUR, 64 * 820 * 4)], ids=["1", "4"]
)
def test_tokens_and_logprobs_are_those_of_converting_every_weight_whole(
    models, prompts, chunk_bytes, monkeypatch
):
    bf16, f32 = models
    want = Sampler(f32).generate(prompts, N_NEW, temperature=0, record=True)
    monkeypatch.setattr(convert, "CHUNK_BYTES", chunk_bytes)
    got = Sampler(bf16).generate(prompts, N_NEW, temperature=0, record=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0 if prompts is ONE else 1e-6)
    assert (want.tokens >= 0).all()  # every row generated N_NEW tokens: nothing skipped


def test_taken_stacked_blocks_split_on_cpu_without_a_copy():
    """`Sampler(model, consume=True)` (as `load_sampler` builds it): each layer block's
    weights are views of the stacked arrays' memory holding block b's values, so splitting
    holds nothing twice and the program gets the very values a copy would have. (Blocks the
    runtime cannot take in place, smaller than its 64-byte alignment, are copied.)"""
    model = Transformer(tiny_config("attention.nope_interval=2"), rngs=nnx.Rngs(0))
    stacked = jax.tree.leaves(nnx.state(model.blocks, nnx.Param))
    spans = [(a.unsafe_buffer_pointer(), a.nbytes) for a in stacked]
    values = [np.asarray(a) for a in stacked]
    sampler = Sampler(model, consume=True)
    n = len(sampler.param_blocks)
    assert n == 2  # blocks of 2 layers: [RoPE dense, NoPE MoE]
    views = 0
    for b, block in enumerate(sampler.param_blocks):
        for (start, size), v, part in zip(spans, values, jax.tree.leaves(block), strict=True):
            if size // n % 64 == 0:
                assert part.unsafe_buffer_pointer() == start + b * size // n
                views += 1
            np.testing.assert_array_equal(np.asarray(part), v[b])
    assert views == 2 * (len(stacked) - 4)  # all but the QK-norm scales (32 bytes a block)


def test_dense_conversion_keeps_the_weights_gradient():
    """The tie's detour through the bits has no derivative; the conversion's is kept (a
    LoRA fine-tune's bf16 base on CPU is converted by the same code)."""
    w = jax.random.normal(jax.random.key(0), (8, 5)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (3, 8))
    loss = lambda conv: lambda w, x: jnp.sum(jnp.tanh(x @ conv(w, x)))
    tied = jax.grad(loss(lambda w, x: convert.dense(w, jnp.float32, x)), argnums=(0, 1))(w, x)
    plain = jax.grad(loss(lambda w, x: w.astype(jnp.float32)), argnums=(0, 1))(w, x)
    for a, b in zip(tied, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_only_the_cpu_converts_in_turn_and_drops_the_loop_motion():
    assert convert.in_turn(jnp.bfloat16, jnp.float32)
    assert backends.loop_compiler_options(True) == backends.LOOP_COMPILER_OPTIONS
    assert not convert.in_turn(jnp.float32, jnp.float32)  # float32 weights: as before
    assert not convert.in_turn(jnp.bfloat16, jnp.bfloat16)
    assert backends.loop_compiler_options(False) is None
    for accelerator in ("gpu", "tpu"):  # bf16 compute there: nothing is converted
        with backends.targeting(accelerator):
            assert not convert.in_turn(jnp.bfloat16, jnp.float32)
            assert backends.loop_compiler_options(True) is None
