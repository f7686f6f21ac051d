"""Training: the loop around the train step (`moe_jax.train.step`).

    from moe_jax.train.loop import train
    result = train(cfg)   # trains cfg.run_dir up to cfg.train.steps, resuming from its checkpoint

The loop: every `log_every` steps a metrics record (means over the window: loss, CE, aux
losses, LR, grad norm, tokens/s, MFU, per-MoE-layer expert load and dropped fraction) goes to
RUN_DIR/metrics.jsonl, TensorBoard and the console; every `eval_every` steps (and at the end)
the validation metrics (`evaluation`: the objective's), and with `eval.tasks` the tasks' every
`eval.every` steps (moe_jax/eval/in_training.py); every `checkpoint.every` steps (and at the
end) an async checkpoint. SIGTERM / Ctrl-C: checkpoint after the current step and return. A
non-finite loss or gradient norm stops training before anything is saved from it (checked for
every step before each save), so the last checkpoint is always a good one.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import partial

import jax
import numpy as np
from tqdm import tqdm

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.config.epochs import with_epochs
from moe_jax.data import load_run_data
from moe_jax.errors import MoeJaxError
from moe_jax.eval.in_training import TaskEval
from moe_jax.inference.weights import WeightsDoNotFit, check_train_fits
from moe_jax.observe.profile import StepProfiler
from moe_jax.observe.trackers import check_trackers, open_trackers
from moe_jax.observe.writers import MetricsWriter
from moe_jax.process_setup import platform_line
from moe_jax.run import programs
from moe_jax.run.checkpoints import Checkpointer
from moe_jax.run.layout import RunError
from moe_jax.run.output import no_space
from moe_jax.run.policy import inspect_run
from moe_jax.sharding import check_batch_split, global_batch, make_mesh
from moe_jax.summary.counts import param_counts, train_flops_per_token
from moe_jax.summary.peaks import compute_units, unit_peak_flops
from moe_jax.train import hf_exports
from moe_jax.train.console import (
    NullWriter,
    Progress,
    device_memory,
    epochs_line,
    format_train,
    is_out_of_memory,
    log_data,
    logger,
    moe_line,
    out_of_memory_line,
)
from moe_jax.train.evaluation import Validation, closing_line
from moe_jax.train.init_from import init_source, start_state, with_source_architecture
from moe_jax.train.preflight import check_kernels
from moe_jax.train.state import make_state
from moe_jax.train.step import init_program, make_optimizer, make_train_step


class TrainingError(MoeJaxError, RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the last good checkpoint is kept."""

    exit_code = 1  # the run is fine up to its last complete checkpoint


class OutOfMemory(TrainingError):
    """A device ran out of memory in a step; the message is one line naming the knobs."""


# ----------------------------------------------------------------------------- the loop


class GracefulStop:
    """Turns the first SIGTERM / SIGINT / SIGHUP (a closed terminal) into a request to
    checkpoint and stop after the current step; the handlers are then restored, so a second
    signal acts immediately."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

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


def _checked_mesh(cfg: Config, log) -> jax.sharding.Mesh:
    """The run's mesh, its batch split and kernels checked (the step traces after the run
    dir is made), and its line logged."""
    mesh = make_mesh(cfg)
    check_batch_split(mesh, cfg.train.batch_size)
    check_kernels(cfg, dict(mesh.shape))
    if mesh.size < jax.device_count():
        log(f"mesh: 1 of {jax.device_count()} devices (set mesh.data=-1 to use all)")
    else:
        log(f"mesh: {dict(mesh.shape)} over {mesh.size} devices, {jax.process_count()} process(es)")
    return mesh


def _read_data(cfg: Config, resume, source, log):
    """-> (cfg, the run's data, read with the resumed run's or the source's tokenizer);
    with train.epochs, cfg's train.steps counted from the data's rows."""
    data = load_run_data(cfg, resume.tokenizer if resume else source.tokenizer if source else None)
    log_data(cfg, data, resume, log)
    if (epochs := cfg.train.epochs) is not None:
        cfg = with_epochs(cfg, data.rows_per_epoch, data.row_unit)
        log(epochs_line(cfg, data, epochs))
    return cfg, data


def train(
    cfg: Config, *, stop_at: int | None = None, given: Collection[str] | None = None
) -> TrainResult:
    """Train `cfg` in `cfg.run_dir` to step `cfg.train.steps` (resuming from its latest
    checkpoint, or `train.resume_step`), or stop with a checkpoint after step `stop_at` (to
    split a run into jobs). `given`: the keys the user set (`config.cli_given_keys`); an
    `init_from=HF_DIR` takes its family's run-time keys (capacity, balancing) for the others
    (None: cfg's own stand).

    Raises DataError / RunError (bad input or a run dir in use, nothing written),
    TrainingError (divergence) or SaveError (a checkpoint could not be written).
    """
    log = logger()
    # init_from (a run or HF_DIR): its architecture and tokenizer; HF_DIR's run-time keys
    cfg = with_source_architecture(cfg, given)
    cfg.moe.check_training()  # before anything is read or written
    hf_exports.check(cfg)  # checkpoint.export_hf: the model has a Hugging Face form
    resume = inspect_run(cfg)  # read-only; refuses an incompatible run dir
    # init_from: the run a new one starts from (read-only; None when run_dir resumes its own)
    source = init_source(cfg, resume.step if resume else None, log)
    cfg, data = _read_data(cfg, resume, source, log)
    if (line := moe_line(cfg)) is not None:
        log(line)
    tasks = TaskEval.start(cfg, data.tokenizer)  # eval.tasks checked before anything is written
    check_trackers(cfg)  # a tracker's missing package too
    log(platform_line())
    mesh = _checked_mesh(cfg, log)
    # dpo and grpo: their reference; grpo: its updates a step
    tx = make_optimizer(cfg.train, backends.compute_dtype(cfg.model.dtype), cfg.rl)
    init = partial(init_program, cfg, tx)  # kept: a second run of this model reuses it
    graphdef, abstract_state, initial_state = programs.kept("init", cfg, init, mesh)
    try:  # before anything is allocated: a model too big fails here, in one line
        check_train_fits(abstract_state)
    except WeightsDoNotFit as e:
        raise RunError(f"run_dir '{cfg.run_dir}': {e}") from None
    # Before the run dir is opened: a source checkpoint that cannot be read writes nothing.
    state = None
    if source:
        state, source = start_state(source, abstract_state, tx, cfg)
    it = data.train_iterator(cfg, jax.process_index(), jax.process_count())
    # Locks the run dir: from here on no other run writes to it. With train.resume_step in
    # effect, the checkpoints after that step are moved to RUN_DIR/superseded.
    going_back = resume is not None and resume.step == cfg.train.resume_step
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
            if opt_state is None:  # params only (an import): a new optimizer state
                opt_sharding = jax.tree.map(lambda a: a.sharding, abstract_state["opt_state"])
                opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
            state = make_state(resume.step, params, opt_state, abstract_state["step"].sharding)
            log(f"resumed from {cfg.run_dir} at step {resume.step}")
        elif source:
            log(
                f"initialised from {source.run_dir} step {source.step}: its params, a new "
                "optimizer state, step 0"
            )
        else:
            state = initial_state()
        # Outside the mesh: under it, a measured matmul would run replicated on every device.
        peak = unit_peak_flops(cfg.train.peak_flops)
        training = Training(cfg, mesh, graphdef, tx, it, data, ckpt, log, peak, tasks)
        with jax.set_mesh(mesh):
            start, saved = (resume.step, resume.step) if resume else (0, None)
            return training.loop(state, start=start, last_saved=saved, stop_at=stop_at)
    except OSError as e:  # the disk filled up under the metrics too: one line for both
        if not no_space(e):
            raise
        raise ckpt.save_error(e) from None
    finally:
        ckpt.close()  # waits for an async save in flight, so it is never lost


@dataclass
class _Window:
    """The steps since the last log line: their device metrics and the time they took, less
    what eval and saving took meanwhile (the first step, which compiles, is not timed)."""

    metrics: list[tuple[int, dict]] = field(default_factory=list)
    timed_steps: int = 0
    timer: float = field(default_factory=time.perf_counter)
    excluded: float = 0.0

    def restart(self) -> None:
        self.timed_steps, self.timer, self.excluded = 0, time.perf_counter(), 0.0


@dataclass
class Training:
    """One training invocation's fixed parts; `loop` runs the steps, each followed by the
    named duties that fall on it: log, eval, save, stop."""

    cfg: Config
    mesh: jax.sharding.Mesh
    graphdef: object
    tx: object
    it: object  # the data iterator (its position is saved with every checkpoint)
    data: object
    ckpt: Checkpointer
    log: object
    unit_peak: tuple[float, str]  # one compute unit's FLOP/s and where the figure comes from
    tasks: TaskEval | None  # the harness tasks of eval.tasks

    def loop(
        self, state, *, start: int, last_saved: int | None, stop_at: int | None
    ) -> TrainResult:
        """The steps from `start` to train.steps (or `stop_at`); `last_saved`: the run's last
        checkpoint (the one resumed), named when a step diverges."""
        cfg, t = self.cfg, self.cfg.train
        end = t.steps if stop_at is None else min(stop_at, t.steps)
        self.unigram = self.data.val_unigram_entropy
        if start >= end:
            msg = f"{cfg.run_dir} is already at step {start} (asked for {end}); nothing to do"
            self.log(msg, others=msg)
            return TrainResult(start, None, self.unigram, None)
        self._prepare(state, start)
        self.last_saved, self.saves = last_saved, 0
        self.val_loss, self.last_eval = None, None
        is_main = jax.process_index() == 0
        writer = NullWriter()
        if is_main:  # the trackers' runs begin (W&B's, MLflow's) before the first step
            writer = MetricsWriter(cfg.run_dir, "tensorboard" in t.trackers, open_trackers(cfg))
        bar = tqdm(total=end, initial=start, desc="train", disable=None if is_main else True,
                   dynamic_ncols=True)  # fmt: skip
        # Without a terminal tqdm turns the bar off: progress lines instead
        self.progress = Progress(start, end, t.progress_every_s, is_main and bar.disable, self.log)
        profile_steps = t.profile_steps if is_main else 0  # one trace: process 0's
        profiler = StepProfiler(cfg.run_dir, t.profile_start, profile_steps, self.log)
        self.step = self.running = start  # the steps done, and the one the device is on
        with GracefulStop() as stop, writer, bar, profiler:
            writer.write(self._info(start))
            try:
                if start == 0 and cfg.init_from is not None:  # the source's own figures
                    self._evaluate(state, 0, _Window(), writer)
                result = self._steps(state, end, stop, writer, bar, profiler)
                if result.stopped_by is None and result.step == t.steps:
                    line = closing_line(cfg, result.step, self.last_eval)
                    self.log(line, others=f"done: step {result.step}")  # metrics: process 0's
                return result
            except Exception as e:  # a device out of memory: one line, not XLA's traceback
                if not is_out_of_memory(e):
                    raise
                line = out_of_memory_line(e, self.running, self.last_saved, cfg.run_dir)
                raise OutOfMemory(line) from None

    def _steps(self, state, end: int, stop, writer, bar, profiler) -> TrainResult:
        """Each step from self.step to `end`, then its duties: log, eval, save, stop."""
        cfg, t = self.cfg, self.cfg.train
        start, window = self.step, _Window()
        while self.step < end:
            batch = next(self.it)
            if self.rollouts is not None:  # train.objective=grpo: this state's rollouts
                batch = self.rollouts(state, batch, self.step)
            batch = _on_mesh(batch, self.mesh)
            self.running = self.step + 1
            profiler.before(self.step + 1, partial(self._compiled_text, state, batch))
            state, metrics = self.train_step(state, batch)
            self.step = step = self.step + 1
            window.metrics.append((step, metrics))
            if step == start + 1:  # the first step compiles: keep it out of the throughput
                self._compiled(state, step, window)
            else:
                window.timed_steps += 1
            bar.update(1)
            self.progress.tick(step)
            signum = stop.agreed()
            final, stopping = step == end, signum is not None
            profiler.after(step, state, final or stopping)
            if step % t.log_every == 0 or final or stopping:
                self._log_window(state, step, end, window, writer, bar)
            if step % t.eval_every == 0 or final:
                self._evaluate(state, step, window, writer)
            if self.tasks is not None and self.tasks.due(step, final):
                self._evaluate_tasks(state, step, window, writer)
            if step % cfg.checkpoint.every == 0 or final or stopping:
                self._save(state, step, window, final)
            if stopping:  # the value the save above saw, not a later signal
                msg = (
                    f"received {signal.Signals(signum).name}: stopped at step {step}; "
                    f"checkpoint saved in {cfg.run_dir}, rerun the same command to resume"
                )
                self.log(msg, others=msg)
                return TrainResult(step, self.val_loss, self.unigram, signum)
        return TrainResult(self.step, self.val_loss, self.unigram, None)

    def _compiled_text(self, state, batch) -> str:
        """The train step's compiled HLO (jax's cache holds it after the first step)."""
        return self.train_step.lower(state, batch).compile().as_text()

    def _prepare(self, state, start: int) -> None:
        """The step functions, the validation batches and the throughput's denominators."""
        cfg = self.cfg
        self.total, self.active = param_counts(cfg)
        self.flops_per_token = train_flops_per_token(cfg)
        self.units = compute_units()
        peak_src = self.unit_peak[1]
        self.peak = self.unit_peak[0] * self.units
        on_cpu = jax.default_backend() == "cpu"
        if self.units > 1:
            peak_src += f" x {self.units} " + ("hosts" if on_cpu else "devices")
        if on_cpu and jax.process_count() > self.units:  # processes on a host share its peak
            peak_src += f", {jax.process_count()} processes on {self.units} host" + "s" * (
                self.units > 1
            )
        self.log(
            f"model: {self.total:,} params ({self.active:,} active/token), "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token train; peak {self.peak / 1e9:.0f} "
            f"GFLOP/s ({peak_src})"
        )
        shardings = jax.tree.map(lambda a: a.sharding, state)  # kept: see train()
        build = partial(make_train_step, cfg, self.graphdef, self.tx)
        self.train_step = programs.kept("train_step", cfg, build, shardings)
        self.rollouts = None
        if cfg.train.objective == "grpo":  # the sampler and the rewards (moe_jax/posttrain/rl/)
            from moe_jax.posttrain.rl.collect import Rollouts

            self.rollouts = Rollouts(cfg, self.graphdef, self.data, self.mesh)
        on_mesh = partial(_on_mesh, mesh=self.mesh)
        self.validation = Validation(cfg, self.graphdef, self.data, on_mesh, self.rollouts)
        self.meta = {
            "config": cfg,
            "tokenizer": self.data.tokenizer,
            "fingerprint": self.data.fingerprint,
        }

    def _info(self, start: int) -> dict:
        return {
            "kind": "info",
            "step": start,
            "val_unigram_entropy": self.unigram,
            "params_total": self.total,
            "params_active": self.active,
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak,
            "compute_units": self.units,
            "objective": self.cfg.train.objective,  # what the plots draw (observe/plot.py)
            "moe_layers": [i for i in range(self.cfg.model.n_layers) if self.cfg.is_moe(i)],
        }

    def _compiled(self, state, step: int, window: _Window) -> None:
        _wait_for_steps(state)
        seconds = time.perf_counter() - window.timer
        msg = f"step {step}: compiled and ran the train step in {seconds:.1f} s"
        self.log(msg, others=msg)
        self.progress.compiled(step)
        window.restart()

    def _log_window(self, state, step: int, end: int, window: _Window, writer, bar) -> None:
        """The window's means (finite, or TrainingError) to the metrics and the console."""
        _check_finite(window.metrics, self.last_saved, self.cfg.run_dir)
        m = _summarise(window.metrics)
        window.metrics = []
        _wait_for_steps(state)
        elapsed = time.perf_counter() - window.timer - window.excluded
        tokens = self.cfg.train.batch_size * self.cfg.train.seq_len
        tok_s = window.timed_steps * tokens / elapsed if window.timed_steps else None
        record = {
            "kind": "train",
            "step": step,
            **m,
            "tokens_per_s": tok_s,
            "mfu": tok_s * self.flops_per_token / self.peak if tok_s else None,
        }
        if mem := device_memory():  # where the backend reports it
            record["device_mem_bytes"], record["device_peak_bytes"] = mem[:2]
        writer.write(record)
        bar.set_postfix(loss=f"{m['loss']:.3f}", refresh=False)
        line = " | ".join([format_train(record, end), *self.progress.fields(step)])
        self.log(line, others=f"step {step}/{end}")
        self.progress.shown()
        window.restart()

    def _evaluate(self, state, step: int, window: _Window, writer) -> None:
        """The validation metrics, the objective's own among them (`evaluation`; their time
        left out of the window's throughput)."""
        _wait_for_steps(state)
        t0 = time.perf_counter()
        self.last_eval, line = self.validation.run(state, step)
        self.val_loss = self.last_eval["val_loss"]
        writer.write(self.last_eval)
        self.log(line)
        window.excluded += time.perf_counter() - t0

    def _evaluate_tasks(self, state, step: int, window: _Window, writer) -> None:
        """The harness tasks on this step's params (their time left out of the throughput)."""
        _wait_for_steps(state)
        t0 = time.perf_counter()
        record = self.tasks.run(self.graphdef, state["params"], self.mesh, step)
        if record is None:
            self.log(f"warning: downstream evals stopped: {self.tasks.failed}")
        else:
            writer.write(record)
            shown = [f"{k} {v:.4f}" for k, v in record.items() if k not in ("kind", "step")]
            self.log(f"tasks step {step}: {', '.join(shown)}")
        window.excluded += time.perf_counter() - t0

    def _save(self, state, step: int, window: _Window, final: bool = False) -> None:
        """A checkpoint of `step`, after every step since the last one was checked finite;
        and its Hugging Face copy where checkpoint.export_hf asks for one (`hf_exports`)."""
        _wait_for_steps(state)
        t0 = time.perf_counter()
        _check_finite(window.metrics, self.last_saved, self.cfg.run_dir)
        self.ckpt.save(step, state["params"], state["opt_state"], self.it, self.meta)
        self.last_saved, self.saves = step, self.saves + 1
        if hf_exports.due(self.cfg, self.saves, final):
            self.ckpt.wait()  # the copy reads the save from disk
            if out := hf_exports.export(self.cfg, step):
                self.log(f"step {step}: Hugging Face copy in {out}")
        window.excluded += time.perf_counter() - t0
