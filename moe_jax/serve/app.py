"""The HTTP side: an OpenAI-compatible FastAPI app over one engine.

    app = create_app(engine, tokenizer, "tiny")      # then uvicorn.run(app, ...)

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template; both
stream server-sent events with "stream": true, ending in `data: [DONE]`), GET /v1/models,
GET /health, GET /metrics (Prometheus text: queue, running slots, pages in use, token and
request counters, time-to-first-token and inter-token latency histograms; with speculation,
the drafts checked and kept, all and per depth). A body the server
cannot run answers 400 and a full engine queue 429 (with Retry-After), both in OpenAI's
error shape; a failed engine step answers 500 for the requests it held, and the server goes
on. A client that disconnects cancels its request: its slot and pages are freed at the next
step.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' `Request`
# annotation as the class itself, and fastapi is imported in `create_app` only, so that the
# package imports without the serve extra.
import asyncio
import contextlib

from moe_jax.inference.engine import Engine, EngineError, Event, QueueFull
from moe_jax.serve.reply import Item, Reply, error
from moe_jax.serve.requests import BadRequest, Job, parse
from moe_jax.serve.text import TextStream
from moe_jax.serve.worker import Worker

RETRY_AFTER_S = 1


def create_app(engine: Engine, tokenizer, model_name: str, log=None, stats_every_s: float = 0.0):
    """The FastAPI app serving `engine` (its worker thread runs while the app does); `log`
    takes a line per finished request and a stats line every `stats_every_s` (Worker)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, StreamingResponse

    worker = Worker(engine, log, stats_every_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="moe_jax", lifespan=lifespan)
    app.state.worker = worker

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "moe_jax"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(worker))

    async def complete(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not valid JSON", "invalid_request_error")
        try:
            job = parse(body, tokenizer, model_name, chat, engine.max_len)
            rids, queues = submit_all(worker, job)
        except BadRequest as e:
            return error(400, str(e), "invalid_request_error", e.param)
        except QueueFull as e:
            worker.stats.rejected += 1
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return error(429, str(e), "rate_limit_exceeded", headers=headers)
        except EngineError as e:
            return error(400, str(e), "invalid_request_error")
        worker.stats.requests += 1
        reply = Reply(chat, model_name, job, tokenizer)
        choices = merged(worker, rids, queues, job, tokenizer)
        if job.stream:
            return StreamingResponse(
                reply.stream(choices, worker, rids), media_type="text/event-stream"
            )
        return await reply.whole(choices, request, worker, rids)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


def submit_all(worker: Worker, job: Job):
    """One engine request per choice; none left queued if one is refused."""
    rids, queues = [], []
    try:
        for params in job.params:
            rid, queue = worker.submit(job.prompt, params)
            rids.append(rid)
            queues.append(queue)
    except EngineError:
        for rid in rids:
            worker.cancel(rid)
        raise
    return rids, queues


async def merged(worker: Worker, rids, queues, job: Job, tokenizer):
    """`Item`s as tokens arrive, the choices interleaved; stop strings end a choice (and
    cancel its request)."""
    out: asyncio.Queue = asyncio.Queue()

    async def one(i: int, queue: asyncio.Queue):
        text = TextStream(tokenizer, job.stop)
        n = 0
        while True:
            event = await queue.get()
            if not isinstance(event, Event):  # (rid, the failed step's exception)
                await out.put(Item(i, "", None, n, [], f"generation failed: {event[1]}"))
                return
            n += 1
            reason = event.finish_reason
            ended_by_id = reason == "stop" and event.token in job.params[i].stop_ids
            delta = "" if ended_by_id else text.push(event.token)
            # The EOS that ended it is in neither the text nor the log-probabilities.
            entries = [] if ended_by_id or job.logprobs is None else [event]
            if text.stopped and reason is None:
                worker.cancel(rids[i])
                reason = "stop"
            if reason is not None:
                await out.put(Item(i, delta + text.finish(), reason, n, entries))
                return
            await out.put(Item(i, delta, None, n, entries))

    tasks = [asyncio.create_task(one(i, q)) for i, q in enumerate(queues)]
    try:
        ended = 0
        while ended < len(tasks):
            item = await out.get()
            ended += item.reason is not None or item.error is not None
            yield item
    finally:
        for t in tasks:
            t.cancel()


def prometheus_text(worker: Worker) -> str:
    """The engine's gauges and the server's counters in Prometheus' text format."""
    s, st = worker.snapshot(), worker.stats
    rows = [
        ("moe_jax_queue_length", "gauge", "requests waiting for a slot", s["queue"]),
        ("moe_jax_running_slots", "gauge", "slots holding a request", s["running"]),
        ("moe_jax_pages_in_use", "gauge", "KV pages held by requests", s["pages_in_use"]),
        ("moe_jax_pages_total", "gauge", "KV pages in the pool", s["pages"]),
        ("moe_jax_preempted_total", "counter", "requests preempted for pages", s["preempted"]),
        ("moe_jax_prompt_tokens_total", "counter", "prompt tokens submitted", st.prompt_tokens),
        ("moe_jax_generation_tokens_total", "counter", "tokens generated", st.generated_tokens),
        ("moe_jax_requests_total", "counter", "requests accepted", st.requests),
        ("moe_jax_rejected_total", "counter", "requests refused with 429", st.rejected),
        ("moe_jax_engine_errors_total", "counter", "engine steps that failed", st.errors),
    ]
    drafted, accepted = s["drafted"], s["accepted"]
    rows += [
        ("moe_jax_spec_decode_draft_tokens_total", "counter", "drafts checked", sum(drafted)),
        ("moe_jax_spec_decode_accepted_tokens_total", "counter", "drafts kept", sum(accepted)),
    ]
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    for name, help_, counts in (
        ("moe_jax_spec_decode_draft_tokens_by_depth_total", "drafts checked", drafted),
        ("moe_jax_spec_decode_accepted_tokens_by_depth_total", "drafts kept", accepted),
    ):
        if counts:  # speculation on: one series per drafting depth
            lines += [f"# HELP {name} {help_} per MTP depth", f"# TYPE {name} counter"]
            lines += [f'{name}{{depth="{k}"}} {n}' for k, n in enumerate(counts, 1)]
    for name, help_, hist in (
        ("moe_jax_time_to_first_token_seconds", "submission to first token", st.ttft),
        ("moe_jax_inter_token_latency_seconds", "between a request's tokens", st.itl),
    ):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
    return "\n".join(lines) + "\n"
