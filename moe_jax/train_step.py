"""The train step: optimizer and LR schedule, loss, gradient accumulation, the jitted train and
eval steps, and the train state they work on. `moe_jax.trainer` runs them in its loop;
`moe_jax.aot` compiles the same step for accelerators.

    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx, mesh=mesh)
    step = make_train_step(cfg, graphdef, tx, state_sharding)
    state, metrics = step(state, tokens_BT1)

The train state is a plain pytree `{"step", "params", "opt_state"}`: `params` is the model's
`nnx.Param` state from `nnx.split(model, nnx.Param)` and the model is rebuilt from it with
`nnx.merge` inside the jitted step (at trace time, so it costs nothing per step). The step is
one pure function, jitted once, with the state donated so XLA updates it in place.

Loss = mean next-token cross-entropy (fp32) + the MoE aux loss the model returns
(lb_loss_weight * load balance + z_loss_weight * router z-loss) + optionally
`train.logit_z_loss * mean(logsumexp(logits)^2)` (PaLM's output-logit z-loss).

Gradient accumulation: the batch [B, T+1] is split into `grad_accum` micro-batches of B/A rows
that a `lax.scan` runs one after another (memory of one micro-batch), and the gradients are
averaged. Cross-entropy and z-losses are per-token means, so this equals the full batch; the
load-balance loss is a product of batch means and MoE capacity is per routing group, so for
those the micro-batch is the unit, as in every accumulation scheme.

Optimizer: AdamW (b1, b2, eps from the config) with decoupled weight decay on matmul weights
only (not on norm scales, biases, or the embedding unless `train.decay_embeddings`), after
global-norm clipping, with linear warmup to `train.lr` then cosine decay to
`min_lr_ratio * lr` at `train.steps`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import Config, TrainConfig
from moe_jax.model import Transformer
from moe_jax.sharding import BATCH_AXES, state_shardings, with_shardings

# ----------------------------------------------------------------------------- optimizer


def lr_schedule(t: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """LR at a 0-based step: (s+1)/warmup * lr during warmup, then cosine to min_lr_ratio*lr."""

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = t.lr * (s + 1) / max(t.warmup, 1)
        progress = jnp.clip((s - t.warmup) / max(t.steps - t.warmup, 1), 0.0, 1.0)
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * progress))
        decayed = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)
        return jnp.where(s < t.warmup, warm, decayed)

    return schedule


def decay_mask(params, decay_embeddings: bool):
    """True for the params weight decay applies to: matmul weights (and the embedding if asked).

    Relies on the model's naming contract: norm weights are named `scale`, biases end in
    `bias`, the token embedding is `embed.embedding`.
    """

    def decays(path, _) -> bool:
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        if names[-1] == "scale" or names[-1].endswith("bias"):
            return False
        return decay_embeddings or names[-2:] != ["embed", "embedding"]

    return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` as one scalar factor, min(1, max_norm / norm); 0 = no clipping.

    optax selects between each gradient and its rescaled copy, and XLA:CPU wrote that result
    out as one more parameter-sized array, read again by both moment updates. A multiply by a
    scalar fuses into each consumer instead (the form optax's own source calls faster): AdamW
    over 50 M parameters 81 -> 53 ms. Same state (empty) as optax's, so checkpoints match."""

    def update(grads, state, params=None):
        del params
        if max_norm == 0:
            return grads, state
        factor = jnp.minimum(1.0, max_norm / optax.tree.norm(grads))
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        clip_by_global_norm(t.clip_norm),
        optax.adamw(
            lr_schedule(t),
            b1=t.b1,
            b2=t.b2,
            eps=t.eps,
            weight_decay=t.weight_decay,
            mask=partial(decay_mask, decay_embeddings=t.decay_embeddings),
        ),
    )


# ----------------------------------------------------------------------------- steps


def loss_fn(params, graphdef: nnx.GraphDef, tokens_BT1: jax.Array, logit_z_loss: float):
    """-> (loss, metrics) for one batch of windows [B, T+1] (inputs [:, :-1], targets [:, 1:])."""
    model = nnx.merge(graphdef, params)
    logits_BTV, aux = model(tokens_BT1[:, :-1])
    targets_BT = tokens_BT1[:, 1:]
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    ce = jnp.mean(logz_BT - target_logit_BT)
    logit_z = jnp.mean(logz_BT**2)
    loss = ce + aux["aux_loss"] + logit_z_loss * logit_z
    metrics = {"ce": ce, "logit_z": logit_z}
    metrics |= {k: aux[k] for k in ("aux_loss", "lb_loss", "z_loss", "expert_load", "dropped_frac")}
    return loss, metrics


def compute_grads(params, graphdef: nnx.GraphDef, tokens_BT1: jax.Array, t: TrainConfig):
    """-> (grads, metrics) of the batch, accumulated over `t.grad_accum` micro-batches."""
    A = t.grad_accum
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    B, T1 = tokens_BT1.shape
    # Micro-batch a takes rows a, a+A, a+2A, ...: each device's contiguous block of the batch
    # splits into A local micro-batches, so accumulation moves no data between devices.
    micro_ABT1 = tokens_BT1.reshape(B // A, A, T1).swapaxes(0, 1)
    if not jax.sharding.get_abstract_mesh().empty:
        micro_ABT1 = jax.lax.with_sharding_constraint(micro_ABT1, P(None, BATCH_AXES))

    def accumulate(grads_sum, micro_BT1):
        (loss, metrics), grads = grad_fn(params, graphdef, micro_BT1, t.logit_z_loss)
        return jax.tree.map(jnp.add, grads_sum, grads), metrics | {"loss": loss}

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads_sum, metrics_A = jax.lax.scan(accumulate, zeros, micro_ABT1)
    grads = jax.tree.map(lambda g: g / A, grads_sum)
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_A)  # micro-batches: equal size
    return grads, metrics


def make_train_step(
    cfg: Config, graphdef: nnx.GraphDef, tx: optax.GradientTransformation, state_sharding=None
):
    """Jitted `(state, tokens_BT1) -> (new state, metrics)`; `state` is donated and, with
    `state_sharding`, keeps that layout (metrics come back replicated)."""
    schedule = lr_schedule(cfg.train)

    def train_step(state, tokens_BT1):
        params = state["params"]
        grads, metrics = compute_grads(params, graphdef, tokens_BT1, cfg.train)
        metrics["grad_norm"] = optax.tree.norm(grads)  # before clipping
        metrics["lr"] = schedule(state["step"])
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        return new_state, metrics

    if state_sharding is None:
        return jax.jit(train_step, donate_argnums=0)
    replicated = NamedSharding(jax.tree.leaves(state_sharding)[0].mesh, P())
    return jax.jit(train_step, donate_argnums=0, out_shardings=(state_sharding, replicated))


def make_eval_step(graphdef: nnx.GraphDef):
    """Jitted `(params, tokens_BT1) -> mean next-token cross-entropy`."""

    def eval_step(params, tokens_BT1):
        _, metrics = loss_fn(params, graphdef, tokens_BT1, 0.0)
        return metrics["ce"]

    return jax.jit(eval_step)


def init_state(cfg: Config, tx: optax.GradientTransformation, abstract: bool = False, mesh=None):
    """-> (graphdef, state). `abstract=True` gives shapes only (the target of a restore).

    With a `mesh`, every array is created (or described, when abstract) already laid out
    over it: params by their logical axes, Adam moments like their params."""

    def init():
        model = Transformer(cfg, rngs=nnx.Rngs(cfg.seed))
        params = nnx.state(model, nnx.Param)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shapes = jax.eval_shape(init)
    shardings = state_shardings(shapes, mesh) if mesh is not None else None
    if abstract:
        return graphdef, (with_shardings(shapes, shardings) if mesh is not None else shapes)
    # One jitted program rather than hundreds of eagerly compiled initialiser ops.
    return graphdef, jax.jit(init, out_shardings=shardings)()
