"""OpenAI's response objects: a completion or chat completion whole, or as server-sent event
chunks, with log-probabilities in each endpoint's own form, and the error shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, NamedTuple

from moe_jax.inference.engine import Event
from moe_jax.serve.requests import Job

if TYPE_CHECKING:  # the serve extra's; imported where used, so the module imports without it
    from fastapi import Request
    from fastapi.responses import JSONResponse

DISCONNECT_POLL_S = 0.25


class Item(NamedTuple):
    """What one choice gained: its text delta, its finish reason (None while running), the
    tokens it has generated so far, the events of the tokens to report log-probabilities of,
    and an error message if the engine failed it."""

    index: int
    delta: str
    reason: str | None
    n_tokens: int
    entries: list[Event]
    error: str | None = None


def error(status: int, message: str, kind: str, param=None, headers=None) -> JSONResponse:
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


class Reply:
    """The OpenAI response objects of one request."""

    def __init__(self, chat: bool, model: str, job: Job, tokenizer):
        self.chat, self.model, self.job, self.tokenizer = chat, model, job, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.offsets = [0] * len(job.params)  # completions' text_offset, per choice

    def _choice(self, i: int, text: str, reason, entries, delta: bool) -> dict:
        lp = self._logprobs(i, entries)
        if not self.chat:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
        key, body = ("delta", {"content": text}) if delta else ("message", None)
        body = body or {"role": "assistant", "content": text}
        return {"index": i, key: body, "logprobs": lp, "finish_reason": reason}

    def _logprobs(self, i: int, entries: list[Event]) -> dict | None:
        """Completions: parallel lists (tokens, token_logprobs, top_logprobs, text_offset);
        chat: {"content": [{token, logprob, bytes, top_logprobs}]}. A token's offset counts
        its piece's length, from the completion's start."""
        if self.job.logprobs is None:
            return None
        k, piece = self.job.logprobs, self._piece
        if self.chat:
            one = lambda t, lp: {"token": piece(t), "logprob": lp,
                                 "bytes": list(piece(t).encode())}  # fmt: skip
            content = [one(e.token, e.logprob) | {"top_logprobs": [one(*a) for a in e.top[:k]]}
                       for e in entries]  # fmt: skip
            return {"content": content, "refusal": None}
        tokens = [piece(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(t): lp for t, lp in e.top[:k]} for e in entries],
            "text_offset": offsets,
        }

    def _piece(self, token: int) -> str:
        """A token's text; a piece of a character (alone it decodes to U+FFFD) as
        "token_id:N", vLLM's form, so distinct tokens keep distinct names."""
        text = self.tokenizer.decode([token])
        return f"token_id:{token}" if "\ufffd" in text else text

    def _object(self, choices: list[dict], chunk: bool, usage=None) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return obj | ({"usage": usage} if usage is not None else {})

    def _usage(self, generated: int) -> dict:
        n = len(self.job.prompt)
        return {"prompt_tokens": n, "completion_tokens": generated, "total_tokens": n + generated}

    async def whole(self, choices, request: Request, worker, rids) -> JSONResponse:
        """Every choice to its end; a client gone meanwhile cancels them."""
        from fastapi.responses import JSONResponse

        n = len(rids)
        texts, reasons, counts, entries = [""] * n, [None] * n, [0] * n, [[] for _ in range(n)]
        pending = asyncio.ensure_future(anext(choices, None))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        return error(499, "client disconnected", "cancelled")
                    continue
                item = pending.result()
                if item is None:
                    break
                if item.error is not None:
                    return error(500, item.error, "server_error")
                i = item.index
                texts[i] += item.delta
                entries[i] += item.entries
                reasons[i], counts[i] = item.reason or reasons[i], item.n_tokens
                pending = asyncio.ensure_future(anext(choices, None))
        finally:
            pending.cancel()
            # A cancelled task ends at its next turn: until then its anext still runs the
            # generator, and aclose() would raise "asynchronous generator is already running".
            await asyncio.wait({pending})
            for rid in rids:
                worker.cancel(rid)
            await choices.aclose()
        out = [self._choice(i, texts[i], reasons[i], entries[i], False) for i in range(n)]
        return JSONResponse(self._object(out, False, self._usage(sum(counts))))

    async def stream(self, choices, worker, rids):
        """Server-sent events: a chat's role first, then each delta, then [DONE]. Starlette
        cancels this generator when the client goes: the finally cancels the requests."""
        sse = lambda obj: f"data: {json.dumps(obj)}\n\n"
        try:
            if self.chat:
                role = {"role": "assistant", "content": ""}
                first = [
                    {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                    for i in range(len(rids))
                ]
                yield sse(self._object(first, True))
            async for item in choices:
                if item.error is not None:
                    yield sse({"error": {"message": item.error, "type": "server_error"}})
                    break
                if item.delta or item.reason or item.entries:
                    choice = self._choice(item.index, item.delta, item.reason, item.entries, True)
                    yield sse(self._object([choice], True))
            yield "data: [DONE]\n\n"
        finally:
            for rid in rids:
                worker.cancel(rid)
            await choices.aclose()
