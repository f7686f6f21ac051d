"""What the context axis (mesh.context, moe_jax/model/context_parallel.py) composes with,
each against the unsplit run: micro-batches (train.grad_accum) and MLA without q-LoRA under
both strategies, a resumed run, compiling for a TPU slice (`moe_jax.aot`); and the memory
of its attention, which must grow linearly with the sequence (online_softmax.py).
"""

import jax
import pytest

from moe_jax.observe.writers import read_metrics
from tests.helpers import resumed_copy_equals, tiny_config
from tests.test_context_parallel import MLA, assert_same, loss_and_grads
from tests.test_train import TINY

# MLA with W_q x for the queries (one layer: the other is the same program again), and the
# batch in two micro-batches of 2 rows each.
NO_Q_LORA = [*MLA, "attention.q_lora_rank=0", "train.grad_accum=2", "model.n_layers=1"]


@pytest.fixture(scope="module")
def no_q_lora_unsplit():
    return loss_and_grads(*NO_Q_LORA)


@pytest.mark.parametrize(
    "split",
    [
        ["mesh.context=4", "mesh.tensor=2", "mesh.context_strategy=all_gather"],
        # a micro-batch's 2 rows over data 2 (the step's micro-batches split by rows)
        ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "mesh.context_strategy=ring"],
    ],
    ids=["all_gather_context4_tensor2", "ring_data2_context2_tensor2"],
)
def test_mla_without_q_lora_in_micro_batches_equals_the_unsplit_run(no_q_lora_unsplit, split):
    """float32, 2e-5 as tests/test_context_parallel.py: the micro-batches are laid out over
    the axis one at a time (the step's scan), their gradients summed."""
    assert_same(loss_and_grads(*NO_Q_LORA, *split), no_q_lora_unsplit)


def test_a_context_parallel_run_resumes_exactly(tmp_path):
    """A 4-step run on data 2 x context 4 (one MoE layer) and a copy of it resumed from its step-2
    checkpoint: the same compiled step on the same inputs, so bit-identical params and
    losses only if the state and the data position came back whole."""
    overrides = [*TINY, "mesh.data=2", "mesh.context=4", "checkpoint.every=2"]
    overrides += [
        "model.n_layers=1",
        "moe.interleave_step=1",
        "train.batch_size=4",
        "train.seq_len=16",
    ]
    straight, resumed = resumed_copy_equals(overrides, tmp_path)
    losses = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if r["kind"] == "train"}
    assert [losses(resumed)[s] for s in (3, 4)] == [losses(straight)[s] for s in (3, 4)]


def test_a_context_parallel_train_step_compiles_for_tpu_in_less_memory_per_chip():
    """`moe_jax.aot` compiles the step of one 512-token sequence for one v5e chip and split
    over 4 (mesh.context=4): it fits, its key-block loops have known trip counts (so the
    FLOPs count them), the keys travel by all-gather, and the peak a chip holds falls."""
    pytest.importorskip("libtpu", reason="the `aot` extra (libtpu) is not installed")
    from moe_jax.aot import command as aot
    from moe_jax.aot.topology import get_topology

    one_row = ["model.n_layers=1", "train.seq_len=512", "train.batch_size=1"]
    reports = {}
    for topology, n in (("v5e-1", 1), ("v5e-4", 4)):
        cfg = tiny_config(*one_row, f"mesh.context={n}")
        with jax.default_matmul_precision("default"):  # as tests/test_aot.py compiles
            reports[n] = aot.compile_step(cfg, get_topology(topology), "train")
    split = reports[4]
    assert split["fits"] and split["mesh"]["context"] == 4
    assert split["loops_of_unknown_trip_count"] == 0
    assert split["collectives"]["all-gather"]["count"] > 0
    # measured 1.76 -> 0.94 MB at 128 tokens, 18.0 -> 3.0 MB at 2048 (the params and the
    # optimizer's state, replicated, weigh less as the sequence grows)
    assert split["bytes"]["peak"] < reports[1]["bytes"]["peak"] / 2


def _attention_temp_bytes(strategy: str, T: int) -> int:
    """Temp bytes of the compiled gradient of context-parallel attention (data 4 x context
    2: the ring unrolls a step per shard; 4 heads over 2 K/V heads, 16-key blocks) over
    rows of `T` tokens."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_jax.model import context_parallel
    from moe_jax.sharding import make_mesh

    mesh = make_mesh(tiny_config("mesh.data=4", "mesh.context=2", f"train.seq_len={T}"))
    attend = lambda *a: context_parallel.self_attention(
        *a, scale=1.0, strategy=strategy, key_block=16
    )
    loss = lambda q, k, v, pos: jax.numpy.sum(attend(q, k, v, pos) ** 2)
    x = NamedSharding(mesh, P("data", "context"))
    shape = lambda *s, dtype="float32": jax.ShapeDtypeStruct(s, dtype, sharding=x)
    args = (shape(4, T, 4, 8), shape(4, T, 2, 8), shape(4, T, 2, 8), shape(4, T, dtype="int32"))
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_attention_memory_grows_linearly_with_the_sequence(strategy):
    """4x the tokens: ~4x the temp bytes of attention's forward and backward (each step's
    logits [C, 16], the probabilities recomputed), not the ~14x of [C, T] logits kept for
    the backward (measured before online_softmax.py: 1.9 -> 26 MB at 512 -> 2048 tokens)."""
    short, long = (_attention_temp_bytes(strategy, T) for T in (128, 512))
    assert long / short < 5, (short, long)
