"""The generation engine: continuous batching over a paged KV cache (`engine.py`), its page
bookkeeping and prefix cache (`pages.py`), its compiled programs (`programs.py`), and
speculative decoding with the model's MTP layers (`speculation.py`, `draft_programs.py`)."""

from moe_jax.inference.engine.engine import Engine, EngineError, Event, QueueFull, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "QueueFull", "SamplingParams"]
