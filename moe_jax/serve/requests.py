"""OpenAI request bodies -> what the engine runs: the prompt's token ids and one
`SamplingParams` per choice. A body the engine cannot run raises `BadRequest`, which the
server answers with 400 in OpenAI's error shape.

Accepted (as OpenAI documents them; others are ignored, as OpenAI's own server ignores unknown
ones): model, prompt (a string, a list of token ids, or a list of one of either) or messages,
max_tokens (max_completion_tokens), temperature, top_p, n, seed, stop (a string or up to 4),
stream, logprobs (completions: how many alternatives, 0-5; chat: true, with top_logprobs
0-5); and vLLM's top_k and ignore_eos. Log-probabilities are the model's (before temperature
and filters). Without a seed each request draws a fresh one.
Choice i of n draws with the key fold_in(seed, i), as row i of `Sampler.generate([p] * n)`.
"""

from __future__ import annotations

import dataclasses
import secrets

from moe_jax.errors import MoeJaxError
from moe_jax.inference.engine import SamplingParams
from moe_jax.inference.engine.programs import TOP_LOGPROBS
from moe_jax.tokenizer import DataError

MAX_N = 16
MAX_STOPS = 4
DEFAULT_MAX_TOKENS = 16


class BadRequest(MoeJaxError, ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class Job:
    prompt: list[int]
    params: list[SamplingParams]  # one per choice
    stop: list[str]
    stream: bool
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        value = default
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" in [{low}, {high}]" if high is not None else f" >= {low}" if low else ""
        raise BadRequest(f"'{name}' must be a number{bounds}, got {value!r:.40}", name)
    return kind(value)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' takes at most {MAX_STOPS} strings", "stop")
    return stops


def _prompt_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True).tolist()
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest(
            "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
        )
    if not ids:
        raise BadRequest("'prompt' is empty: give at least one token", "prompt")
    return ids


def _chat_ids(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a 'role'", "messages")
        if not isinstance(m.get("content"), str | None):
            raise BadRequest("a message's 'content' must be a string here", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except DataError as e:
        raise BadRequest(str(e), "messages") from None
    return tokenizer.encode(text, add_special_tokens=False).tolist()


def parse(body, tokenizer, model_name: str, chat: bool, max_len: int) -> Job:
    """The engine's job for a /v1/completions (`chat` False) or /v1/chat/completions body.
    Without max_tokens a completion takes 16 tokens (OpenAI's default), a chat the rest of
    the context (`max_len`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise BadRequest(
            f"model '{body.get('model')}' is not served here; this server serves '{model_name}'",
            "model",
        )
    if body.get("echo") or body.get("suffix"):
        raise BadRequest("echo and suffix are not supported by this server")
    ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    default = max(1, max_len - len(ids)) if chat else DEFAULT_MAX_TOKENS
    max_tokens = _number({"max_tokens": limit}, "max_tokens", default, int, 1)
    n = _number(body, "n", 1, int, 1, MAX_N)
    seed = body.get("seed")
    seed = secrets.randbelow(2**31) if seed is None else _number(body, "seed", 0, int, 0, 2**31 - 1)
    eos = getattr(tokenizer, "eos_id", None)
    stop_ids = () if body.get("ignore_eos") or eos is None else (eos,)
    base = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, float, 0, 2),
        top_p=_number(body, "top_p", 1.0, float, 0, 1),
        top_k=_number(body, "top_k", 0, int, 0) if body.get("top_k", 0) != -1 else 0,
        seed=seed,
        stop_ids=stop_ids,
    )
    if base.top_p == 0:
        raise BadRequest("'top_p' must be > 0", "top_p")
    params = [dataclasses.replace(base, row=i) for i in range(n)]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    return Job(ids, params, _stops(body), stream, _logprobs(body, chat))


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token asked for (None: no log-probabilities)."""
    if chat:
        if body.get("logprobs") not in (None, False, True):
            raise BadRequest("'logprobs' must be true or false", "logprobs")
        top = _number(body, "top_logprobs", 0, int, 0, TOP_LOGPROBS)
        return top if body.get("logprobs") else None
    if body.get("logprobs") is None:
        return None
    return _number(body, "logprobs", 0, int, 0, TOP_LOGPROBS)
