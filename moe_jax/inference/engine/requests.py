"""The engine's requests: their sampling parameters (`SamplingParams`), the tokens they emit
(`Event`), each one's state in the engine (`Seq`: its tokens, pages, slot, progress), and the
errors that refuse one."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from moe_jax.errors import MoeJaxError


class EngineError(MoeJaxError, ValueError):
    """A request the engine cannot take; the message names the problem and the fix."""


class QueueFull(EngineError):
    """The queue holds `max_queue` requests already."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    row: int = 0  # the key is fold_in(seed, row), as row `row` of a Sampler batch


class Event(NamedTuple):
    rid: int
    token: int
    finish_reason: str | None  # "stop" (a stop id), "length" (max_tokens), else None
    logprob: float = 0.0  # the token's log-probability under the model
    top: tuple[tuple[int, float], ...] = ()  # the TOP_LOGPROBS likeliest (id, logprob)
    draft: int = -1  # speculation: the draft the token was checked against (-1: none)


@dataclasses.dataclass
class Seq:
    rid: int
    prompt: list[int]
    params: SamplingParams
    key_data: np.ndarray  # uint32 [2]
    out: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    window_pages: list[int] = dataclasses.field(default_factory=list)  # -1: released
    slot: int = -1
    done: int = 0  # positions already in the cache
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculation's (speculation.py)
    it: int = 0  # speculation: the step its next verify call draws at
    record: object = None  # recording: its `recording.Record`
    restore: int = -1  # hybrids: the state snapshot its first prefill call starts from

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefilling(self) -> bool:
        """Until the prompt (and, after a preemption, the tokens so far) is in the cache."""
        return self.done < len(self.tokens) - (1 if self.out else 0)
