"""The generation engine: continuous batching over a paged KV cache (`engine.py`), its page
bookkeeping and prefix cache (`pages.py`), its compiled programs (`programs.py`),
speculative decoding with the model's MTP layers (`speculation.py`, `draft_programs.py`), and
the record of each request's experts and log-probs for routing replay (`recording.py`)."""

from moe_jax.inference.engine.engine import Engine, EngineError, Event, QueueFull, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "QueueFull", "SamplingParams"]
