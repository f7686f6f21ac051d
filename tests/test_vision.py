"""Image-embedding inputs: projected images replace the token embeddings at the marked
positions, in order; nothing changes without images or before the first image position; the
KV-cache prefill and the layer scan take them; the projection learns; bad inputs are refused.

Budget: ~15 s on 2 CPU cores (tiny models, one compile per shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moe_jax.config import ConfigError
from moe_jax.model import Transformer
from moe_jax.train.step import make_optimizer
from tests.helpers import forward, forward_cached, tiny_config

D_VISION = 12
# Two image positions per row, at different places in each row.
POSITIONS = np.array([[2, 5], [0, 6]])
LAYERS = ["model.n_layers=2"]  # a dense and an MoE layer


def vision_config(*overrides, d_vision=D_VISION):
    return tiny_config(*LAYERS, f"model.vision={d_vision}", "moe.capacity_factor=0", *overrides)


def image_inputs(B=2, T=8, d_vision=D_VISION, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, 256, jnp.int32)
    images = jax.random.normal(jax.random.key(seed + 1), (B, POSITIONS.shape[1], d_vision))
    mask = np.zeros((B, T), bool)
    np.put_along_axis(mask, POSITIONS, True, axis=1)
    return tokens, images, jnp.asarray(mask)


@nnx.jit
def forward_images(model, tokens_BT, images_BND, mask_BT):
    return model(tokens_BT, images=images_BND, image_mask=mask_BT)


@nnx.jit
def prefill_images(model, tokens_BT, positions_BT, cache, images_BND, mask_BT):
    return model(
        tokens_BT, positions=positions_BT, cache=cache, images=images_BND, image_mask=mask_BT
    )


def test_without_images_the_model_is_the_text_model():
    text_cfg = tiny_config(*LAYERS, "moe.capacity_factor=0")
    text, vision = (
        Transformer(text_cfg, rngs=nnx.Rngs(0)),
        Transformer(vision_config(), rngs=nnx.Rngs(0)),
    )
    # The projection is drawn last, so every other parameter is the text model's.
    params = nnx.state(vision, nnx.Param)
    assert params["vision_proj"].shape == (D_VISION, 32)
    params = nnx.to_flat_state(params)
    text_params = dict(nnx.to_flat_state(nnx.state(text, nnx.Param)))
    assert {p for p, _ in params} - set(text_params) == {("vision_proj",)}
    for path, v in params:
        if path != ("vision_proj",):
            np.testing.assert_array_equal(v[...], text_params[path][...])
    tokens, _, _ = image_inputs()
    expected = np.asarray(forward(text, tokens)[0])
    np.testing.assert_array_equal(forward(vision, tokens)[0], expected)
    # No image (N = 0, nothing marked) is the same as no image inputs.
    no_images = jnp.zeros((2, 0, D_VISION))
    got = forward_images(vision, tokens, no_images, jnp.zeros((2, 8), bool))[0]
    np.testing.assert_array_equal(got, expected)


def test_images_replace_the_marked_token_embeddings_in_order():
    # With an identity projection, image n of row b is a token embedding: the model must give
    # exactly what it gives for that token written at row b's n-th marked position.
    model = Transformer(vision_config(d_vision=32), rngs=nnx.Rngs(0))
    model.vision_proj[...] = jnp.eye(32)
    tokens, _, mask = image_inputs(d_vision=32)
    stand_in = jnp.asarray([[7, 99], [250, 3]])  # distinct per row and position
    images = model.embed.embedding[...][stand_in]
    written = np.asarray(tokens).copy()
    np.put_along_axis(written, POSITIONS, np.asarray(stand_in), axis=1)
    expected = forward(model, jnp.asarray(written))[0]
    got = forward_images(model, tokens, images, mask)[0]
    # x @ I is exact; only XLA's fusion choices differ between the two programs.
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    swapped = forward_images(model, tokens, images[:, ::-1], mask)[0]
    assert not np.allclose(swapped, expected, atol=1e-3)  # the order matters


def test_positions_before_the_first_image_do_not_see_it():
    model = Transformer(vision_config(), rngs=nnx.Rngs(0))
    tokens, images, mask = image_inputs()
    a = np.asarray(forward_images(model, tokens, images, mask)[0])
    b = np.asarray(forward_images(model, tokens, images + 1.0, mask)[0])
    for row, first in enumerate(POSITIONS.min(axis=1)):
        np.testing.assert_array_equal(a[row, :first], b[row, :first])
        assert np.all(np.abs(a[row, first:] - b[row, first:]).max(axis=-1) > 1e-4)


def test_kv_cache_prefill_with_images_then_decode_equals_full_forward_under_scan():
    # Two stacked blocks of one layer (NoPE-free, all MoE) run by lax.scan.
    scan = ["attention.nope_interval=0", "moe.interleave_step=1", "model.scan_layers=true"]
    model = Transformer(vision_config(*scan), rngs=nnx.Rngs(0))
    assert model.n_blocks == 2
    tokens, images, mask = image_inputs(T=11)  # 8 prefilled (with the images), 3 decoded
    full = np.asarray(forward_images(model, tokens, images, mask)[0])
    cache = model.init_cache(2, 16)
    positions = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    logits, _, cache = prefill_images(
        model, tokens[:, :8], positions[:, :8], cache, images, mask[:, :8]
    )
    steps = [np.asarray(logits)]
    for t in range(8, 11):
        logits, _, cache = forward_cached(
            model, tokens[:, t : t + 1], positions[:, t : t + 1], cache
        )
        steps.append(np.asarray(logits))
    # Same math, sums over differently sized key sets: float32 rounding only.
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_the_projection_learns_in_a_train_step():
    cfg = vision_config("train.lr=0.1", "train.warmup_steps=1")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(cfg.train)
    tokens, images, mask = image_inputs(T=9)

    @jax.jit
    def train_step(params, opt_state, images, mask):
        def loss_fn(params):
            logits, aux = nnx.merge(graphdef, params)(
                tokens[:, :-1], images=images, image_mask=mask[:, :-1]
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return ce + aux["aux_loss"]

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), grads

    new, grads = train_step(params, tx.init(params), images, mask)
    g = np.asarray(grads["vision_proj"][...])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-6
    assert not np.allclose(new["vision_proj"][...], params["vision_proj"][...])
    # Where nothing is marked, the projected images are not used: exactly zero gradient.
    # (Under jit the mask is traced, so its counts are not checked against the images.)
    _, grads = train_step(params, tx.init(params), images, jnp.zeros_like(mask))
    assert np.abs(np.asarray(grads["vision_proj"][...])).max() == 0.0


def test_bad_image_inputs_are_refused_with_a_clear_message():
    model = Transformer(vision_config(), rngs=nnx.Rngs(0))
    tokens, images, mask = image_inputs()
    cases = [
        (dict(images=images), "images and image_mask go together"),
        (dict(image_mask=mask), "images and image_mask go together"),
        (dict(images=images[..., :5], image_mask=mask), r"images must be \[B=2, N, model"),
        (dict(images=images[:1], image_mask=mask), r"images must be \[B=2, N, model"),
        (dict(images=images, image_mask=mask.astype(jnp.int32)), "image_mask must be a boolean"),
        (dict(images=images, image_mask=mask[:, :5]), r"must be a boolean \[B=2, T=8\]"),
        # Concrete masks are counted: row 1 marks one position for two embeddings.
        (dict(images=images, image_mask=mask.at[1, 0].set(False)), "row 1 marks 1 positions"),
        (dict(images=jnp.zeros((2, 9, D_VISION)), image_mask=mask), "9 image embeddings per row"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(tokens, **kwargs)
    # Under jit the shapes are still checked at trace time.
    with pytest.raises(ValueError, match="9 image embeddings per row cannot fill 8 token"):
        forward_images(model, tokens, jnp.zeros((2, 9, D_VISION)), mask)
    text = Transformer(tiny_config(*LAYERS), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"takes no image embeddings \(model.vision=0\)"):
        text(tokens, images=images, image_mask=mask)
    with pytest.raises(ConfigError, match="model.vision must be >= 0"):
        tiny_config("model.vision=-1")
