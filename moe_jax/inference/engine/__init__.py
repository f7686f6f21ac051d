"""The generation engine: continuous batching over a paged KV cache (`engine.py`), its page
bookkeeping and prefix cache (`pages.py`) and its compiled programs (`programs.py`)."""

from moe_jax.inference.engine.engine import Engine, EngineError, Event, QueueFull, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "QueueFull", "SamplingParams"]
