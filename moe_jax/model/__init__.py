"""The MoE decoder in Flax NNX (see transformer.py for the call contract)."""

from moe_jax.model.transformer import Transformer

__all__ = ["Transformer"]
