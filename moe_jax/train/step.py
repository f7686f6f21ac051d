"""The train step: optimizer and LR schedule, loss, gradient accumulation, the jitted train and
eval steps, and the train state they work on. `moe_jax.train.loop` runs them in its loop;
`moe_jax.aot.command` compiles the same step for accelerators.

    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx, mesh=mesh)
    step = make_train_step(cfg, graphdef, tx, state_sharding)
    state, metrics = step(state, batch)    # batch: tokens [B, T+1], or a dict (below)

The train state is a plain pytree `{"step", "params", "opt_state"}`: `params` is the model's
`nnx.Param` state from `nnx.split(model, nnx.Param)` and the model is rebuilt from it with
`nnx.merge` inside the jitted step (at trace time, so it costs nothing per step). The step is
one pure function, jitted once, with the state donated so XLA updates it in place.

A batch is a plain int32 array [B, T+1] of token windows (inputs [:, :-1], targets [:, 1:]),
or a dict of int32 [B, T+1] arrays: "tokens", and optionally "segments" (document ids, 0 for
padding: attention stays inside each document, and target t+1 counts only if segments[t+1]
== segments[t] != 0), "positions" (restarting at 0 at each document; default 0..T-1) and
"loss_mask" (1 for targets to learn, e.g. a completion but not its prompt; applied to [:, 1:]
together with the segment rule). See `loss.split_batch`.

Loss = cross-entropy (fp32) averaged over the counted targets + the MoE aux loss the model
returns (lb_loss_weight * load balance + z_loss_weight * router z-loss, means over the MoE
layers, + seq_aux_loss_weight * DeepSeek-V3's sequence-wise loss summed over them:
`routing.aux_loss`) + optionally
`train.logit_z_loss * mean(logsumexp(logits)^2)` over the counted targets (PaLM's
output-logit z-loss) + with `model.mtp_depth` = D > 0, DeepSeek-V3's multi-token prediction
loss `train.mtp_loss_weight / D * sum_k CE_k` (moe_jax/model/mtp.py; CE_k over depth k's
counted targets, see `split_mtp`), its MoE layers counted among the aux loss's.

Gradient accumulation: the batch is split into `grad_accum` micro-batches of B/A rows that a
`lax.scan` runs one after another (memory of one micro-batch), and their gradients are
summed. Each micro-batch's cross-entropy and logit z-loss are sums divided by the whole
batch's count of targets, so the accumulated loss and gradient equal the full batch's even
when the micro-batches count different numbers of targets (each MTP depth's by its own
count). The MoE aux losses are averaged
over the micro-batches: the load-balance loss is a product of batch means and MoE capacity is
per routing group, so for those the micro-batch is the unit, as in every accumulation scheme.

Optimizer: AdamW (b1, b2, eps from the config) with decoupled weight decay on matmul weights
only (not on norm scales, biases, or the embedding unless `train.decay_embeddings`), after
global-norm clipping, with linear warmup to `train.lr` then cosine decay to
`min_lr_ratio * lr` at `train.steps`; its moments are stored in `train.moments_dtype`.
With `train.optimizer=muon`, Muon on the matmul weights instead (moe_jax/train/muon.py), and
with `train.qk_clip` MuonClip's QK-clip after each update (moe_jax/train/qk_clip.py).
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.config import Config, TrainConfig
from moe_jax.model import Transformer, context_parallel, layer_stats, lora, weight_gather
from moe_jax.model.balancing import update_correction_bias
from moe_jax.model.loss import Batch, head_statistics, split_batch, target_statistics
from moe_jax.model.mtp import MTP_LAYER_STATS, mtp_hidden, with_mtp_stats
from moe_jax.model.transformer import LAYER_FRACTIONS
from moe_jax.named_scopes import HEAD_LOSS, OPTIMIZER
from moe_jax.posttrain import lora as lora_params
from moe_jax.posttrain.reference_policy import reference_params, with_reference
from moe_jax.sharding import BATCH_AXES, state_shardings, with_shardings
from moe_jax.train import muon, qk_clip
from moe_jax.train.state import make_state

# ----------------------------------------------------------------------------- optimizer


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """LR at a 0-based step (`train.schedule`), from optax's schedules: a linear warmup,
    (s+1)/warmup * lr, so that step 0 already learns, then
    - cosine: cosine decay to min_lr_ratio * lr at train.steps;
    - linear: linear decay to min_lr_ratio * lr at train.steps;
    - wsd (warmup-stable-decay): lr held until the last decay_fraction of train.steps, then
      linear decay to min_lr_ratio * lr (a run can be continued from before its decay);
    and min_lr_ratio * lr from train.steps on."""
    W, lr, floor = t.warmup, t.lr, t.lr * t.min_lr_ratio
    warmup = optax.linear_schedule(lr / max(W, 1), lr, max(W - 1, 0))
    after = max(t.steps - W, 1)  # the steps past warmup (one at least: a valid schedule)
    if t.schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, after, alpha=t.min_lr_ratio)
    elif t.schedule == "linear":
        main = optax.linear_schedule(lr, floor, after)
    else:  # wsd
        decay = t.decay_steps
        main = optax.join_schedules(
            [optax.constant_schedule(lr), optax.linear_schedule(lr, floor, max(decay, 1))],
            [after - decay],
        )
    return optax.join_schedules([warmup, main], [W])


def decay_mask(params, decay_embeddings: bool, mtp: bool = True, indexer_only: bool = False):
    """True for the params weight decay applies to: matmul weights (and the embedding if asked;
    the MTP layers' unless `mtp` is False; the DSA indexers' alone with `indexer_only`, the
    warm-up's, which trains nothing else).

    Relies on the model's naming contract: norm weights are named `scale`, biases end in
    `bias`, the token embedding is `embed.embedding`, the MTP layers are under `mtp`, a
    hash-routed layer's fixed table is `tid2eid` (`moe.hash_table`: never moves).
    """

    def decays(path, _) -> bool:
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        if names[-1] in ("scale", "tid2eid") or names[-1].endswith("bias"):
            return False
        if not mtp and names[0] == "mtp":
            return False
        if indexer_only and "indexer" not in names:
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


def stored_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` with its floating-point state stored in `dtype` and updated in float32: the
    moments are read up, updated and rounded once per step (train.moments_dtype)."""

    def cast(tree, to):
        floating = lambda a: jnp.issubdtype(a.dtype, jnp.floating)
        return jax.tree.map(lambda a: a.astype(to) if floating(a) else a, tree)

    def update(grads, state, params=None):
        updates, state = tx.update(grads, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(tx.init(params), dtype), update)


def make_optimizer(
    t: TrainConfig, reference_dtype: str = "float32", rl=None
) -> optax.GradientTransformation:
    """AdamW as the module doc says, for the adapters alone where the params hold LoRA
    adapters. With train.objective=dpo, or grpo with rl.kl_beta > 0, its state also holds
    the frozen reference of a full fine-tune (`posttrain.reference_policy`), its matmul weights in
    `reference_dtype`: pass the compute dtype, `backends.compute_dtype(cfg.model.dtype)`,
    and for grpo the rl section (`rl`), as train.py does. GRPO's step makes rl.updates
    updates (`rl.passes`), the LR advancing once a step; the MTP layers, whose loss GRPO
    leaves out, get no weight decay either, so they stay as they were."""
    grpo = t.objective == "grpo" and rl is not None
    warmup = t.indexer_stage == "warmup"  # weight decay for the trained indexers alone
    schedule = lr_schedule(t)
    decays = partial(decay_mask, decay_embeddings=t.decay_embeddings, indexer_only=warmup)
    if grpo:
        per_step, every = schedule, rl.updates
        schedule = lambda count: per_step(count // every)
        decays = partial(decay_mask, decay_embeddings=t.decay_embeddings, mtp=False)
    adamw = optax.adamw(
        schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decays
    )
    if t.optimizer == "muon":  # Muon on the matmul weights, this AdamW on the rest
        adamw = muon.muon(t, schedule, adamw, decays)
    if t.moments_dtype != "float32":
        adamw = stored_in(adamw, jnp.dtype(t.moments_dtype))
    # with LoRA adapters in the params, state for them alone (moe_jax/posttrain/lora.py)
    tx = lora_params.adapters_only(optax.chain(clip_by_global_norm(t.clip_norm), adamw))
    if grpo and rl.kl_beta > 0:
        return with_reference(tx, reference_dtype)
    return with_reference(tx, reference_dtype) if t.objective == "dpo" else tx


# ----------------------------------------------------------------------------- steps


def n_targets(batch: Batch) -> jax.Array:
    """The number of targets the batch counts in its loss (float32 scalar)."""
    return jnp.sum(split_batch(batch)[2])


def _ahead(a_BX: jax.Array, s: int, T: int) -> jax.Array:
    """[B, T]: a[:, t + s] at each t < T, 0 where t + s is past a's row."""
    a_BX = a_BX[:, s : s + T]
    return jnp.pad(a_BX, ((0, 0), (0, T - a_BX.shape[1])))


def split_mtp(batch: Batch, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MTP depth k's part of the batch (moe_jax/model/mtp.py), each [B, T] for the input
    positions t: token t+k (the depth's input), token t+k+1 (its target), and float32 weights,
    1 where the target counts: inside the row (not the last k positions), every step from t
    to t+k+1 inside one document as the main loss counts a step (segments), and the target
    counted by the loss mask."""
    if not isinstance(batch, dict):
        batch = {"tokens": batch}
    tokens_BT1 = batch["tokens"]
    B, T = tokens_BT1.shape[0], tokens_BT1.shape[1] - 1
    counted_BT = jnp.broadcast_to(jnp.arange(T) < T - k, (B, T))
    if "segments" in batch:
        seg_BT1 = batch["segments"]
        step_BT = (seg_BT1[:, 1:] == seg_BT1[:, :-1]) & (seg_BT1[:, :-1] != 0)  # t -> t+1
        for j in range(k + 1):
            counted_BT = counted_BT & (_ahead(step_BT, j, T) != 0)
    if "loss_mask" in batch:
        counted_BT = counted_BT & (_ahead(batch["loss_mask"], k + 1, T) != 0)
    weights_BT = counted_BT.astype(jnp.float32)
    return _ahead(tokens_BT1, k, T), _ahead(tokens_BT1, k + 1, T), weights_BT


def mtp_loss(model, x_BTD, batch: Batch, chunk: int, head_DV, aux: dict, total_K=None):
    """-> (the MTP loss, `aux` with the MTP layers' MoE counted, metrics) of one batch, from
    the main model's last layer output `x_BTD`. Depth k's cross-entropy sum is divided by its
    count of targets, or by `total_K[k-1]`, the whole batch's, for a micro-batch.
    Metrics: "mtp_ce" (the mean over depths of each depth's mean), "mtp_ce_sum" and
    "mtp_n_targets" ([D] each), and the MTP layers' MoE statistics (MTP_LAYER_STATS)."""
    D = model.cfg.model.mtp_depth
    inputs = split_batch(batch)[0]
    parts = [split_mtp(batch, k) for k in range(1, D + 1)]
    hidden = mtp_hidden(
        model, x_BTD, [p[0] for p in parts], inputs.get("positions"), inputs.get("segments")
    )
    head_DV = model.head_weight() if head_DV is None else head_DV  # read once for every depth
    sums, counts = [], []
    for layer, (h_BTD, _), (_, targets_BT, weights_BT) in zip(
        model.mtp, hidden, parts, strict=True
    ):
        with jax.named_scope(HEAD_LOSS):  # as the main loss: steps run the chunks per device
            by_steps = chunk and weight_gather.head_statistics(
                head_statistics, layer.head_norm(h_BTD), targets_BT, chunk, head_DV
            )
            logz_BT, target_logit_BT = by_steps or head_statistics(
                layer.logits, h_BTD, targets_BT, chunk, head_DV
            )
            sums.append(jnp.sum((logz_BT - target_logit_BT) * weights_BT))
            counts.append(jnp.sum(weights_BT))
    sum_K, count_K = jnp.stack(sums), jnp.stack(counts)
    denom_K = jnp.maximum(count_K if total_K is None else total_K, 1.0)
    loss = model.cfg.train.mtp_loss_weight * jnp.mean(sum_K / denom_K)
    mtp_stats = [s for _, s in hidden if s is not None]  # the MTP's MoE layers, in order
    mtp_aux = layer_stats.moe_aux(model.cfg, model.n_blocks, [], [], mtp_stats)
    aux = with_mtp_stats(aux, mtp_aux, model.cfg.moe)
    metrics = {"mtp_ce": jnp.mean(sum_K / jnp.maximum(count_K, 1.0))}
    metrics |= {"mtp_ce_sum": sum_K, "mtp_n_targets": count_K}
    metrics |= {k: aux[k] for k in MTP_LAYER_STATS.values() if k in aux}
    return loss, aux, metrics


def loss_fn(
    params,
    graphdef: nnx.GraphDef,
    batch: Batch,
    logit_z_loss: float,
    total=None,
    n_micro=1,
    mtp_total=None,
):
    """-> (loss, metrics) for one batch: the mean over its counted targets.

    As one of `n_micro` micro-batches, the sums are divided by `total`, the whole batch's count
    of targets (and the MTP depths' by `mtp_total` [D], theirs), and the aux loss by n_micro, so
    that the micro-batches' losses add up to the whole batch's. Metrics: "ce" and "logit_z"
    (means over the batch's counted targets), their sums ("ce_sum", "logit_z_sum") and count
    ("n_targets"), the aux statistics, and with model.mtp_depth those of `mtp_loss`."""
    model = nnx.merge(graphdef, params)
    inputs, targets_BT, weights_BT = split_batch(batch)
    # Under a context axis: every token of the row moved to its shard's slot, which changes
    # no sum below (model/context_parallel.py)
    inputs, targets_BT, weights_BT = context_parallel.layout_inputs(inputs, targets_BT, weights_BT)
    x_BTD, aux = model(
        inputs["tokens"],
        positions=inputs.get("positions"),
        segments=inputs.get("segments"),
        head=False,
    )
    # Never the whole [B, T, V] logits with train.loss_chunk (see moe_jax/model/loss.py)
    chunk = backends.loss_chunk(model.cfg.train.loss_chunk, x_BTD.shape[1])
    head_DV = model.head_weight() if chunk else None
    logz_BT, target_logit_BT = target_statistics(model, x_BTD, targets_BT, chunk, head_DV)
    with jax.named_scope(HEAD_LOSS):
        count = jnp.sum(weights_BT)
        ce_sum = jnp.sum((logz_BT - target_logit_BT) * weights_BT)
        logit_z_sum = jnp.sum(logz_BT**2 * weights_BT)
    # A batch that counts no target has no CE (0, not 0/0); the aux loss still trains.
    denom = jnp.maximum(count if total is None else total, 1.0)
    mtp, mtp_metrics = 0.0, {}
    if model.cfg.model.mtp_depth:
        mtp, aux, mtp_metrics = mtp_loss(model, x_BTD, batch, chunk, head_DV, aux, mtp_total)
    loss = (ce_sum + logit_z_loss * logit_z_sum) / denom + aux["aux_loss"] / n_micro + mtp
    loss, indexer_metrics = with_indexer_loss(model.cfg.train, loss, aux, n_micro)
    metrics = {"ce_sum": ce_sum, "logit_z_sum": logit_z_sum, "n_targets": count}
    metrics |= {
        "ce": ce_sum / jnp.maximum(count, 1.0),
        "logit_z": logit_z_sum / jnp.maximum(count, 1.0),
    }
    metrics |= {k: aux[k] for k in ("aux_loss", "lb_loss", "z_loss", "expert_load")}
    if "seq_lb_loss" in aux:  # moe.seq_aux_loss_weight > 0: the sum over MoE layers
        metrics["seq_lb_loss"] = aux["seq_lb_loss"]
    metrics |= {k: aux[k] for k in LAYER_FRACTIONS}
    if "max_logit" in aux:  # train.qk_clip: [n_layers, H] (moe_jax/train/qk_clip.py)
        metrics["max_logit"] = aux["max_logit"]
    return loss, metrics | mtp_metrics | indexer_metrics


def with_indexer_loss(t, loss, aux: dict, n_micro: int):
    """`loss` with DSA's indexer loss (train.indexer_stage; the model's "indexer_loss", each
    indexer layer's KL averaged) at train.indexer_loss_weight, and its metric. The warm-up
    trains the indexer alone: the rest of the loss is there for its value, not its
    gradient (weight decay spares the rest too: `decay_mask`)."""
    if "indexer_loss" not in aux:
        return loss, {}
    if t.indexer_stage == "warmup":
        loss = jax.lax.stop_gradient(loss)
    loss = loss + t.indexer_loss_weight * aux["indexer_loss"] / n_micro
    return loss, {"indexer_loss": aux["indexer_loss"]}


def compute_grads(params, graphdef: nnx.GraphDef, batch: Batch, t: TrainConfig):
    """-> (grads, metrics) of the batch, accumulated over `t.grad_accum` micro-batches.
    With LoRA adapters in `params`, the gradients of their A and B alone (the frozen base
    gets none: `posttrain.lora.split`).

    Metrics: "loss", "ce" and "logit_z" (means over the batch's counted targets), "n_targets"
    (their number), the MoE aux statistics (means over the micro-batches), and with
    model.mtp_depth "mtp_ce" (the mean over depths of each depth's mean over the batch)."""
    A = t.grad_accum
    trained, frozen = lora_params.split(params)
    grad_fn = jax.value_and_grad(
        lambda trained, *args: loss_fn(lora_params.join(trained, frozen), *args), has_aux=True
    )
    total = n_targets(batch)
    depth = len(params["mtp"]) if "mtp" in params else 0  # model.mtp_depth
    mtp_total = None  # each MTP depth's count of targets in the whole batch
    if depth:
        mtp_total = jnp.stack([jnp.sum(split_mtp(batch, k)[2]) for k in range(1, depth + 1)])
    # Micro-batch a takes rows a, a+A, a+2A, ...: each device's contiguous block of the batch
    # splits into A local micro-batches, so accumulation moves no data between devices.
    micro = lambda a_BT1: a_BT1.reshape(a_BT1.shape[0] // A, A, -1).swapaxes(0, 1)
    micro_A = jax.tree.map(micro, batch)
    if not jax.sharding.get_abstract_mesh().empty:
        micro_A = jax.lax.with_sharding_constraint(micro_A, P(None, BATCH_AXES))

    def accumulate(grads_sum, micro_batch):
        (loss, metrics), grads = grad_fn(
            trained, graphdef, micro_batch, t.logit_z_loss, total, A, mtp_total
        )
        return jax.tree.map(jnp.add, grads_sum, grads), metrics | {"loss": loss}

    zeros = jax.tree.map(jnp.zeros_like, trained)
    grads, metrics_A = jax.lax.scan(accumulate, zeros, micro_A)
    summed = ("loss", "ce_sum", "logit_z_sum") + (("mtp_ce_sum",) if depth else ())
    sums = {k: jnp.sum(metrics_A.pop(k), axis=0) for k in summed}
    # per micro-batch: replaced by the whole batch's
    for k in ("ce", "logit_z", "n_targets") + (("mtp_ce", "mtp_n_targets") if depth else ()):
        del metrics_A[k]
    max_logit = metrics_A.pop("max_logit", None)  # the batch's: the micro-batches' largest
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_A)  # the aux statistics
    if max_logit is not None:
        metrics["max_logit"] = jnp.max(max_logit, axis=0)
    denom = jnp.maximum(total, 1.0)
    metrics |= {
        "loss": sums["loss"],
        "ce": sums["ce_sum"] / denom,
        "logit_z": sums["logit_z_sum"] / denom,
        "n_targets": total,
    }
    if depth:
        metrics["mtp_ce"] = jnp.mean(sums["mtp_ce_sum"] / jnp.maximum(mtp_total, 1.0))
    return grads, metrics


@contextlib.contextmanager
def _tracing(cfg: Config, key: jax.Array):
    """What a step's forward and backward are traced under: the weight gathers' strategy and
    LoRA dropout's masks (from `key`)."""
    m = cfg.mesh
    with (
        weight_gather.gathering(
            backends.weight_gather(m.weight_gather), backends.gather_group(m.gather_group)
        ),
        lora.dropping(key, cfg.lora.dropout),
    ):
        yield


def make_train_step(
    cfg: Config, graphdef: nnx.GraphDef, tx: optax.GradientTransformation, state_sharding=None
):
    """Jitted `(state, batch) -> (new state, metrics)`; `state` is donated and, with
    `state_sharding`, keeps that layout (metrics come back replicated). The batch (an array or
    a dict of arrays, see the module doc) keeps the sharding it comes with."""
    schedule = lr_schedule(cfg.train)

    def update(params, opt_state, grads, metrics: dict, step):
        """One optimizer update of `params` by `grads` (of their trained part) at `step`."""
        with jax.named_scope(OPTIMIZER):
            metrics["grad_norm"] = optax.tree.norm(grads)  # before clipping (adapters' alone)
            metrics["lr"] = schedule(step)
            updates, opt_state = tx.update(grads, opt_state, params)
            trained, frozen = lora_params.split(params)
            new_params = lora_params.join(optax.apply_updates(trained, updates), frozen)
            # outside the gradient: aux-loss-free balancing's bias (model/balancing.py)
            new_params = update_correction_bias(new_params, metrics, cfg)
            if cfg.train.qk_clip:  # MuonClip: heads over tau scaled back (train/qk_clip.py)
                max_logit_LH = metrics.pop("max_logit")
                new_params = qk_clip.clip(new_params, max_logit_LH, cfg)
                metrics["max_logit"] = jnp.max(max_logit_LH, axis=-1)  # logged per layer
                metrics["qk_clipped"] = qk_clip.clipped_heads(max_logit_LH, cfg.train.qk_clip)
        return new_params, opt_state, metrics

    def train_step(state, batch):
        # lora.dropout's masks: new every step, the same again when a resumed run redoes it
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        if cfg.train.objective == "grpo":  # passes over rollouts (moe_jax/posttrain/rl/passes.py)
            from moe_jax.posttrain.rl.passes import update_passes

            tracing = partial(_tracing, cfg)
            params, opt_state, metrics = update_passes(state, batch, cfg, graphdef, tracing,
                                                       update, key)  # fmt: skip
        else:
            params = state["params"]
            with _tracing(cfg, key):
                if cfg.train.objective == "dpo":  # preference pairs (moe_jax/posttrain/dpo.py)
                    from moe_jax.posttrain import dpo

                    reference = reference_params(state["opt_state"])  # None: LoRA's base
                    grads, metrics = dpo.compute_grads(params, graphdef, batch, cfg, reference)
                else:
                    grads, metrics = compute_grads(params, graphdef, batch, cfg.train)
            params, opt_state, metrics = update(
                params, state["opt_state"], grads, metrics, state["step"]
            )
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return new_state, metrics

    if state_sharding is None:
        return jax.jit(train_step, donate_argnums=0)
    replicated = NamedSharding(jax.tree.leaves(state_sharding)[0].mesh, P())
    return jax.jit(train_step, donate_argnums=0, out_shardings=(state_sharding, replicated))


def make_eval_step(graphdef: nnx.GraphDef, sums: bool = False):
    """Jitted `(params, batch) -> mean cross-entropy over the batch's counted targets`; with
    `sums`, -> `(sum of their cross-entropies, their number)` instead, for an exact mean over
    batches that count different numbers of targets."""

    def eval_step(params, batch):
        _, metrics = loss_fn(params, graphdef, batch, 0.0)
        return (metrics["ce_sum"], metrics["n_targets"]) if sums else metrics["ce"]

    return jax.jit(eval_step)


def init_state(cfg: Config, tx: optax.GradientTransformation, abstract: bool = False, mesh=None):
    """-> (graphdef, state). `abstract=True` gives shapes only (the target of a restore).

    With a `mesh`, every array is created (or described, when abstract) already laid out
    over it: params by their logical axes, Adam moments like their params."""
    graphdef, shapes, init = init_program(cfg, tx, mesh)
    return graphdef, (shapes if abstract else init())


def init_program(cfg: Config, tx: optax.GradientTransformation, mesh=None):
    """-> (graphdef, the state's shapes (laid out over `mesh`), the jitted `() -> state`):
    `init_state`'s, with the program that makes the state rather than the state."""

    def build(seed):
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
        # the frozen base in lora.base_dtype (an int8 or mxfp4 one quantised)
        return lora_params.quantized_base(model, cfg.lora.base_dtype) if cfg.lora.rank else model

    def init():
        params = nnx.state(build(cfg.seed), nnx.Param)
        if cfg.lora.rank:
            params = lora_params.with_base_dtype(params, cfg.lora.base_dtype)
        return make_state(0, params, tx.init(params))

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(0)))
    shapes = jax.eval_shape(init)
    if mesh is None:
        return graphdef, shapes, jax.jit(init)
    shardings = state_shardings(shapes, mesh)
    # One jitted program rather than hundreds of eagerly compiled initialiser ops.
    return graphdef, with_shardings(shapes, shardings), jax.jit(init, out_shardings=shardings)
