"""DeepSeek-V3's multi-token prediction (moe_jax/model/mtp.py): the MTP loss against a
computation by hand, the shared embedding and head, gradient accumulation, a mesh, the
parameter count, and the one-line refusals. Speculative decoding with it:
tests/test_speculative.py.

Budget: tiny models (d_model 32, 2 layers), well under a minute on 2 idle cores.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.config import ConfigError, load_config
from moe_jax.model import Transformer, weight_gather
from moe_jax.sharding import BATCH_AXES, make_mesh
from moe_jax.summary.counts import (
    _human,
    attention_dims,
    format_summary,
    mtp_stored,
    param_breakdown,
    param_counts,
    train_flops_per_token,
)
from moe_jax.train.step import compute_grads, init_state, loss_fn, make_optimizer
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
# tiny.yaml at 2 layers: layer 1 dense, layer 2 MoE (NoPE with temperature tuning), so the
# MTP layer (the last layer's kind) is MoE with NoPE.
TWO_LAYERS = ["model.n_layers=2"]


def rms(x, scale, eps=1e-5):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def randomize_mtp_norms(model, seed=0):
    """Norm scales start at 1, where enorm and hnorm (or head_norm and the final norm) would be
    interchangeable: give the MTP's their own values."""
    keys = iter(jax.random.split(jax.random.key(seed), 3 * len(model.mtp)))
    for layer in model.mtp:
        for norm in (layer.enorm, layer.hnorm, layer.head_norm):
            norm.scale[...] = 1 + 0.5 * jax.random.normal(next(keys), norm.scale[...].shape)


def packed_batch(B=2, T1=13, seed=0):
    """Packed rows: row 0 holds documents 1 (6 tokens) and 2 (5), then padding; row 1 one
    document; a loss mask with holes; positions restarting at each document."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (B, T1)).astype(np.int32)
    segments = np.array([[1] * 6 + [2] * 5 + [0] * (T1 - 11), [1] * T1], np.int32)
    positions = np.zeros_like(segments)
    for b in range(B):
        for t in range(1, T1):
            same = segments[b, t] == segments[b, t - 1]
            positions[b, t] = positions[b, t - 1] + 1 if same else 0
    loss_mask = (rng.random((B, T1)) > 0.25).astype(np.int32)
    batch = {"tokens": tokens, "segments": segments, "positions": positions}
    return {k: jnp.asarray(v) for k, v in (batch | {"loss_mask": loss_mask}).items()}


def hand_weights(batch, k):
    """Depth k's counted targets by explicit loops: position t predicts token t+k+1, which
    must be in the row, in t's document (every token from t to t+k+1), and in the loss mask."""
    seg, mask = np.asarray(batch["segments"]), np.asarray(batch["loss_mask"])
    B, T = seg.shape[0], seg.shape[1] - 1
    w = np.zeros((B, T), np.float32)
    for b in range(B):
        for t in range(T):
            target = t + k + 1
            if target > T or seg[b, t] == 0 or mask[b, target] == 0:
                continue
            w[b, t] = all(seg[b, j] == seg[b, t] for j in range(t, target + 1))
    return w


# ----------------------------------------------------------------------------- the loss


def test_mtp_loss_equals_a_computation_by_hand():
    """Two depths on a packed batch with a loss mask: the norms, the order of the
    concatenation, eh_proj, the shifts of the tokens and targets, the depth's own output
    norm, the shared head, the chain h_1 -> h_2, the counted targets per depth, lambda / D,
    and the MTP routers counted among the MoE layers of the aux loss. The decoder layers run
    as the model's own modules (tested elsewhere, jitted here: eager, the forward alone took
    4 s); everything around them is plain jnp here. Tolerance 1e-5 relative: the same float32
    arithmetic, fused into one program there, in several here."""
    lam = 0.3
    cfg = tiny_config(*TWO_LAYERS, "model.mtp_depth=2", f"train.mtp_loss_weight={lam}")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    randomize_mtp_norms(model)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = packed_batch()
    loss, metrics = jax.jit(loss_fn, static_argnums=(1, 3))(params, graphdef, batch, 0.0)

    tokens = np.asarray(batch["tokens"])
    inputs = {k: batch[k][:, :-1] for k in ("tokens", "positions", "segments")}
    positions, segments = inputs["positions"], inputs["segments"]
    forward = nnx.jit(lambda m, t, p, s: m(t, positions=p, segments=s, head=False))
    x, aux = forward(model, inputs["tokens"], positions, segments)
    # (x, cache, MoE stats): the DSA carry the layer also returns is not needed here
    decoder_layer = nnx.jit(lambda layer, x, p, s: layer(x, p, None, 1, s)[:3])
    E, head = model.embed.embedding[...], model.head[...]
    logp = lambda h, norm: jax.nn.log_softmax(rms(h, norm.scale[...]) @ head, axis=-1)
    B, T = inputs["tokens"].shape

    def ce_mean(lp, targets, w):
        picked = np.take_along_axis(np.asarray(lp), targets[..., None], -1)[..., 0]
        return float(-(picked * w).sum() / w.sum())

    main_w = hand_weights(batch, 0)
    ce_main = ce_mean(logp(x, model.final_norm), tokens[:, 1:], main_w)
    h, ces, lbs, zs = x, [], [], []
    for k, layer in enumerate(model.mtp, start=1):
        ahead = np.zeros((B, T), np.int32)
        ahead[:, : T + 1 - k] = tokens[:, k:]  # token t+k; 0 past the row
        targets = np.zeros((B, T), np.int32)
        targets[:, : T - k] = tokens[:, k + 1 :]  # token t+k+1
        e = rms(E[ahead], layer.enorm.scale[...])
        hn = rms(h, layer.hnorm.scale[...])
        merged = jnp.concatenate([e, hn], axis=-1) @ layer.eh_proj[...]
        h, _, stats = decoder_layer(layer.layer, merged, positions, segments)
        ces.append(ce_mean(logp(h, layer.head_norm), targets, hand_weights(batch, k)))
        lbs.append(stats["lb_loss"])
        zs.append(stats["z_loss"])
    n_main = aux["expert_load"].shape[0]
    lb = (aux["lb_loss"] * n_main + sum(lbs)) / (n_main + 2)
    z = (aux["z_loss"] * n_main + sum(zs)) / (n_main + 2)
    aux_loss = cfg.moe.lb_loss_weight * lb + cfg.moe.z_loss_weight * z

    np.testing.assert_allclose(metrics["ce"], ce_main, rtol=1e-5)
    np.testing.assert_allclose(metrics["mtp_ce"], np.mean(ces), rtol=1e-5)
    np.testing.assert_allclose(metrics["lb_loss"], lb, rtol=1e-5)
    np.testing.assert_allclose(loss, ce_main + aux_loss + lam / 2 * sum(ces), rtol=1e-5)
    for k in (1, 2):  # the counted targets, exactly
        assert float(metrics["mtp_n_targets"][k - 1]) == hand_weights(batch, k).sum() > 0
    assert metrics["mtp_expert_load"].shape == (2, cfg.moe.n_experts)


def test_embedding_and_head_are_shared_and_the_mtp_loss_trains_trunk_and_mtp_layer():
    """One embedding and one head whatever the depth: the MTP adds only its own layers, drawn
    after the rest (the main params are those of the model without MTP, same seed), and the
    MTP loss's gradient (lambda 1 minus lambda 0, aux losses off so that nothing else
    reaches the MTP layer) reaches the embedding, the head, the main layers and every MTP
    parameter, while the main loss alone leaves every MTP parameter's gradient exactly 0."""
    common = [*TWO_LAYERS, "moe.lb_loss_weight=0", "moe.z_loss_weight=0"]
    plain = nnx.state(Transformer(tiny_config(*common), rngs=nnx.Rngs(0)), nnx.Param)
    cfg1 = tiny_config(*common, "model.mtp_depth=1", "train.mtp_loss_weight=1")
    cfg0 = tiny_config(*common, "model.mtp_depth=1", "train.mtp_loss_weight=0")
    model = Transformer(cfg1, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(params))
    for path, v in nnx.to_flat_state(plain):
        np.testing.assert_array_equal(flat[path][...], v[...], err_msg=str(path))
    V, D = cfg1.model.vocab_size, cfg1.model.d_model
    mtp_paths = [p for p in flat if p[0] == "mtp"]
    assert not [p for p in mtp_paths if flat[p][...].shape in ((V, D), (D, V))]
    assert len(flat) == len(dict(nnx.to_flat_state(plain))) + len(mtp_paths)

    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256, jnp.int32)
    grads = {}
    for lam, cfg in ((1, cfg1), (0, cfg0)):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda c=cfg: Transformer(c, rngs=nnx.Rngs(0))))
        grad = jax.jit(jax.grad(lambda p, g=graphdef: loss_fn(p, g, tokens, 0.0)[0]))
        grads[lam] = dict(nnx.to_flat_state(grad(params)))
    mtp_grad = {p: grads[1][p][...] - grads[0][p][...] for p in flat}
    trunk = [("embed", "embedding"), ("head",), ("tail", 0, "attn", "wq")]
    for path in [*trunk, ("tail", 1, "ffn", "router"), *mtp_paths]:
        assert float(jnp.abs(mtp_grad[path]).max()) > 0, path
    for path in mtp_paths:
        assert float(jnp.abs(grads[0][path][...]).max()) == 0, path


def test_grad_accumulation_with_mtp_equals_the_whole_batch():
    """grad_accum=2 against 1 on packed rows whose micro-batches count different numbers of
    targets per depth (each depth's sums divided by the whole batch's count). Capacity off
    and aux losses off: both depend on which tokens share a micro-batch (test_train.py).
    fp32 sums in another order: grads to 1e-4 relative (1e-5 of each tensor's scale), the
    losses to 1e-5, as test_train.py's accumulation test."""
    common = [*TWO_LAYERS, "model.mtp_depth=2", "moe.capacity_factor=0", "moe.lb_loss_weight=0",
              "moe.z_loss_weight=0", "train.batch_size=4"]  # fmt: skip
    one, two = tiny_config(*common), tiny_config(*common, "train.grad_accum=2")
    graphdef, state = init_state(one, make_optimizer(one.train))
    b0, b1 = packed_batch(seed=0), packed_batch(seed=1)
    b1["segments"] = b1["segments"][::-1]  # micro-batch 1 (rows 1, 3) counts fewer targets
    batch = {k: jnp.concatenate([b0[k], b1[k]]) for k in b0}
    run = lambda cfg: jax.jit(lambda p, x: compute_grads(p, graphdef, x, cfg.train))(
        state["params"], batch
    )
    (g1, m1), (g2, m2) = run(one), run(two)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))
    for k in ("loss", "ce", "mtp_ce"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, err_msg=k)
    assert float(jnp.abs(g1["mtp"][1]["eh_proj"][...]).max()) > 0  # depth 2 trains


def test_mtp_loss_on_a_mesh_equals_one_device():
    """data 2 x fsdp 2 x expert 2, params created sharded (eh_proj over `embed` too) and
    gathered by steps (mesh.weight_gather=steps: eh_proj, the embedding lookup and the head's
    loss chunks per device), the layer scan with remat=full: the same loss and gradients as
    one device unrolled. Float32 sums in another order: 1e-5 relative for the losses, 1e-4
    for the gradients."""
    common = [*TWO_LAYERS, "model.mtp_depth=1", "moe.capacity_factor=0", "train.batch_size=8",
              "attention.nope_interval=2"]  # fmt: skip
    ref_cfg = tiny_config(*common)
    cfg = tiny_config(*common, "model.scan_layers=true", "model.remat=full", "mesh.data=2",
                      "mesh.fsdp=2", "mesh.expert=2", "mesh.weight_gather=steps",
                      "train.loss_chunk=8")  # fmt: skip
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256, jnp.int32)
    graphdef, state = init_state(ref_cfg, make_optimizer(ref_cfg.train))
    g_ref, m_ref = jax.jit(lambda p, x: compute_grads(p, graphdef, x, ref_cfg.train))(
        state["params"], tokens
    )
    mesh = make_mesh(cfg)

    def grads(params, x):  # as make_train_step runs it
        with weight_gather.gathering(backends.weight_gather("steps"), backends.gather_group(-1)):
            return compute_grads(params, graphdef, x, cfg.train)

    with jax.set_mesh(mesh):
        graphdef, state = init_state(cfg, make_optimizer(cfg.train), mesh=mesh)
        x = jax.device_put(tokens, NamedSharding(mesh, P(BATCH_AXES)))
        g, m = jax.jit(grads)(state["params"], x)
    assert state["params"]["mtp"][0]["eh_proj"][...].sharding.spec == P(None, ("fsdp", "expert"))
    for k in ("loss", "ce", "mtp_ce"):
        np.testing.assert_allclose(m[k], m_ref[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(
        g["mtp"][0]["eh_proj"][...], g_ref["mtp"][0]["eh_proj"][...], rtol=1e-4, atol=1e-7
    )


# ----------------------------------------------------------------------------- counting


def test_summary_counts_the_mtp_module_apart():
    """The main count is the model's without MTP; the MTP's own count is one decoder layer of
    the last layer's kind + eh_proj [2D, D] + 3 norms; FLOPs add its matmuls, its use of the
    head and its attention. DeepSeek-V3's dims (one main layer: the MTP count does not depend
    on the rest): 11.61B own, 13.46B as its checkpoint stores it with the copies of the
    embedding and head, the card's "14B" (685B - 671B; Hugging Face lists 684.5B in all)."""
    cfg0 = tiny_config(*TWO_LAYERS)
    cfg = tiny_config(*TWO_LAYERS, "model.mtp_depth=2")
    b = param_breakdown(cfg)
    assert param_counts(cfg) == param_counts(cfg0)
    D, V = cfg.model.d_model, cfg.model.vocab_size
    model = Transformer(cfg0, rngs=nnx.Rngs(0))
    last_layer = sum(v[...].size for _, v in nnx.to_flat_state(nnx.state(model.tail[1], nnx.Param)))
    assert b.mtp_total == 2 * (last_layer + 2 * D * D + 3 * D)
    assert mtp_stored(cfg) == b.mtp_total + 2 * 2 * V * D
    # MTP layers attend globally: half the keys by the causal count
    extra_attention = 6 * cfg.attention.n_heads * sum(attention_dims(cfg)) * cfg.train.seq_len
    assert b.mtp_matmul > 2 * V * D
    assert train_flops_per_token(cfg) - train_flops_per_token(cfg0) == (
        6 * b.mtp_matmul + extra_attention
    )
    total = sum(b.total.values())
    assert f"{_human(total)} + {_human(mtp_stored(cfg))} MTP" in format_summary(cfg)

    deepseek_v3_mtp = [
        "model.vocab_size=129280", "model.d_model=7168", "model.n_layers=1", "model.mtp_depth=1",
        "attention.kind=mla", "attention.n_heads=128", "attention.q_lora_rank=1536",
        "attention.kv_lora_rank=512", "attention.qk_nope_head_dim=128",
        "attention.qk_rope_head_dim=64", "attention.v_head_dim=128", "attention.qk_norm=none",
        "attention.nope_interval=0", "attention.temperature_tuning=false",
        "moe.n_experts=256", "moe.top_k=8", "moe.expert_hidden=2048",
        "moe.shared_expert_hidden=2048", "moe.score=sigmoid", "moe.interleave_step=1",
        "moe.correction_bias=true",
    ]  # fmt: skip
    ds = load_config(ROOT / "configs/tiny.yaml", deepseek_v3_mtp)
    assert round(param_breakdown(ds).mtp_total / 1e7) == 1161  # 11.61B
    assert round(mtp_stored(ds) / 1e7) == 1346  # 13.46B


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.mtp_depth=-1"], "model.mtp_depth must be >= 0"),
        (["train.mtp_loss_weight=-0.1"], "train.mtp_loss_weight"),
    ],
)
def test_bad_mtp_configs_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny_config(*overrides)
    assert "\n" not in str(e.value)
