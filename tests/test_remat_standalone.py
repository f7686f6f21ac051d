"""`model.remat` on the layers outside the layer scan (transformer.DecoderLayer standalone: the
dense prefix of moe.first_dense_layers, the tail past the last whole block, the MTP layers):
each is checkpointed like the scan's body, with the same loss and gradients as without remat.
Kept whole, DeepSeek-V3's 3 dense layers and its MTP layer held their activations through the
step beside the scan's (8192 tokens a sequence: q, k, v and the FFN's hidden of each).

Budget: tiny models (d_model 32), about 30 s on 2 idle cores.
"""

from __future__ import annotations

import jax
import jax.extend.core
import numpy as np
from flax import nnx

from moe_jax.model import Transformer
from moe_jax.train.step import loss_fn
from tests.helpers import tiny_config

# Layer 0 dense (the prefix), layers 1-2 the one scanned block, layer 3 the tail, and an
# MTP layer: every kind of layer outside the scan.
LAYERS = [
    "model.n_layers=4",
    "moe.first_dense_layers=1",
    "moe.interleave_step=2",
    "attention.nope_interval=0",
    "model.mtp_depth=1",
    "model.scan_layers=true",
    "moe.capacity_factor=1.0",
]


def checkpoints(jaxpr) -> int:
    """jax.checkpoint calls in a jaxpr, nested ones (the scan's body) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("checkpoint", "remat2")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += checkpoints(sub)
    return n


def test_layers_outside_the_scan_are_checkpointed_with_the_same_loss_and_gradients():
    toks = jax.random.randint(jax.random.key(0), (2, 17), 0, 256)
    out, counts = {}, {}
    for policy in ("none", "full"):
        extra = ["model.remat_offload=layer_input"] if policy == "full" else []
        cfg = tiny_config(*LAYERS, f"model.remat={policy}", *extra)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        assert model.n_blocks == 1 and len(model.tail) == 1 and len(model.prefix) == 1
        graphdef, params = nnx.split(model)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        counts[policy] = checkpoints(jax.make_jaxpr(loss_fn, static_argnums=(1, 3))(
            params, graphdef, toks, 1e-4
        ).jaxpr)  # fmt: skip
        out[policy] = jax.jit(grad_fn, static_argnums=(1, 3))(params, graphdef, toks, 1e-4)
    # the scan's body, the prefix's layer, the tail's and the MTP's
    assert counts == {"none": 0, "full": 4}, counts
    (loss_none, _), g_none = out["none"]
    (loss_full, _), g_full = out["full"]
    np.testing.assert_allclose(loss_full, loss_none, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g_full, g_none
    )
