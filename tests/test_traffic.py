"""The weights' collective floor (`moe_jax.aot.collectives`) against counts made another way."""

import pytest

from moe_jax.aot.collectives import weight_collectives
from moe_jax.summary.counts import param_breakdown
from tests.helpers import tiny_config

MESH = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}


@pytest.mark.parametrize("remat, passes", [("none", 1), ("full", 2)])
def test_fsdp_only_gathers_every_weight_but_the_norms(remat, passes):
    """fsdp 8 alone: every weight but the norms has a dim split over fsdp, so each is made
    whole (bf16) once a pass (the layers' twice with remat, the embedding and head once)
    and its gradient reduce-scattered once; the norms are replicated, their float32
    gradients all-reduced. Counted from the parameter breakdown."""
    over = ["model.scan_layers=true", "train.grad_accum=2", "train.batch_size=16"]
    cfg = tiny_config(f"model.remat={remat}", *over)
    total = param_breakdown(cfg).total
    norms, tables = total["norms"], total["embedding"] + total["head"]
    layers = sum(total.values()) - norms - tables
    got = weight_collectives(cfg, {**MESH, "fsdp": 8}, "bfloat16")
    assert got == {
        "all-gather": (layers * passes + tables) * 2 * 2,  # bf16, each of 2 micro-batches
        "reduce-scatter": (layers + tables) * 2 * 2,
        "all-reduce": norms * 4,
    }


def test_expert_weights_are_gathered_over_fsdp_only_and_data_sums_the_shards():
    """fsdp 2 x expert 2 x data 2: a device makes whole only its own experts (1/2 of them),
    the rest over fsdp x expert (all of them); over `data` each gradient shard is summed."""
    cfg = tiny_config("model.remat=full", "model.scan_layers=true")
    total = param_breakdown(cfg).total
    experts, norms = total["routed_experts"], total["norms"]
    tables = total["embedding"] + total["head"]
    rest = sum(total.values()) - experts - norms
    mesh = {**MESH, "data": 2, "fsdp": 2, "expert": 2}
    got = weight_collectives(cfg, mesh, "float32")
    whole = (rest + experts // 2) * 4
    assert got["all-gather"] == 2 * whole - tables * 4  # the tables once: outside the layers
    assert got["reduce-scatter"] == whole
    # shards: the rest over 4 devices, the experts over 4 too (2 experts x 2 fsdp)
    assert got["all-reduce"] == (rest // 4 + experts // 4) * 4 + norms * 4


def test_a_context_axis_all_reduces_every_weight_gradient_over_its_shards():
    """fsdp 4 x context 2: the fsdp-split weights as at fsdp alone (gathered, reduce-scattered
    over fsdp), and then every gradient shard summed over the 2 sequence shards, which
    split no weight: the gathered ones' in bf16, the norms' in float32."""
    cfg = tiny_config("train.batch_size=16")
    total = param_breakdown(cfg).total
    norms, rest = total["norms"], sum(total.values()) - total["norms"]
    got = weight_collectives(cfg, {**MESH, "fsdp": 4, "context": 2}, "bfloat16")
    assert got["all-reduce"] == norms * 4 + rest // 4 * 2
