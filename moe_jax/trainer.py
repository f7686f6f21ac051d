"""Training: the loop around the train step (`moe_jax.train_step`).

    from moe_jax.trainer import train
    result = train(cfg)   # trains cfg.run_dir up to cfg.train.steps, resuming from its checkpoint

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
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from moe_jax.config import Config
from moe_jax.data import load_run_data
from moe_jax.metrics import MetricsWriter, compute_units, unit_peak_flops
from moe_jax.run.init_from import init_source, start_state
from moe_jax.run.layout import RunError
from moe_jax.run.policy import inspect_run
from moe_jax.run.store import Checkpointer, no_space
from moe_jax.runtime import platform_line
from moe_jax.sharding import check_batch_split, global_batch, make_mesh
from moe_jax.summary import param_counts, train_flops_per_token
from moe_jax.train_step import init_state, make_eval_step, make_optimizer, make_train_step


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the last good checkpoint is kept."""


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


def _on_mesh(batch, mesh):
    """This process's rows of a batch (an array, or a dict of arrays: tokens, segments, ...)
    -> the global batch, split over the mesh's batch axes."""
    return jax.tree.map(lambda rows: global_batch(rows, mesh), batch)


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
    # init_from: the run a new one starts from (read-only; None when run_dir resumes its own)
    source = init_source(cfg, resume.step if resume else None, log)
    data = load_run_data(cfg, resume.tokenizer if resume else source.tokenizer if source else None)
    unigram = data.val_unigram_entropy
    log(f"data: {data.description} (sha256 {data.fingerprint}), tokenizer {data.tokenizer.kind}")
    log(
        f"data: {data.n_train_tokens:,} train / {data.n_val_tokens:,} val tokens; validation "
        f"unigram entropy {unigram:.3f} nats/token (the baseline a model must beat)"
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

    log(platform_line())
    mesh = make_mesh(cfg)
    check_batch_split(mesh, t.batch_size)
    if mesh.size < jax.device_count():
        log(f"mesh: 1 of {jax.device_count()} devices (set mesh.data=-1 to use all)")
    else:
        log(f"mesh: {dict(mesh.shape)} over {mesh.size} devices, {jax.process_count()} process(es)")
    tx = make_optimizer(t)
    graphdef, abstract_state = init_state(cfg, tx, abstract=True, mesh=mesh)
    # Before the run dir is opened, so that a source checkpoint that cannot be read leaves
    # nothing written.
    state = start_state(source, abstract_state, tx) if source else None
    it = data.train_iterator(cfg, jax.process_index(), jax.process_count())
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
        elif source:
            log(
                f"initialised from {source.run_dir} step {source.step}: its params, a new "
                "optimizer state, step 0"
            )
        else:
            _, state = init_state(cfg, tx, mesh=mesh)
        # Outside the mesh: under it, a measured matmul would run replicated on every device.
        peak = unit_peak_flops(t.peak_flops)
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
    """The steps from `resume` (or 0) to the end; `unit_peak` = (FLOP/s, its source)."""
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
    peak, peak_src = unit_peak[0] * units, unit_peak[1]
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
    val = [
        _on_mesh(b, mesh) for b in data.eval_batches(cfg, jax.process_index(), jax.process_count())
    ]
    state_sharding = jax.tree.map(lambda a: a.sharding, state)
    train_step = make_train_step(cfg, graphdef, tx, state_sharding)
    # Sums and counts: packed batches count different numbers of targets, so the validation
    # loss is their total over the total count, not a mean of the batches' means.
    eval_step = make_eval_step(graphdef, True)  # sums=True
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
            state, metrics = train_step(state, _on_mesh(next(it), mesh))
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
                ce_sum, count = np.sum(
                    jax.device_get([eval_step(state["params"], b) for b in val]), 0, np.float64
                )
                val_loss = float(ce_sum / max(count, 1.0))
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
