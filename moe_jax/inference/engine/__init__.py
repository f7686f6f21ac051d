"""The generation engine: continuous batching over a paged KV cache (`engine.py`), its
requests (`requests.py`), its page bookkeeping and prefix cache (`pages.py`), a hybrid's
state snapshots for that cache (`snapshots.py`), its compiled programs (`programs.py`),
speculative decoding with the model's MTP layers (`speculation.py`, `draft_programs.py`), and
the record of each request's experts and log-probs for routing replay (`recording.py`)."""

from moe_jax.inference.engine.engine import Engine
from moe_jax.inference.engine.requests import EngineError, Event, QueueFull, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "QueueFull", "SamplingParams"]
