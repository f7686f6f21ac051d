"""moe_jax: a JAX/Flax NNX framework for decoder-only Mixture-of-Experts language models."""

__version__ = "0.1.0"
