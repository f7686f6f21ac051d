"""DataError, the error of unusable input data: a module of its own, so that the chat
templates (chat.py) and the built-in tokenizers that render with them (simple.py) both import
it without importing each other."""

from moe_jax.errors import MoeJaxError


class DataError(MoeJaxError, ValueError):
    """Unusable input data; the message names the problem and the fix."""
