"""What a training run says: its console lines (process 0's, and short ones from the other
processes), the data's lines and warnings, the step line, progress without a terminal, and
the one line for a device out of memory.

Every step line (`train.log_every`) carries the time since this invocation started, the
ETA of train.steps at the pace of the steps so far (the first, which compiles, left out)
and, where the backend reports it (`device.memory_stats()`: GPU, TPU; not the CPU), the
device memory in use / peak of the fullest local device. With a terminal a tqdm bar shows
progress between them; without one (SLURM, nohup, a pipe) tqdm turns the bar off, and a
progress line with the same figures is logged every `train.progress_every_s` seconds.
"""

from __future__ import annotations

import re
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from moe_jax.config import Config

GiB = 2**30


def logger():
    """log(msg, others=None): process 0 prints the run's lines; the other processes print
    `others`, a short line where process 0 reports progress. Each host of a cluster usually has
    a log of its own, and one that stays silent cannot be told from one that hangs; but the
    metrics are the same on every process, so repeating them would only be noise."""
    is_main = jax.process_index() == 0
    prefix = f"[process {jax.process_index()}/{jax.process_count()}] "

    def log(msg: str, others: str | None = None) -> None:
        if is_main:
            tqdm.write(msg)
        elif others is not None:
            tqdm.write(prefix + others)
        sys.stdout.flush()  # a log file shows the line now, not a buffer later

    return log


def moe_line(cfg: Config) -> str | None:
    """The balancing and capacity the run trains with, in one line (None without experts):
    an `init_from=HF_DIR` takes its family's unless the config sets them, so say which."""
    e = cfg.moe
    if e.n_experts == 0:
        return None
    capacity = (
        "dropless (capacity_factor 0)"
        if e.capacity_factor <= 0
        else f"capacity_factor {e.capacity_factor:g} (tokens over it dropped)"
    )
    balancing = [f"Switch loss {e.lb_loss_weight:g}", f"z-loss {e.z_loss_weight:g}"]
    if e.seq_aux_loss_weight > 0:
        balancing.append(f"sequence-wise loss {e.seq_aux_loss_weight:g}")
    if e.correction_bias:
        balancing.append(f"correction bias at rate {e.bias_update_rate:g}")
    return f"moe: {capacity}; balancing: {', '.join(balancing)}"


def log_data(cfg: Config, data, resume, log) -> None:
    """The data's lines, and warnings for a resume that changes the data order or a routing
    that cannot learn."""
    t, unigram = cfg.train, data.val_unigram_entropy
    log(f"data: {data.description} (sha256 {data.fingerprint}), tokenizer {data.tokenizer.kind}")
    baseline = ""  # a language model's baseline: DPO's and GRPO's losses are no such thing
    if t.objective == "lm":
        baseline = (
            f"; validation unigram entropy {unigram:.3f} nats/token (the baseline a model "
            "must beat)"
        )
    log(f"data: {data.n_train_tokens:,} train / {data.n_val_tokens:,} val tokens{baseline}")
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


def epochs_line(cfg: Config, data, epochs: float) -> str:
    """The data line of a run sized by train.epochs (`cfg` resolved: its train.steps)."""
    t, unit = cfg.train, data.row_unit
    return (
        f"data: {data.rows_per_epoch:,} train {unit}, {epochs:g} epochs: {t.steps:,} steps of "
        f"{t.batch_size} {unit}"
    )


class NullWriter:
    """Metric writer of the non-main processes of a multi-process run."""

    def write(self, record: dict) -> None:
        pass

    def __enter__(self) -> NullWriter:
        return self

    def __exit__(self, *exc) -> None:
        pass


def format_train(r: dict, end: int) -> str:
    parts = [
        f"step {r['step']}/{end}",
        f"loss {r['loss']:.4f}",
        f"ce {r['ce']:.4f}",
        f"aux {r['aux_loss']:.4f}",
        f"lr {r['lr']:.2e}",
        f"gnorm {r['grad_norm']:.3f}",
    ]
    if "mtp_ce" in r:  # model.mtp_depth: the MTP depths' mean cross-entropy
        parts.insert(3, f"mtp ce {r['mtp_ce']:.4f}")
    if "reward_accuracy" in r:  # train.objective=dpo (moe_jax/posttrain/dpo.py)
        parts.insert(3, f"reward acc {r['reward_accuracy']:.2f} margin {r['reward_margin']:.3f}")
    if "reward_mean" in r:  # train.objective=grpo (moe_jax/posttrain/rl/grpo.py)
        parts.insert(3, f"reward {r['reward_mean']:.3f} clip {r['clip_frac']:.3f}")
    if r["tokens_per_s"]:
        parts.append(f"{r['tokens_per_s'] / 1e3:.1f}k tok/s, MFU {100 * r['mfu']:.1f}%")
    if np.size(r["dropped_frac"]):
        parts.append(f"dropped {100 * np.mean(r['dropped_frac']):.1f}%")
    if np.size(r["exchange_rounds"]) and np.max(r["exchange_rounds"]) > 1:
        parts.append(f"exchange rounds {np.max(r['exchange_rounds']):.2f}")
    return " | ".join(parts)


# ----------------------------------------------------------------------------- progress


def device_memory() -> tuple[int, int, int | None] | None:
    """(bytes in use, peak bytes, limit) of the fullest local device, or None where the
    backend reports no memory (the CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    stats = [s for s in stats if s and "bytes_in_use" in s]
    if not stats:
        return None
    s = max(stats, key=lambda s: s["bytes_in_use"])
    return s["bytes_in_use"], s.get("peak_bytes_in_use", s["bytes_in_use"]), s.get("bytes_limit")


def hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Elapsed time, ETA and device memory for the log lines of one invocation's steps
    `start` .. `end`; `lines`: log a progress line every `every_s` seconds (no bar)."""

    def __init__(self, start: int, end: int, every_s: float, lines: bool, log):
        self.start, self.end, self.every_s, self.lines, self.log = start, end, every_s, lines, log
        self.t0 = self.last_line = time.perf_counter()
        self.paced_from: tuple[int, float] | None = None  # after the compiling step

    def compiled(self, step: int) -> None:
        """`step` (the first, which compiled) is done: the pace is counted from here."""
        self.paced_from = (step, time.perf_counter())

    def fields(self, step: int) -> list[str]:
        now = time.perf_counter()
        parts = [f"elapsed {hms(now - self.t0)}"]
        if self.paced_from and step > self.paced_from[0]:
            per_step = (now - self.paced_from[1]) / (step - self.paced_from[0])
            parts.append(f"ETA {hms(per_step * (self.end - step))}")
        if mem := device_memory():
            used, peak, limit = mem
            of = f" of {limit / GiB:.1f}" if limit else ""
            parts.append(f"mem {used / GiB:.2f} GiB{of}, peak {peak / GiB:.2f}")
        return parts

    def shown(self) -> None:
        """A step line just showed the figures: the next progress line is due later."""
        self.last_line = time.perf_counter()

    def tick(self, step: int) -> None:
        """After each step: the progress line, when it is due (no bar only)."""
        if not self.lines or time.perf_counter() - self.last_line < self.every_s:
            return
        self.last_line = time.perf_counter()
        pct = 100 * step / self.end
        line = " | ".join([f"progress: step {step}/{self.end} ({pct:.0f}%)", *self.fields(step)])
        self.log(line, others=f"step {step}/{self.end}")


# ----------------------------------------------------------------------------- out of memory

OOM_KNOBS = (
    "a smaller train.batch_size (or more train.grad_accum), model.remat=dots|full, moe.row_chunks, "
    "a mesh that splits more (mesh.fsdp, mesh.expert, mesh.tensor)"
)


def is_out_of_memory(e: BaseException) -> bool:
    """An XLA runtime error from a device out of memory (RESOURCE_EXHAUSTED)."""
    text = str(e)
    return isinstance(e, jax.errors.JaxRuntimeError) and (
        "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
    )


def _asked(text: str) -> str:
    """The memory XLA's message says the program asked for, and what there was, if it does:
    "allocate N bytes" (the GPU's allocator), "Used X of Y hbm" (TPU's compiler)."""
    if m := re.search(r"allocate (\d+) bytes", text):
        said = f"; asked for {int(m.group(1)) / GiB:.2f} GiB"
        if free := re.search(r"(\d+) bytes (?:free|available)", text):
            said += f" with {int(free.group(1)) / GiB:.2f} GiB free"
        return said
    if m := re.search(r"Used ([\d.]+\s*[KMGT]i?B?) of ([\d.]+\s*[KMGT]i?B?) (\w+)", text):
        return f"; needs {m.group(1)} of the {m.group(2)} of {m.group(3)}"
    return ""


def out_of_memory_line(e: BaseException, step: int, saved: int | None, run_dir: str) -> str:
    """One line for a device out of memory in step `step` (the train step's program, or the
    eval's at an eval step): the bytes asked and free when XLA's message says them, the last
    checkpoint, and the knobs that lower the step's memory."""
    kept = f"step {saved}" if saved is not None else "none saved yet"
    return (
        f"device out of memory in the train step's program at step {step}"
        f"{_asked(' '.join(str(e).split()))}. Last checkpoint: {kept} in {run_dir}. Lower the "
        f"memory with {OOM_KNOBS}; check a fit first with python -m moe_jax.aot"
    )
