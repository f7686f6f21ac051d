"""The kernel choices of a training run, checked before anything is written.

The model picks its kernels while the train step is traced (`backends.choose` in
attention.py, mla.py and moe.py), which is after the trainer has made the run directory: a
kernel this backend cannot run (attention.impl=cudnn on a CPU, cuDNN with attention sinks,
moe.impl=megablox under the training mesh) left config.yaml, metrics.jsonl, tb/ and
checkpoints/ behind. `check_kernels` asks `backends` the same questions with what the config
says of the operands (the compute dtype, train.seq_len, the mesh's tensor and expert sizes),
so the command refuses in the same line before it writes. Nothing is traced or allocated.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_jax import backends
from moe_jax.config import Config

SIXTEEN_BITS = (jnp.bfloat16, jnp.float16)


def check_kernels(cfg: Config, mesh_shape: dict[str, int] | None = None) -> None:
    """KernelError for a kernel `cfg` names that the target backend cannot run on the train
    step's operands. `mesh_shape`: the training mesh's axis sizes (default: the config's,
    -1 counted as 1, which no kernel rule below depends on)."""
    axes = mesh_shape or {ax: max(getattr(cfg.mesh, ax), 1) for ax in ("tensor", "expert")}
    dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
    _check_attention(cfg, dtype)
    if cfg.moe.n_experts > 0:
        _check_moe(cfg, dtype, axes.get("tensor", 1), axes.get("expert", 1))


def _check_attention(cfg: Config, dtype) -> None:
    a, length = cfg.attention, cfg.train.seq_len
    sinks = a.kind == "gqa" and a.sinks  # mla has none
    impl = backends.choose("attention", a.impl, dtype=dtype, length=length, sinks=sinks)
    if impl == "cudnn" and dtype not in SIXTEEN_BITS:  # attention_kernels.cudnn's own rule
        raise backends.KernelError(
            f"attention.impl=cudnn computes in bfloat16/float16, not {dtype}; "
            "set model.dtype=bfloat16 or attention.impl=blocked"
        )
    if impl == "splash":  # attention_kernels._splash_kernel's tile
        from moe_jax.model.attention_kernels import SPLASH_BLOCKS

        if length >= min(SPLASH_BLOCKS) and not any(length % b == 0 for b in SPLASH_BLOCKS):
            raise backends.KernelError(
                f"splash attention tiles the sequence by {SPLASH_BLOCKS[-1]}, which does not "
                f"divide {length}; make the sequence length a multiple or set "
                "attention.impl=blocked"
            )


def _check_moe(cfg: Config, dtype, tp: int, ep: int) -> None:
    m = cfg.moe
    impl = backends.choose(
        "moe",
        m.impl,
        dtype=dtype,
        dropless=m.capacity_factor <= 0,
        shape={"dims": (cfg.model.d_model, m.expert_hidden // tp), "ep": ep},
    )
    if impl == "megablox":  # training always runs under its mesh (moe.MoE._impl's rule)
        raise backends.KernelError(
            "moe.impl=megablox runs without a mesh only (jax's megablox pallas_call "
            "declares no varying mesh axes for shard_map); use moe.impl=ragged or auto"
        )
    backends.exchange(impl, m.exchange)
