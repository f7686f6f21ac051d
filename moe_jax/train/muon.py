"""Muon (`train.optimizer=muon`): the momentum of every matmul weight orthogonalised by a
Newton-Schulz iteration, AdamW for everything else, as Moonlight and Kimi K2 train.

    tx = muon(t, schedule, decays)        # make_optimizer's, before clipping is chained on
    dims = muon_dims(path, ndim)          # a leaf's matrix axes, None: AdamW's

Per Muon weight W (Moonlight, "Muon is Scalable for LLM Training", Algorithm 1, with the
Nesterov form its code and Keller Jordan's use):

    M = mu M + G;  N = G + mu M                   (optax.trace(mu, nesterov=True))
    O = NS5(N / |N|_F) * 0.2 sqrt(max(A, B))      (A x B: the matrix's shape)
    W = W - lr (O + weight_decay W)               (optax.add_decayed_weights, scale_by_lr)

NS5: X <- a X + (b A + c A^2) X with A = X X^T, 5 times, (a, b, c) = (3.4445, -4.7750,
2.0315) (Jordan's quintic), on the wide orientation (X^T when A > B). The 0.2 sqrt(max(A, B))
factor gives the update the RMS of AdamW's (~0.2), so AdamW's learning rate and weight
decay carry over (`train.muon_rms`). The other params (the embedding, the head, norm scales,
biases, the router and its biases, Gated DeltaNet's per-head gates and convolution, MoE's
shared-expert gate) keep the AdamW of `make_optimizer`, its decay mask included.

Which 2-D matrix a weight is (`muon_dims`: reduction axes = its input, output axes):
- a scanned layer stack's leading axis (params under `blocks`, [n_blocks, ...]) is a batch
  axis: each layer its own matrix;
- routed experts [E, D, F] / [E, F, D]: E is a batch axis, each expert its own matrix, never
  the E experts as one flattened matrix;
- attention's q/k/v (and the output gate, MLA's wq_b, wk_b, wv_b, Gated DeltaNet's wz)
  [in, heads, head_dim]: one [in, heads * head_dim] matrix, the projection the released
  checkpoints hold as one Linear (q_proj, k_proj, ...), as Moonlight and Kimi K2 orthogonalise
  it; the output projection wo [heads, head_dim, D]: one [heads * head_dim, D] matrix. MLA's
  W_uk and W_uv are orthogonalised apart (our two weights; HF fuses them as kv_b_proj).

Sharding: the iteration is plain jnp on the laid-out weight, so XLA's sharding propagation
places its communication. The batch axes (layers, experts) are vmapped, never merged, so an
expert-sharded stack is orthogonalised where it lies, each device its own experts; the
matrix's own dims split over fsdp / tensor are contracted in X X^T and (b A + c A^2) X, which
XLA turns into partial products and an all-reduce (or a gather) per iteration over those
axes. Merged axes (heads with head_dim) keep a split on the major one, a contiguous block.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic, as Moonlight and Kimi K2 use it
NS_EPS = 1e-7  # Moonlight's: X / (|X|_F + eps), so a zero update stays zero

# The weights Muon trains, by name: (reduction axes, output axes) after any batch axes.
_MATRIX = ((0,), (1,))  # [in, out]
_HEADS_OUT = ((0,), (1, 2))  # [in, heads, head_dim]
_HEADS_IN = ((0, 1), (2,))  # [heads, head_dim, out]
MUON_WEIGHTS = {
    # SwiGLU (dense, shared expert, routed experts with E as a batch axis)
    "w_gate": _MATRIX,
    "w_up": _MATRIX,
    "w_down": _MATRIX,
    # attention (GQA; Qwen3-Next's output gate wg; Gated DeltaNet's wq/wk/wv/wz/wo)
    "wq": _HEADS_OUT,
    "wk": _HEADS_OUT,
    "wv": _HEADS_OUT,
    "wg": _HEADS_OUT,
    "wz": _HEADS_OUT,
    "wo": _HEADS_IN,
    # MLA's low-rank projections
    "wq_a": _MATRIX,
    "wq_b": _HEADS_OUT,
    "wkv_a": _MATRIX,
    "wk_b": _HEADS_OUT,
    "wv_b": _HEADS_OUT,
    # MTP's projection of [h, emb], the image embeddings' projection
    "eh_proj": _MATRIX,
    "vision_proj": _MATRIX,
}
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # [E, ...] under `experts`


def _names(path) -> list[str]:
    """A leaf's path as names (the params State's keys; a Variable's own entry dropped)."""
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def muon_dims(path, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(reduction axes, output axes) of the leaf at `path` (a params-tree path) with `ndim`
    dims, the axes before them batch axes; None for a leaf AdamW trains (module doc)."""
    names = _names(path)
    axes = MUON_WEIGHTS.get(names[-1]) if names else None
    if axes is None:
        return None
    lead = int(names[0] == "blocks") + int(len(names) > 1 and names[-2] == "experts")
    reduction, output = (tuple(lead + a for a in group) for group in axes)
    if lead + len(reduction) + len(output) != ndim:  # not the layout the table describes
        raise ValueError(f"Muon: {'.'.join(names)} has {ndim} dims; its entry expects {axes}")
    return reduction, output


def newton_schulz(x_AB: jax.Array, steps: int) -> jax.Array:
    """The quintic Newton-Schulz iteration on one matrix (float32): ~U V^T of x = U S V^T,
    its singular values pushed into about [0.7, 1.2] (Jordan's coefficients trade exactness
    for speed)."""
    a, b, c = NS_COEFFS
    wide = x_AB.shape[0] <= x_AB.shape[1]
    x = (x_AB if wide else x_AB.T).astype(jnp.float32)
    x = x / (jnp.linalg.norm(x) + NS_EPS)
    for _ in range(steps):  # unrolled: 5 small matmul chains
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def orthogonalize(u: jax.Array, dims, steps: int, rms: float) -> jax.Array:
    """`u` with each of its matrices (`dims`: reduction, output axes; the rest batch axes)
    replaced by NS5(matrix) * rms * sqrt(max(A, B)). Batch axes are vmapped one by one, not
    merged, so a batch axis split over a mesh axis stays where it is."""
    reduction, output = dims
    batch = tuple(i for i in range(u.ndim) if i not in reduction + output)
    order = batch + reduction + output
    moved = u.transpose(order)
    lead_shape = moved.shape[: len(batch)]
    A = math.prod(u.shape[i] for i in reduction)
    B = math.prod(u.shape[i] for i in output)
    f = lambda m: newton_schulz(m, steps)
    for _ in batch:
        f = jax.vmap(f)
    o = f(moved.reshape(*lead_shape, A, B)) * (rms * math.sqrt(max(A, B)))
    o = o.reshape(moved.shape).transpose([order.index(i) for i in range(u.ndim)])
    return o.astype(u.dtype)


def orthogonalize_updates(steps: int, rms: float) -> optax.GradientTransformation:
    """Stateless: every leaf of the updates (the Muon weights' momenta) orthogonalised by
    `orthogonalize` with its `muon_dims`."""

    def update(updates, state, params=None):
        del params
        one = lambda path, u: orthogonalize(u, muon_dims(path, u.ndim), steps, rms)
        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def labels(params):
    """ "muon" or "adamw" for each leaf of `params`, by `muon_dims`."""
    pick = lambda path, x: "adamw" if muon_dims(path, x.ndim) is None else "muon"
    return jax.tree_util.tree_map_with_path(pick, params)


def muon(t, schedule: optax.Schedule, adamw: optax.GradientTransformation, decays=None):
    """Muon on the matmul weights (module doc) with train.muon_momentum, muon_ns_steps,
    muon_rms, weight_decay (where `decays`, make_optimizer's decay mask, says: GRPO's leaves
    the MTP layers out) and the LR `schedule`; `adamw` (make_optimizer's) on the rest. The
    state: optax.partition's, {"adamw": AdamW's moments of its leaves, "muon": the momentum
    of the Muon weights}, each leaf laid out like its param."""
    muon_tx = optax.chain(
        optax.trace(t.muon_momentum, nesterov=True),
        orthogonalize_updates(t.muon_ns_steps, t.muon_rms),
        optax.add_decayed_weights(t.weight_decay, decays),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.partition({"adamw": adamw, "muon": muon_tx}, labels)
