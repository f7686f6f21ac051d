"""The engine's thread: it steps the engine while there is work and hands each request's
tokens to the asyncio side (the HTTP handlers) through a queue per request.

The engine is not thread-safe: submit, cancel and step all run under one lock, so a request
joins or leaves between two steps. Its gauges (/metrics) are copied under that lock after
each of them and read from the copy: a long step (a compile) never holds up /metrics. A
step that raises fails the requests in flight (each gets the error) rather than the server,
which goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_jax.inference.engine import Engine, Event, SamplingParams

# Latency histogram buckets, seconds (Prometheus' `le` bounds; +Inf is added).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """A Prometheus histogram: cumulative counts per `le` bound, the sum and the count."""

    def __init__(self, bounds=LATENCY_BUCKETS_S):
        self.bounds, self.counts = bounds, [0] * len(bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum, self.count = self.sum + value, self.count + 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        rows = [
            f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.bounds, self.counts, strict=True)
        ]
        rows.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return rows + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


@dataclass
class Stats:
    """Counters and latency histograms for /metrics."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    errors: int = 0
    rejected: int = 0  # 429s
    ttft: Histogram = field(default_factory=Histogram)  # submission -> first token
    itl: Histogram = field(default_factory=Histogram)  # between a request's tokens


@dataclass
class Timing:
    """One request's, for its log line."""

    submitted: float
    prompt_tokens: int
    first: float | None = None  # when its first token came
    generated: int = 0


def request_line(rid: int, t: Timing, finish_reason: str, now: float) -> str:
    total = now - t.submitted
    first = f"first token {t.first - t.submitted:.2f} s, " if t.first is not None else ""
    return (
        f"request {rid}: {t.prompt_tokens} prompt + {t.generated} generated tokens "
        f"({finish_reason}), {first}{total:.2f} s in all"
    )


def stats_line(prompt_tokens: int, generated: int, seconds: float, gauges: dict) -> str:
    """vLLM's periodic line: the tokens since the last one per second, the slots and the KV."""
    pages, used = gauges["pages"], gauges["pages_in_use"]
    return (
        f"stats: prompt {prompt_tokens / seconds:.1f} tokens/s, generation "
        f"{generated / seconds:.1f} tokens/s; running {gauges['running']}, waiting "
        f"{gauges['queue']}; KV pages {used}/{pages} ({100 * used / max(pages, 1):.1f}%)"
    )


def warm_up(engine: Engine, token: int = 0) -> float:
    """Compile the programs a first request runs, greedy and sampled (a one-row prefill, then
    decode), before the server says it is ready -> the seconds it took. Other batch sizes
    and filters (top-k / top-p) compile when first used."""
    start = time.perf_counter()
    for temperature in (0.0, 1.0):
        engine.generate([[token]], SamplingParams(max_tokens=2, temperature=temperature))
    return time.perf_counter() - start


class Worker:
    def __init__(
        self,
        engine: Engine,
        log: Callable[[str], None] | None = None,
        stats_every_s: float = 0.0,
    ):
        """`log`: where a line per finished request and, every `stats_every_s` seconds that
        saw work (0: never), a stats line go; None: nowhere."""
        self.engine = engine
        self.log, self.stats_every_s = log, stats_every_s
        self._timings: dict[int, Timing] = {}
        self._logged = (time.perf_counter(), 0, 0)  # when, prompt and generated tokens then
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stats = Stats()
        self._listeners: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._last: dict[int, float] = {}  # rid -> when it was submitted or last got a token
        self._started: set[int] = set()  # rids that got their first token
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._gauges = self._read_gauges()  # replaced whole, under the lock: read without it

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join(timeout)

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[int, asyncio.Queue]:
        """Queue a request (EngineError / QueueFull as the engine raises them) -> its id and the
        queue its events arrive on (an Exception instead if the engine failed)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            rid = self.engine.submit(prompt, params)
            self._listeners[rid] = (asyncio.get_running_loop(), queue)
            self._last[rid] = time.perf_counter()
            self._timings[rid] = Timing(self._last[rid], len(prompt))
            self.stats.prompt_tokens += len(prompt)
            self._gauges = self._read_gauges()
        self.wake.set()
        return rid, queue

    def cancel(self, rid: int) -> None:
        """Drop the request (finished or not), freeing its slot and pages."""
        with self.lock:
            self.engine.cancel(rid)
            self._listeners.pop(rid, None)
            self._last.pop(rid, None)
            self._timings.pop(rid, None)
            self._started.discard(rid)
            self._gauges = self._read_gauges()

    def snapshot(self) -> dict:
        """The engine's gauges as of its last step, submit or cancel: taken without the
        lock, which a step holds as long as it runs (and the event loop would wait)."""
        return self._gauges

    def _read_gauges(self) -> dict:
        """The engine's gauges now (the lock held, or the worker not started)."""
        e = self.engine
        spec = e.speculation
        return {
            "queue": len(e.queue),
            "running": e.running(),
            "pages_in_use": e.pool.in_use(),
            "pages": e.pool.n_pages,
            "preempted": e.preempted,
            # speculation's drafts checked and kept per depth (none without it)
            "drafted": [] if spec is None else spec.drafted.tolist(),
            "accepted": [] if spec is None else spec.accepted.tolist(),
        }

    def _run(self) -> None:
        while not self._stop:
            with self.lock:
                busy = self.engine.has_work()
                if busy:
                    events = self._step()
                    self._gauges = self._read_gauges()
            self._log_stats()
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            for event in events:
                self._deliver(event)

    def _log_stats(self) -> None:
        """The stats line, if one is due and there was work since the last."""
        if self.log is None or self.stats_every_s <= 0:
            return
        now = time.perf_counter()
        when, prompt, generated = self._logged
        if now - when < self.stats_every_s:
            return
        new = (self.stats.prompt_tokens - prompt, self.stats.generated_tokens - generated)
        gauges = self._gauges
        if any(new) or gauges["running"] or gauges["queue"]:
            self.log(stats_line(*new, now - when, gauges))
        self._logged = (now, self.stats.prompt_tokens, self.stats.generated_tokens)

    def _step(self) -> list[Event | tuple[int, Exception]]:
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the server outlives a failed step
            self.stats.errors += 1
            failed = [(rid, e) for rid in list(self._listeners)]
            for rid, _ in failed:
                self.engine.cancel(rid)
                self._timings.pop(rid, None)
            return failed
        self.stats.generated_tokens += len(events)
        now = time.perf_counter()
        for e in events:
            if (timing := self._timings.get(e.rid)) is not None:
                timing.first = now if timing.first is None else timing.first
                timing.generated += 1
                if e.finish_reason is not None:
                    del self._timings[e.rid]
                    if self.log is not None:
                        self.log(request_line(e.rid, timing, e.finish_reason, now))
            if e.rid in self._last:
                latency = now - self._last[e.rid]
                first = e.rid not in self._started
                (self.stats.ttft if first else self.stats.itl).observe(latency)
                self._started.add(e.rid)
                self._last[e.rid] = now
            if e.finish_reason is not None:
                self._last.pop(e.rid, None)
                self._started.discard(e.rid)
        return events

    def _deliver(self, event) -> None:
        rid = event[0]
        finished = not isinstance(event, Event) or event.finish_reason is not None
        with self.lock:
            target = self._listeners.pop(rid, None) if finished else self._listeners.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, event)
