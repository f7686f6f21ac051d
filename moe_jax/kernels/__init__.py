"""Fused kernels that stand alone (they import nothing of the project), so that the kernel
choice (`moe_jax.backends`) can ask whether one takes its operands without importing the
model it chooses for.

    mosaic_gmm.py       the MoE's grouped matmuls on Mosaic GPU (Hopper)
    picked_matmul.py    decoding's picked experts read in place (Pallas Triton)
    cudnn_attention.py  cuDNN's fused attention through JAX
"""
