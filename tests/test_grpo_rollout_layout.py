"""GRPO's rollouts drawn from a copy of the params laid out for sampling (`rl.collect`,
`sharding.rollout_mesh`) against the draws from the params as training lays them out (the
path before it, on the trainer's mesh): the same rows (tokens, routes, rewards exactly,
log-probs within 1e-5: the same program on differently split weights sums in another order);
the train state's params untouched by the copy the sampler consumes, where the two layouts
coincide too; the compiled sampler gathering no weight (`hlo.weight_gathers`), where the
training layout's program gathers every fsdp-split one.
Budget: ~25 s on 2 loaded CPU cores (2 draws and 2 compiles a mesh).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax.aot import hlo
from moe_jax.aot.grpo import lower_sample
from moe_jax.data.prompts import load_prompts
from moe_jax.model import Transformer
from moe_jax.posttrain.rl.collect import Rollouts
from moe_jax.sharding import create_sharded, make_mesh
from tests.helpers import assert_same_rollout_rows
from tests.test_grpo import grpo_config, sums, write_jsonl

MESHES = {  # 8 simulated devices; batch 8 divides the batch axes
    "data2_fsdp2_expert2": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
}


def setup(tmp_path, mesh_overrides):
    path = write_jsonl(tmp_path / "p.jsonl", sums(8))
    cfg = grpo_config(
        path, "model.init_std=0.05", "train.batch_size=8", "rl.max_prompt_len=8", *mesh_overrides
    )
    mesh = make_mesh(cfg)
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    return cfg, mesh, graphdef, params, load_prompts(cfg)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_rollouts_in_the_sampling_layout_equal_the_training_layouts(tmp_path, mesh_name):
    """The same rows from both layouts; the new path's compiled sampler gathers no weight
    (the old one's gathers each weight split over fsdp or expert), and its copy is dropped
    after the draw."""
    cfg, mesh, graphdef, params, data = setup(tmp_path, MESHES[mesh_name])
    rows, gathers = {}, {}
    with jax.set_mesh(mesh):  # as the trainer's loop runs
        for laid_out in (False, True):
            rollouts = Rollouts(cfg, graphdef, data, mesh if laid_out else None)
            rows[laid_out] = rollouts({"params": params}, {"index": np.array([0, 3])}, step=5)
            assert rollouts.sampler.params is None  # released after the draw
            sampler = rollouts._sampler(params)
            text = lower_sample(cfg, sampler, sampler.mesh or mesh).compile().as_text()
            n_weights = len(jax.tree.leaves(sampler._weights()))
            gathers[laid_out] = hlo.weight_gathers(text, n_weights)
    assert_same_rollout_rows(rows[True], rows[False])
    assert len(gathers[False]) >= 8, "the training layout's weights are gathered"
    assert gathers[True] == [], [g.type for g in gathers[True]]


def test_the_copy_the_sampler_consumes_leaves_the_train_params_whole(tmp_path):
    """Mesh data 8: the training and sampling layouts coincide (nothing split), where a
    reshard may hand back the same arrays; the sampler still takes a copy of the stacked
    blocks to consume, so after two steps' draws (the second swapping weights into the
    built sampler) the train params are alive and unchanged, and the draws those of the
    params as they are."""
    cfg, mesh, graphdef, params, data = setup(tmp_path, ["mesh.data=8"])
    before = jax.tree.map(np.asarray, params)
    with jax.set_mesh(mesh):
        laid = Rollouts(cfg, graphdef, data, mesh)
        plain = Rollouts(cfg, graphdef, data)
        for step in (1, 2):
            got = laid({"params": params}, {"index": np.array([1, 2])}, step=step)
            want = plain({"params": params}, {"index": np.array([1, 2])}, step=step)
            np.testing.assert_array_equal(got["tokens"], want["tokens"])
            np.testing.assert_allclose(got["old_logp"], want["old_logp"], atol=1e-5, rtol=0)
    after = jax.tree.map(np.asarray, params)  # raises on a deleted array
    jax.tree.map(np.testing.assert_array_equal, after, before)
