"""The weights' collective floor (`moe_jax.traffic`) against counts made another way."""

import pytest

from moe_jax.summary import param_breakdown
from moe_jax.traffic import weight_collectives
from tests.helpers import tiny_config

MESH = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}


@pytest.mark.parametrize("remat, passes", [("none", 1), ("full", 2)])
def test_fsdp_only_gathers_every_weight_but_the_norms(remat, passes):
    """fsdp 8 alone: every weight but the norms has a dim split over fsdp, so each is made
    whole (bf16) once a pass and its gradient reduce-scattered once; the norms are
    replicated, their float32 gradients all-reduced. Counted from the parameter breakdown."""
    cfg = tiny_config(
        f"model.remat={remat}",
        "model.scan_layers=true",
        "train.grad_accum=2",
        "train.batch_size=16",
    )
    total = param_breakdown(cfg).total
    norms = total["norms"]
    rest = sum(total.values()) - norms
    got = weight_collectives(cfg, {**MESH, "fsdp": 8}, "bfloat16")
    assert got == {
        "all-gather": rest * 2 * passes * 2,  # bf16, each of the 2 micro-batches
        "reduce-scatter": rest * 2 * 2,
        "all-reduce": norms * 4,
    }


def test_expert_weights_are_gathered_over_fsdp_only_and_data_sums_the_shards():
    """fsdp 2 x expert 2 x data 2: a device makes whole only its own experts (1/2 of them),
    the rest over fsdp x expert (all of them); over `data` each gradient shard is summed."""
    cfg = tiny_config("model.remat=full", "model.scan_layers=true")
    total = param_breakdown(cfg).total
    experts, norms = total["routed_experts"], total["norms"]
    rest = sum(total.values()) - experts - norms
    mesh = {**MESH, "data": 2, "fsdp": 2, "expert": 2}
    got = weight_collectives(cfg, mesh, "float32")
    whole = (rest + experts // 2) * 4
    assert got["all-gather"] == 2 * whole
    assert got["reduce-scatter"] == whole
    # shards: the rest over 4 devices, the experts over 4 too (2 experts x 2 fsdp)
    assert got["all-reduce"] == (rest // 4 + experts // 4) * 4 + norms * 4
