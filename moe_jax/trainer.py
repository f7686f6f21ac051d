"""Training: optimizer and LR schedule, loss, the jitted train and eval steps, and the loop.

    from moe_jax.trainer import train
    result = train(cfg)   # trains cfg.run_dir up to cfg.train.steps, resuming from its checkpoint

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

The loop: every `log_every` steps a metrics record (means over the window: loss, CE, aux
losses, LR, grad norm, tokens/s, MFU, per-MoE-layer expert load and dropped fraction) goes to
RUN_DIR/metrics.jsonl, TensorBoard and the console; every `eval_every` steps (and at the end)
the validation loss and perplexity; every `checkpoint.every` steps (and at the end) an async
checkpoint. SIGTERM / Ctrl-C: checkpoint after the current step and return. A non-finite loss
or gradient norm stops training before anything is saved from it (checked for every step
before each save), so the last checkpoint is always a good one.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from moe_jax.checkpoint import Checkpointer, RunError, inspect_run, no_space
from moe_jax.config import Config, TrainConfig
from moe_jax.data import eval_batches, load_data, train_iterator
from moe_jax.metrics import MetricsWriter, compute_units, measure_peak_flops
from moe_jax.model import Transformer
from moe_jax.sharding import (
    BATCH_AXES,
    check_batch_split,
    global_batch,
    make_mesh,
    state_shardings,
    with_shardings,
)
from moe_jax.summary import param_counts, train_flops_per_token


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the last good checkpoint is kept."""


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


# ----------------------------------------------------------------------------- the loop


class GracefulStop:
    """Turns the first SIGTERM / SIGINT into a request to checkpoint and stop after the current
    step; the handlers are then restored, so a second signal acts immediately."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum  # nothing else here: the loop may be anywhere, e.g. printing
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def agreed(self) -> int | None:
        """The signal every process stops on. Each process decides between the same two steps:
        had one gone on into the next step's collectives while another began the checkpoint's
        barrier, both would wait forever. One tiny all-gather a step, multi-process only; it
        waits for the step to finish, so the host dispatches one step ahead no more."""
        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        got = multihost_utils.process_allgather(np.int32(self.signum or 0))
        return int(np.max(got)) or None


def _wait_for_steps(state) -> None:
    """Block until the train steps dispatched so far are done: eval and a checkpoint's copy off
    the device would otherwise wait for them inside their own timing, and the throughput of
    the window leave that compute time out."""
    jax.block_until_ready(state)


@dataclass
class TrainResult:
    step: int  # the step the run stopped at
    val_loss: float | None  # last validation loss of this invocation
    val_unigram_entropy: float  # the unigram baseline of the validation split (nats/token)
    stopped_by: int | None  # signal number when stopped by SIGTERM/SIGINT


def _check_finite(window: list[tuple[int, dict]], last_saved: int | None, run_dir: str) -> None:
    """Raise TrainingError if any step in `window` had a non-finite loss or gradient norm."""
    for step, m in window:
        loss, gnorm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            kept = f"step {last_saved}" if last_saved is not None else "none saved yet"
            raise TrainingError(
                f"loss became {loss} (grad norm {gnorm}) at step {step}; stopped without saving. "
                f"Last good checkpoint: {kept} in {run_dir}. Lower train.lr, raise "
                "train.warmup_steps or tighten train.clip_norm, then resume"
            )


def _summarise(window: list[tuple[int, dict]]) -> dict:
    """Mean of each metric over the steps of the logging window."""
    host = jax.device_get([m for _, m in window])
    return {k: np.mean([h[k] for h in host], axis=0) for k in host[0]}


def train(cfg: Config, *, stop_at: int | None = None) -> TrainResult:
    """Train `cfg` in `cfg.run_dir` to step `cfg.train.steps` (resuming from its latest
    checkpoint, or `train.resume_step`), or stop with a checkpoint after step `stop_at` (to
    split a run into jobs).

    Raises DataError / RunError (bad input or a run dir in use, nothing written),
    TrainingError (divergence) or SaveError (a checkpoint could not be written).
    """
    t = cfg.train
    is_main = jax.process_index() == 0
    prefix = f"[process {jax.process_index()}/{jax.process_count()}] "

    def log(msg: str, others: str | None = None) -> None:
        """Process 0 prints the run's lines; the other processes print `others`, a short line
        where process 0 reports progress. Each host of a cluster usually has a log of its own,
        and one that stays silent cannot be told from one that hangs; but the metrics are the
        same on every process, so repeating them would only be noise."""
        if is_main:
            tqdm.write(msg)
        elif others is not None:
            tqdm.write(prefix + others)
        sys.stdout.flush()  # a log file shows the line now, not a buffer later

    resume = inspect_run(cfg)  # read-only; refuses an incompatible run dir
    data = load_data(cfg, resume.tokenizer if resume else None)
    unigram = data.val_unigram_entropy
    log(f"data: {data.description} (sha256 {data.fingerprint}), tokenizer {data.tokenizer.kind}")
    log(
        f"data: {len(data.train):,} train / {len(data.val):,} val tokens; validation unigram "
        f"entropy {unigram:.3f} nats/token (the baseline a model must beat)"
    )
    if resume and resume.fingerprint and resume.fingerprint != data.fingerprint:
        log(
            f"warning: the corpus differs from the one this run was trained on "
            f"(sha256 {resume.fingerprint}); the data order after resuming is not the original"
        )

    if resume:
        old = resume.config
        changed = [
            f"{key} {a} -> {b}"
            for key, a, b in (
                ("train.batch_size", old.train.batch_size, t.batch_size),
                ("train.seq_len", old.train.seq_len, t.seq_len),
                ("seed", old.seed, cfg.seed),
            )
            if a != b
        ]
        if changed:
            log(
                f"warning: {', '.join(changed)} since the checkpoint: its data position counts "
                "batches of the old shape and order, so the data after resuming does not "
                "continue the original sequence (windows may repeat or be skipped this epoch)"
            )

    e = cfg.moe
    if e.n_experts > 0 and e.top_k == 1 and e.renormalize:
        log(
            "warning: moe.top_k=1 with moe.renormalize=true makes every routing weight 1, so "
            "the router learns from the aux losses only; set moe.renormalize=false for "
            "Switch-style top-1 routing"
        )

    mesh = make_mesh(cfg)
    check_batch_split(mesh, t.batch_size)
    if mesh.size < jax.device_count():
        log(f"mesh: 1 of {jax.device_count()} devices (set mesh.data=-1 to use all)")
    else:
        log(f"mesh: {dict(mesh.shape)} over {mesh.size} devices, {jax.process_count()} process(es)")
    tx = make_optimizer(t)
    graphdef, abstract_state = init_state(cfg, tx, abstract=True, mesh=mesh)
    it = train_iterator(
        data.train,
        t.seq_len,
        t.batch_size,
        cfg.seed,
        jax.process_index(),
        jax.process_count(),
        cfg.data.num_workers,
    )
    # Locks the run dir: from here on no other run writes to it. With train.resume_step in
    # effect, the checkpoints after that step are moved to RUN_DIR/superseded.
    going_back = resume is not None and resume.step == t.resume_step
    ckpt = Checkpointer(cfg, supersede_after=resume.step if going_back else None)
    try:
        expected = resume.step if resume else None
        if ckpt.latest_step() != expected:  # another run saved in it since `inspect_run`
            raise RunError(
                f"run_dir '{cfg.run_dir}' changed while this run was starting (another run "
                f"saved checkpoint {ckpt.latest_step()} in it); rerun the same command"
            )
        if resume:  # onto this run's mesh, whatever mesh saved it
            params, opt_state = ckpt.restore(
                resume.step, abstract_state["params"], abstract_state["opt_state"], it
            )
            state = {
                "step": jax.device_put(
                    jnp.asarray(resume.step, jnp.int32), abstract_state["step"].sharding
                ),
                "params": params,
                "opt_state": opt_state,
            }
            log(f"resumed from {cfg.run_dir} at step {resume.step}")
        else:
            _, state = init_state(cfg, tx, mesh=mesh)
        # Outside the mesh: under it, the test matmul would run replicated on every device.
        peak = t.peak_flops or measure_peak_flops()
        with jax.set_mesh(mesh):
            return _loop(cfg, mesh, graphdef, tx, state, it, data, ckpt, resume, stop_at, log, peak)
    except OSError as e:  # the disk filled up under the metrics too: one line for both
        if not no_space(e):
            raise
        raise ckpt.save_error(e) from None
    finally:
        ckpt.close()  # waits for an async save in flight, so it is never lost


def _loop(
    cfg, mesh, graphdef, tx, state, it, data, ckpt, resume, stop_at, log, unit_peak
) -> TrainResult:
    t = cfg.train
    start = resume.step if resume else 0
    end = t.steps if stop_at is None else min(stop_at, t.steps)
    unigram = data.val_unigram_entropy
    if start >= end:
        msg = f"{cfg.run_dir} is already at step {start} (asked for {end}); nothing to do"
        log(msg, others=msg)
        return TrainResult(start, None, unigram, None)

    total, active = param_counts(cfg)
    flops_per_token = train_flops_per_token(cfg)
    units = compute_units()
    peak = unit_peak * units
    peak_src = "train.peak_flops" if t.peak_flops else "measured jnp.dot peak"
    on_cpu = jax.default_backend() == "cpu"
    if units > 1:
        peak_src += f" x {units} " + ("hosts" if on_cpu else "devices")
    if on_cpu and jax.process_count() > units:  # processes that share a host share its peak
        peak_src += f", {jax.process_count()} processes on {units} host" + "s" * (units > 1)
    tokens_per_step = t.batch_size * t.seq_len
    log(
        f"model: {total:,} params ({active:,} active/token), "
        f"{flops_per_token / 1e6:.1f} MFLOP/token train; peak {peak / 1e9:.0f} GFLOP/s "
        f"({peak_src})"
    )
    val = eval_batches(
        data.val, t.seq_len, t.batch_size, t.eval_batches, jax.process_index(), jax.process_count()
    )
    val = [global_batch(b, mesh) for b in val]
    state_sharding = jax.tree.map(lambda a: a.sharding, state)
    train_step = make_train_step(cfg, graphdef, tx, state_sharding)
    eval_step = make_eval_step(graphdef)
    meta = {"config": cfg, "tokenizer": data.tokenizer, "fingerprint": data.fingerprint}

    last_saved = resume.step if resume else None
    val_loss = None
    window: list[tuple[int, dict]] = []  # (step, device metrics) since the last log line
    timed_steps, timer, excluded = 0, time.perf_counter(), 0.0
    is_main = jax.process_index() == 0
    writer = MetricsWriter(cfg.run_dir, t.tensorboard) if is_main else _NullWriter()
    with (
        GracefulStop() as stop,
        writer,
        tqdm(
            total=end,
            initial=start,
            desc="train",
            disable=None if is_main else True,
            dynamic_ncols=True,
        ) as bar,
    ):
        writer.write(
            {
                "kind": "info",
                "step": start,
                "val_unigram_entropy": unigram,
                "params_total": total,
                "params_active": active,
                "flops_per_token": flops_per_token,
                "peak_flops": peak,
                "compute_units": units,
                "moe_layers": [i for i in range(cfg.model.n_layers) if cfg.is_moe(i)],
            }
        )
        step = start
        while step < end:
            state, metrics = train_step(state, global_batch(next(it), mesh))
            step += 1
            window.append((step, metrics))
            if step == start + 1:  # the first step compiles: keep it out of the throughput
                _wait_for_steps(state)
                seconds = time.perf_counter() - timer
                msg = f"step {step}: compiled and ran the train step in {seconds:.1f} s"
                log(msg, others=msg)
                timer, excluded = time.perf_counter(), 0.0
            else:
                timed_steps += 1
            bar.update(1)

            signum = stop.agreed()
            final, stopping = step == end, signum is not None
            if step % t.log_every == 0 or final or stopping:
                _check_finite(window, last_saved, cfg.run_dir)
                m = _summarise(window)
                window = []
                _wait_for_steps(state)
                elapsed = time.perf_counter() - timer - excluded
                tok_s = timed_steps * tokens_per_step / elapsed if timed_steps else None
                record = {
                    "kind": "train",
                    "step": step,
                    **m,
                    "tokens_per_s": tok_s,
                    "mfu": tok_s * flops_per_token / peak if tok_s else None,
                }
                writer.write(record)
                bar.set_postfix(loss=f"{m['loss']:.3f}", refresh=False)
                log(_format_train(record, end), others=f"step {step}/{end}")
                timed_steps, timer, excluded = 0, time.perf_counter(), 0.0

            if step % t.eval_every == 0 or final:
                _wait_for_steps(state)
                t0 = time.perf_counter()
                val_loss = float(np.mean([eval_step(state["params"], b) for b in val]))
                writer.write(
                    {
                        "kind": "eval",
                        "step": step,
                        "val_loss": val_loss,
                        "val_ppl": math.exp(val_loss),
                    }
                )
                log(
                    f"eval step {step}: val loss {val_loss:.4f}, ppl {math.exp(val_loss):.2f} "
                    f"(unigram baseline {unigram:.4f})"
                )
                excluded += time.perf_counter() - t0

            if step % cfg.checkpoint.every == 0 or final or stopping:
                _wait_for_steps(state)
                t0 = time.perf_counter()
                _check_finite(window, last_saved, cfg.run_dir)
                ckpt.save(step, state["params"], state["opt_state"], it, meta)
                last_saved = step
                excluded += time.perf_counter() - t0
            if stopping:  # the value the save above saw, not a later signal
                msg = (
                    f"received {signal.Signals(signum).name}: stopped at step {step}; "
                    f"checkpoint saved in {cfg.run_dir}, rerun the same command to resume"
                )
                log(msg, others=msg)
                return TrainResult(step, val_loss, unigram, signum)
    return TrainResult(step, val_loss, unigram, None)


class _NullWriter:
    """Metric writer of the non-main processes of a multi-process run."""

    def write(self, record: dict) -> None:
        pass

    def __enter__(self) -> _NullWriter:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _format_train(r: dict, end: int) -> str:
    parts = [
        f"step {r['step']}/{end}",
        f"loss {r['loss']:.4f}",
        f"ce {r['ce']:.4f}",
        f"aux {r['aux_loss']:.4f}",
        f"lr {r['lr']:.2e}",
        f"gnorm {r['grad_norm']:.3f}",
    ]
    if r["tokens_per_s"]:
        parts.append(f"{r['tokens_per_s'] / 1e3:.1f}k tok/s, MFU {100 * r['mfu']:.1f}%")
    if np.size(r["dropped_frac"]):
        parts.append(f"dropped {100 * np.mean(r['dropped_frac']):.1f}%")
    return " | ".join(parts)
