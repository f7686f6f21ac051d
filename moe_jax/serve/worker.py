"""The engine's thread: it steps the engine while there is work and hands each request's
tokens to the asyncio side (the HTTP handlers) through a queue per request.

The engine is not thread-safe: submit, cancel and step all run under one lock, so a request
joins or leaves between two steps. A step that raises fails the requests in flight (each gets
the error) rather than the server, which goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from moe_jax.engine import Engine, Event, SamplingParams


@dataclass
class Stats:
    """Counters for /metrics."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    errors: int = 0
    rejected: int = 0  # 429s


class Worker:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stats = Stats()
        self._listeners: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

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
            self.stats.prompt_tokens += len(prompt)
        self.wake.set()
        return rid, queue

    def cancel(self, rid: int) -> None:
        """Drop the request (finished or not), freeing its slot and pages."""
        with self.lock:
            self.engine.cancel(rid)
            self._listeners.pop(rid, None)

    def snapshot(self) -> dict:
        with self.lock:
            e = self.engine
            return {
                "queue": len(e.queue),
                "running": e.running(),
                "pages_in_use": e.pool.in_use(),
                "pages": e.pool.n_pages,
                "preempted": e.preempted,
            }

    def _run(self) -> None:
        while not self._stop:
            with self.lock:
                busy = self.engine.has_work()
                if busy:
                    events = self._step()
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            for event in events:
                self._deliver(event)

    def _step(self) -> list[Event | tuple[int, Exception]]:
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the server outlives a failed step
            self.stats.errors += 1
            failed = [(rid, e) for rid in list(self._listeners)]
            for rid, _ in failed:
                self.engine.cancel(rid)
            return failed
        self.stats.generated_tokens += len(events)
        return events

    def _deliver(self, event) -> None:
        rid = event[0]
        finished = not isinstance(event, Event) or event.finish_reason is not None
        with self.lock:
            target = self._listeners.pop(rid, None) if finished else self._listeners.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, event)
