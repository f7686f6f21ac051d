"""cuDNN's flash attention as the train step needs it: no gradient for the mask's bias, and the
residuals its backward reads named for the remat policies.

`jax.nn.dot_product_attention(implementation="cudnn")` differs from that in two ways:
- a mask reaches cuDNN as an additive [B, 1, T, S] bias, and jax always asks cuDNN for that
  bias's gradient (`should_export_dbias` is `True` whatever the shapes): a second quadratic
  array written by every backward, for a bias that is a constant of the token ids. Here the
  call asks for none (`has_dbias=False`). jax exposes the switch only in its private
  `_dot_product_attention`, whose signature gained two arguments in jax 0.12 (`score_mod`,
  `score_mod_args`): `_private_call` is the one place that knows.
- the custom call's outputs carry no `checkpoint_name`, so `model.remat=dots` (which keeps
  named kernel outputs, not custom calls) ran cuDNN's forward again in the backward. Here the
  output and the softmax statistics the backward reads are named (`named_residuals`), as the
  blocked path's and splash's are.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def named_residuals(fn, name: str, keep):
    """`fn(*args)` whose residuals for the backward pass, those `keep(leaf, out)` accepts,
    carry `checkpoint_name(., name)`, so that a remat policy saving `name` keeps them rather
    than running `fn` again. The gradient is `fn`'s own (through `jax.vjp`)."""

    @jax.custom_vjp
    def call(*args):
        return fn(*args)

    def fwd(*args):
        out, vjp = jax.vjp(fn, *args)
        inputs = {id(a) for a in args}
        vjp = jax.tree.map(
            lambda r: checkpoint_name(r, name) if id(r) not in inputs and keep(r, out) else r,
            vjp,
        )
        return out, vjp

    def bwd(vjp, dout):
        return vjp(dout)

    call.defvjp(fwd, bwd)
    return call


@functools.cache
def _private():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    params = inspect.signature(fa._dot_product_attention).parameters
    return fa, "score_mod" in params


def _private_call(q, k, v, bias, *, scale: float, causal: bool, window: int | None):
    """cuDNN attention, layout BTNH, causal and/or windowed by cuDNN's own masks, plus
    `bias` (None or [B, 1, T, S]) whose gradient is not computed."""
    fa, has_score_mod = _private()
    none = jnp.zeros(0, q.dtype)
    mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    kwargs = dict(
        query=q,
        key=k,
        value=v,
        bias=none if bias is None else bias,
        q_seqlen=none,
        kv_seqlen=none,
        q_offsets=none,
        kv_offsets=none,
        page_table_k=none,
        page_table_v=none,
        scale=scale,
        seed=42,
        dropout_rate=0.0,
        variadic_args=(bias is not None, False),  # (has_bias, has_dbias)
        mask_type=mask_type,
        layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=window,
        cudnn_version=fa.check_cudnn_version(),
        return_residual=False,
    )
    if has_score_mod:  # jax >= 0.12
        kwargs.update(score_mod_args=(), score_mod=None)
    return fa._dot_product_attention(**kwargs)


def attention(q_BTHD, k_BTKD, v_BTKD, ids_BT, *, scale: float, window: int, name: str):
    """Causal attention, key s seen by query t iff s <= t, within the window (window > 0) and
    ids[t] == ids[s] (ids given); the output and statistics named `name` for remat."""
    bias = None
    if ids_BT is not None:
        allowed = ids_BT[:, None, :, None] == ids_BT[:, None, None, :]
        bias = jnp.where(allowed, 0, fa_large_negative(q_BTHD.dtype)).astype(q_BTHD.dtype)
    # The statistics are [B, H, T] (float32); the output is q's shape.
    B, T, H, _ = q_BTHD.shape
    keep = lambda r, out: r.shape == out.shape or r.size == B * H * T

    def call(q, k, v):
        return _private_call(
            q, k, v, bias, scale=scale, causal=True, window=window if window > 0 else None
        )

    return named_residuals(call, name, keep)(q_BTHD, k_BTKD, v_BTKD)


def fa_large_negative(dtype):
    """The masked logit jax's cuDNN path uses (a finite one: cuDNN mishandles -inf - -inf)."""
    fa, _ = _private()
    return fa.get_large_negative_number(jnp.dtype(dtype))
