"""Profiles of training: a jax.profiler trace of chosen steps, and where its time went.

    python train.py train.profile_start=5 train.profile_steps=3     # -> RUN_DIR/profile/
    python -m moe_jax.profile runs/tiny/profile                   # the newest trace's summary
    tensorboard --logdir runs/tiny/profile                        # or ui.perfetto.dev

Training (`StepProfiler`, called by the trainer on process 0) traces steps `profile_start`
.. `profile_start + profile_steps - 1` into RUN_DIR/profile/plugins/profile/<time>/ (XProf's
layout: TensorBoard's profile plugin and Perfetto read it) and writes beside the trace the
compiled train step's HLO (`train_step.hlo.txt`, whose ops' `op_name` carry the named parts
of `moe_jax.named_scopes`) and `steps.json` (which steps, their wall time); each device op's event
in perfetto_trace.json.gz gets its `op_name` and `part` as args (shown by Perfetto).

The summary charges each op of the trace to a part through its `op_name` (the innermost
scope of `moe_jax.named_scopes.PARTS`; "transpose(" marks the backward) and to a kernel kind by
its name (matmul, attention, collective, copy, other). Device time is each op's own time:
the kernels of a GPU's streams or a TPU's XLA ops; on a CPU, the XLA runtime's ops on its
threads, less the ops nested inside them (a loop's event spans its body's events).
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import jax

from moe_jax.errors import MoeJaxError
from moe_jax.named_scopes import PARTS
from moe_jax.run.door import command, say

PROFILE_DIR = "profile"  # RUN_DIR/profile
HLO_FILE = "train_step.hlo.txt"
STEPS_FILE = "steps.json"

# Kernel names by kind (cuBLAS / CUTLASS GEMMs, cuDNN attention, NCCL / XLA collectives,
# copies; XLA:CPU's dot thunks and XNNPACK fusions), else a fusion.
KERNEL_KINDS = (  # attention first: cuDNN's flash kernels' names say wgmma too
    ("attention", re.compile(r"fmha|flash|sdpa|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|cublas|wgmma|^dot|ynn_fusion", re.I)),
    (
        "collective",
        re.compile(r"nccl|all.?reduce|all.?gather|all.?to.?all|reduce.?scatter|permute", re.I),
    ),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def part_of(op_name: str) -> str:
    """The innermost named part (moe_jax.named_scopes) in an op's `op_name`, else "other"."""
    tokens = re.split(r"[/()]", op_name)
    return next((t for t in reversed(tokens) if t in PARTS), "other")


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> op_name, for every instruction of a compiled module's text."""
    pattern = r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\""
    return dict(re.findall(pattern, hlo_text, re.M))


def _op_name(names: dict[str, str], op: str) -> str:
    """`op`'s op_name; a GPU kernel named after its fusion writes `fusion_3` for `fusion.3`."""
    return names.get(op) or names.get(re.sub(r"_(\d+)$", r".\1", op), "")


# ----------------------------------------------------------------------------- the trace


class TraceError(MoeJaxError, ValueError):
    """A trace (or a file beside it) that cannot be read; the message names it."""


def read_events(path: str | Path) -> list[dict]:
    """The events of a Chrome / Perfetto JSON trace (gzipped or not); TraceError if the
    file cannot be read as one (cut off, not gzip, not JSON, not readable)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, ValueError) as e:  # gzip.BadGzipFile is an OSError
        raise _unreadable(path, e) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise _unreadable(path, "not a list of events (traceEvents)")
    return events


def _unreadable(path, why) -> TraceError:
    return TraceError(
        f"cannot read the trace file '{path}': {why}; trace the steps again "
        "(train.profile_steps=N) or pass another trace"
    )


def device_ops(events: list[dict]) -> list[dict]:
    """The trace's device work as complete events: a GPU's stream kernels or a TPU's XLA
    ops ("/device:GPU|TPU" processes), else (CPU) the XLA ops on the runtime's threads
    (events with an `hlo_op`). Each gets "self": its duration less that of the events
    nested inside it on its thread (a while loop's or call's event spans its body's)."""
    meta = defaultdict(dict)
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            key = e["pid"] if e["name"] == "process_name" else (e["pid"], e.get("tid"))
            meta[e["name"]][key] = e["args"]["name"]
    procs, threads = meta["process_name"], meta["thread_name"]
    devices = {p for p, n in procs.items() if re.match(r"/device:(GPU|TPU)", n)}
    if devices:
        names = {k: n for k, n in threads.items() if k[0] in devices}
        # the kernels' own lines (a GPU's streams, else a TPU's XLA Ops), not those derived
        # from them (modules, name scopes, steps)
        lines = {k for k, n in names.items() if n.startswith("Stream")}
        lines = lines or {k for k, n in names.items() if n.startswith("XLA Ops")}
        keep = (lambda e: (e["pid"], e.get("tid")) in lines) if lines else None
        keep = keep or (lambda e: e["pid"] in devices)
    else:
        keep = lambda e: "hlo_op" in e.get("args", {})
    spans = [e for e in events if e.get("ph") == "X" and e.get("dur") and keep(e)]
    spans.sort(key=lambda e: (e["pid"], e.get("tid"), e["ts"], -e["dur"]))
    stack: list[dict] = []
    for e in spans:
        e["self"] = e["dur"]
        while stack and (
            (stack[-1]["pid"], stack[-1].get("tid")) != (e["pid"], e.get("tid"))
            or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]
        ):
            stack.pop()
        if stack:  # nested: its time is not its parent's own
            stack[-1]["self"] -= e["dur"]
        stack.append(e)
    return spans


def summarise(events: list[dict], steps: int, hlo_text: str = "") -> dict:
    """Per step: the device's busy time (the union of its ops' spans), its ops' own time by
    named part (forward / backward, through `hlo_text`'s op_names) and by kernel kind, and
    the 15 longest ops. Times in ms."""
    names = op_names(hlo_text) if hlo_text else {}
    spans = device_ops(events)
    by_name, count, by_kind = defaultdict(float), defaultdict(int), defaultdict(float)
    by_part = defaultdict(lambda: [0.0, 0.0])  # part -> [forward, backward]
    for e in spans:
        us, args = max(e["self"], 0.0), e.get("args", {})
        by_name[e["name"]] += us
        count[e["name"]] += 1
        by_kind[kernel_kind(e["name"])] += us
        op_name = args.get("op_name") or args.get("tf_op")
        op_name = op_name or _op_name(names, args.get("hlo_op") or e["name"])
        by_part[part_of(op_name)]["transpose(" in op_name] += us
    busy, end = 0.0, -math.inf
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in spans):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    ms = lambda us: round(us / 1e3 / steps, 3)
    top = sorted(by_name, key=by_name.get, reverse=True)[:15]
    parts = sorted(by_part.items(), key=lambda kv: -sum(kv[1]))
    return dict(
        busy_ms=ms(busy),
        kernels_per_step=len(spans) // steps,
        kinds_ms={k: ms(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        parts_ms={p: {"fwd": ms(f), "bwd": ms(b)} for p, (f, b) in parts},
        top=[[n[:120], ms(by_name[n]), math.ceil(count[n] / steps)] for n in top],
    )


def annotate(path: Path, hlo_text: str) -> int:
    """Write each device op's `op_name` and named part into its event's args in the trace
    at `path` (Perfetto shows them on the op), from the program's HLO: -> ops annotated."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names, annotated = op_names(hlo_text), 0
    for e in device_ops(events):
        args = e.setdefault("args", {})
        if op_name := _op_name(names, args.get("hlo_op") or e["name"]):
            args["op_name"], args["part"] = op_name, part_of(op_name)
            annotated += 1
        e.pop("self")
    with gzip.open(path, "wt") as f:
        json.dump(data, f)
    return annotated


def profile(fn, steps: int, trace_dir: str, hlo_text: str = "") -> dict:
    """`fn()` (one blocking step) `steps` times under jax.profiler: `summarise`'s figures
    per step, and the wall time. On the CPU XLA's runtime threads stand in for the device."""
    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            fn()
    wall = (time.perf_counter() - t0) / steps
    path = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))[-1]
    return dict(wall_ms=round(1e3 * wall, 3), **summarise(read_events(path), steps, hlo_text))


# ----------------------------------------------------------------------------- in training


class StepProfiler:
    """Traces steps [start, start + steps) of a training run into RUN_DIR/profile (one trace
    a run invocation; `steps` 0: off). The trainer calls `before` each step is dispatched
    and `after` it returns; `close` ends a trace that an exception interrupted."""

    def __init__(self, run_dir: str, start: int, steps: int, log):
        self.dir = Path(run_dir) / PROFILE_DIR
        self.first, self.last = start, start + steps - 1
        self.log = log
        self.on = steps > 0
        self.active = False

    def before(self, step: int, compiled_text) -> None:
        """`step` (1-based) is about to be dispatched; `compiled_text()`: its program's HLO."""
        if not self.on or self.active or not self.first <= step <= self.last:
            return
        self.hlo = compiled_text()  # a cache hit after step 1, before the trace begins
        self.from_step, self.active = step, True
        self.dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
        self.t0 = time.perf_counter()

    def after(self, step: int, state, last: bool) -> None:
        """`step` was dispatched; `last`: the run stops after it."""
        if self.active and (step >= self.last or last):
            jax.block_until_ready(state)
            self._stop(step)

    def close(self) -> None:
        if self.active:
            self._stop(None)

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stop(self, step: int | None) -> None:
        wall = time.perf_counter() - self.t0
        jax.profiler.stop_trace()
        self.active, self.on = False, False
        sessions = sorted((self.dir / "plugins" / "profile").iterdir(), key=lambda p: p.name)
        session = sessions[-1]  # named by the time it was written
        (session / HLO_FILE).write_text(self.hlo)
        trace = session / "perfetto_trace.json.gz"
        if trace.is_file():  # the parts on the trace's own events, for Perfetto
            annotate(trace, self.hlo)
        if step is None:  # interrupted: the trace is kept, its step count unknown
            return
        n = step - self.from_step + 1
        info = {"first_step": self.from_step, "last_step": step, "wall_ms": 1e3 * wall / n}
        (session / STEPS_FILE).write_text(json.dumps(info))
        self.log(
            f"profile: steps {self.from_step}-{step} traced into {session}; "
            f"summary: python -m moe_jax.profile {self.dir}"
        )


# ----------------------------------------------------------------------------- summary

USAGE = "usage: python -m moe_jax.profile RUN_DIR/profile [--top N]"


def newest_trace(path: Path) -> Path | None:
    """The newest perfetto trace under `path` (a run dir, its profile dir, a session)."""
    if path.is_file():
        return path
    traces = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.parent.name)
    return traces[-1] if traces else None


def _beside(trace: Path) -> tuple[dict, str]:
    """The steps.json (first_step, last_step, wall_ms; {} if absent) and the HLO text ("" if
    absent) beside `trace`; TraceError if one is there and cannot be read."""
    steps_file, hlo_file = trace.parent / STEPS_FILE, trace.parent / HLO_FILE
    try:
        info = json.loads(steps_file.read_text()) if steps_file.is_file() else {}
        keys = ("first_step", "last_step", "wall_ms")
        if info and not (
            isinstance(info, dict) and all(isinstance(info.get(k), int | float) for k in keys)
        ):
            raise ValueError(f"not an object of {', '.join(keys)}")
    except (OSError, ValueError) as e:
        raise _unreadable(steps_file, e) from None
    try:
        return info, hlo_file.read_text() if hlo_file.is_file() else ""
    except (OSError, ValueError) as e:
        raise _unreadable(hlo_file, e) from None


def format_summary(trace: Path, top: int = 10) -> str:
    info, hlo = _beside(trace)
    steps = info["last_step"] - info["first_step"] + 1 if info else 1
    s = summarise(read_events(trace), steps, hlo)
    head = f"trace {trace}"
    if info:
        head += (
            f"\nsteps {info['first_step']}-{info['last_step']}: wall "
            f"{info['wall_ms']:.1f} ms/step, device busy {s['busy_ms']:.1f} ms/step, "
            f"{s['kernels_per_step']} ops/step (times below are per step)"
        )
    else:
        head += f"\nno {STEPS_FILE}: times are the whole trace's; device busy {s['busy_ms']} ms"
    total = sum(v["fwd"] + v["bwd"] for v in s["parts_ms"].values()) or 1.0
    lines = [head, "", f"{'part':14s} {'fwd ms':>9s} {'bwd ms':>9s} {'total':>9s} {'share':>6s}"]
    for part, v in s["parts_ms"].items():
        t = v["fwd"] + v["bwd"]
        lines.append(f"{part:14s} {v['fwd']:9.2f} {v['bwd']:9.2f} {t:9.2f} {t / total:6.1%}")
    if not hlo:
        lines.append(f"(no {HLO_FILE} beside the trace: ops are not charged to parts)")
    lines += ["", f"{'kernel kind':14s} {'ms':>9s} {'share':>6s}"]
    lines += [f"{k:14s} {v:9.2f} {v / total:6.1%}" for k, v in s["kinds_ms"].items()]
    lines += ["", f"{'op':40s} {'ms':>9s} {'calls':>6s}"]
    lines += [f"{n[:40]:40s} {ms:9.2f} {c:6d}" for n, ms, c in s["top"][:top]]
    lines.append("(ms and calls per step)")
    return "\n".join(lines)


@command
def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if not args:
        return say(f"no trace directory given; {USAGE}")
    top = 10
    if "--top" in args:
        i = args.index("--top")
        try:
            top = int(args[i + 1])
        except (IndexError, ValueError):
            return say(f"--top takes a number of ops; {USAGE}")
        del args[i : i + 2]
    trace = newest_trace(Path(args[0])) if Path(args[0]).exists() else None
    if trace is None:
        return say(
            f"no perfetto_trace.json.gz under '{args[0]}'; train with "
            "train.profile_steps=N (and train.profile_start=S) to write one"
        )
    print(format_summary(trace, top))
    return 0
