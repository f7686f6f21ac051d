"""Mixture-of-Experts feed-forward: top-k routing with a capacity factor, sort-based dispatch.

Semantics (DESIGN.md):
- Router logits `x @ W_r (+ b)` in float32. `softmax`: probabilities over all experts, top-k,
  optionally renormalised over the k (which is exactly "top-k, then softmax over the k").
  `sigmoid` (Llama 4): top-k on the raw logits, weight = sigmoid(logit), optionally renormalised.
- `route_scale="output"` weights each expert's output (Mixtral/Qwen); `"input"` scales the
  expert's *input* by the weight and sums the outputs unweighted (Llama 4).
- Tokens are routed in groups (one group per expert-parallel shard; the batch is split into
  `n_groups` equal groups of whole sequences). Capacity per expert and group:
  `C = ceil(capacity_factor * tokens_per_group * top_k / n_experts)` (min 1); `capacity_factor
  <= 0` means C = tokens_per_group, which can never drop (an expert appears once in a top-k).
- Drop priority inside a group: every token's 1st choice before any 2nd choice, then position in
  the sequence, then row in the batch. So with top-1 a token's fate never depends on later
  tokens (causal-safe). A dropped assignment contributes 0; the residual carries the token.
- Dispatch: one sort of the assignments by (expert, priority) gives each assignment its slot
  in fixed `[E, C, D]` buffers; tokens are gathered into the buffers and results gathered back.
- Aux losses over all tokens of the call: Switch load balance `E * sum_e f_e * P_e` with f_e the
  fraction of top-k assignments to e and P_e the mean router probability (softmax; for sigmoid
  the per-token normalised sigmoid), and router z-loss `mean(logsumexp(logits)^2)`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import Config, MoEConfig
from moe_jax.sharding import param


def capacity(tokens_per_group: int, cfg: MoEConfig) -> int:
    if cfg.capacity_factor <= 0:
        return tokens_per_group
    return max(1, math.ceil(cfg.capacity_factor * tokens_per_group * cfg.top_k / cfg.n_experts))


def route(logits_TE: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (weights_TK, experts_TK, router probabilities_TE used by the load-balance loss)."""
    top_logits_TK, experts_TK = jax.lax.top_k(logits_TE, cfg.top_k)
    if cfg.score == "softmax":
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=-1)
    else:
        weights_TK = jax.nn.sigmoid(top_logits_TK)
        sig_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = sig_TE / jnp.sum(sig_TE, axis=-1, keepdims=True)
    if cfg.renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, experts_TK, probs_TE


def assign_slots(experts_BTK: jax.Array, n_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """Slot of every assignment in a flat [E * C] buffer for one routing group.

    experts_BTK: expert ids of the group's B rows x T positions x K choices.
    Returns slot_BTK (E * C where dropped, i.e. out of range) and keep_BTK.
    """
    B, T, K = experts_BTK.shape
    n = B * T * K
    # Priority of each assignment: choice rank first, then position, then row.
    k_idx = jnp.arange(K)[None, None, :]
    t_idx = jnp.arange(T)[None, :, None]
    b_idx = jnp.arange(B)[:, None, None]
    priority_BTK = (k_idx * T + t_idx) * B + b_idx
    key = (experts_BTK * n + priority_BTK).reshape(-1)  # unique keys: sort by expert, priority
    order = jnp.argsort(key)
    sorted_experts = experts_BTK.reshape(-1)[order]
    counts_E = jnp.bincount(sorted_experts, length=n_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted = jnp.arange(n) - starts_E[sorted_experts]  # position within its expert's queue
    rank = jnp.zeros(n, rank_sorted.dtype).at[order].set(rank_sorted).reshape(B, T, K)
    keep_BTK = rank < cap
    slot_BTK = jnp.where(keep_BTK, experts_BTK * cap + rank, n_experts * cap)
    return slot_BTK, keep_BTK


def dispatch(x_BTD: jax.Array, slot_BTK: jax.Array, n_slots: int) -> jax.Array:
    """Gather tokens into the flat [E * C, D] expert buffer (empty slots are zero)."""
    B, T, K = slot_BTK.shape
    token_BTK = jnp.broadcast_to(jnp.arange(B * T).reshape(B, T, 1), (B, T, K))
    # Slot -> token index; empty slots point at an appended zero row.
    token_of_slot = (
        jnp.full((n_slots,), B * T).at[slot_BTK.reshape(-1)].set(token_BTK.reshape(-1), mode="drop")
    )
    x_pad = jnp.concatenate([x_BTD.reshape(B * T, -1), jnp.zeros_like(x_BTD[0, :1])], axis=0)
    return x_pad[token_of_slot]


def combine(y_SD: jax.Array, slot_BTK: jax.Array) -> jax.Array:
    """Each assignment's expert output [B, T, K, D]; dropped assignments read zeros."""
    return y_SD.at[slot_BTK].get(mode="fill", fill_value=0)


class SwiGLU(nnx.Module):
    """Dense SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, d_model: int, hidden: int, cfg: Config, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.w_gate = param(rngs, init, (d_model, hidden), ("embed", "mlp"))
        self.w_up = param(rngs, init, (d_model, hidden), ("embed", "mlp"))
        self.w_down = param(rngs, init, (hidden, d_model), ("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        w = lambda p: p[...].astype(self.dtype)
        h = jax.nn.silu(x_BTD @ w(self.w_gate)) * (x_BTD @ w(self.w_up))
        return h @ w(self.w_down)


class Experts(nnx.Module):
    """n_experts SwiGLU MLPs applied to their [E, C, D] buffers with batched einsums."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        E, D, F = cfg.moe.n_experts, cfg.model.d_model, cfg.moe.expert_hidden
        init = nnx.initializers.normal(cfg.model.init_std)
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.w_gate = param(rngs, init, (E, D, F), ("expert", "embed", "expert_mlp"))
        self.w_up = param(rngs, init, (E, D, F), ("expert", "embed", "expert_mlp"))
        self.w_down = param(rngs, init, (E, F, D), ("expert", "expert_mlp", "embed"))
        if cfg.moe.expert_bias:
            zeros = nnx.initializers.zeros
            self.gate_bias = param(rngs, zeros, (E, F), ("expert", "expert_mlp"))
            self.up_bias = param(rngs, zeros, (E, F), ("expert", "expert_mlp"))
            self.down_bias = param(rngs, zeros, (E, D), ("expert", "embed"))

    def _bias(self, name: str) -> jax.Array | float:
        return getattr(self, name)[...].astype(self.dtype)[:, None, :] if hasattr(self, name) else 0

    def __call__(self, x_ECD: jax.Array) -> jax.Array:
        w = lambda p: p[...].astype(self.dtype)
        gate = jnp.einsum("ecd,edf->ecf", x_ECD, w(self.w_gate)) + self._bias("gate_bias")
        up = jnp.einsum("ecd,edf->ecf", x_ECD, w(self.w_up)) + self._bias("up_bias")
        h_ECF = jax.nn.silu(gate) * up
        return jnp.einsum("ecf,efd->ecd", h_ECF, w(self.w_down)) + self._bias("down_bias")


class MoE(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        m = cfg.moe
        D, E = cfg.model.d_model, m.n_experts
        self.cfg = m
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.router = param(
            rngs, nnx.initializers.normal(cfg.model.init_std), (D, E), ("embed", None)
        )
        if m.router_bias:
            self.router_bias = param(rngs, nnx.initializers.zeros, (E,), (None,))
        self.experts = Experts(cfg, rngs=rngs)
        if m.shared_expert_hidden > 0:
            self.shared = SwiGLU(D, m.shared_expert_hidden, cfg, rngs=rngs)

    def router_logits(self, x_BTD: jax.Array) -> jax.Array:
        logits = x_BTD.astype(jnp.float32) @ self.router[...]
        if hasattr(self, "router_bias"):
            logits = logits + self.router_bias[...]
        return logits

    def __call__(self, x_BTD: jax.Array, n_groups: int = 1) -> tuple[jax.Array, dict]:
        m = self.cfg
        B, T, D = x_BTD.shape
        E, K, G = m.n_experts, m.top_k, n_groups
        assert B % G == 0, f"batch {B} does not split into {G} routing groups"
        cap = capacity(B // G * T, m)

        logits_BTE = self.router_logits(x_BTD)
        weights_BTK, experts_BTK, probs_BTE = route(logits_BTE, m)
        w_BTK = weights_BTK.astype(self.dtype)

        split = lambda a: a.reshape(G, B // G, *a.shape[1:])
        slot_GbTK, keep_GbTK = jax.vmap(assign_slots, in_axes=(0, None, None))(
            split(experts_BTK), E, cap
        )
        if B * T * K < E:
            # Few tokens in flight (decoding): read only the picked experts' weights instead
            # of running all E experts on mostly empty buffers. Same drops as the buffers.
            keep_BTK = keep_GbTK.reshape(B, T, K)
            y_BTD = self._gathered(x_BTD, experts_BTK, w_BTK, keep_BTK)
        else:
            y_GbTD = jax.vmap(self._buffered, in_axes=(0, 0, 0, None))(
                split(x_BTD), slot_GbTK, split(w_BTK), cap
            )
            y_BTD = y_GbTD.reshape(B, T, D)
        if hasattr(self, "shared"):
            y_BTD = y_BTD + self.shared(x_BTD)

        # Aux losses and metrics over every token of the call (all groups).
        load_E = jnp.mean(jax.nn.one_hot(experts_BTK, E, dtype=jnp.float32), axis=(0, 1, 2))
        mean_prob_E = jnp.mean(probs_BTE, axis=(0, 1))
        stats = {
            "lb_loss": E * jnp.sum(load_E * mean_prob_E),
            "z_loss": jnp.mean(jax.nn.logsumexp(logits_BTE, axis=-1) ** 2),
            "expert_load": load_E,
            "dropped_frac": 1.0 - jnp.mean(keep_GbTK.astype(jnp.float32)),
        }
        return y_BTD.astype(x_BTD.dtype), stats

    def _buffered(self, x_bTD, slot_bTK, w_bTK, cap: int) -> jax.Array:
        """One routing group through the fixed [E, C, D] buffers."""
        E, D = self.cfg.n_experts, x_bTD.shape[-1]
        if self.cfg.route_scale == "input":  # scale each assignment's input: expert_e(w * x)
            x_nD = (x_bTD[:, :, None, :] * w_bTK[..., None]).reshape(-1, 1, D)
            buf = dispatch(x_nD, slot_bTK.reshape(-1, 1, 1), E * cap)
        else:
            buf = dispatch(x_bTD, slot_bTK, E * cap)
        y_ECD = self.experts(buf.reshape(E, cap, D))
        y_bTKD = combine(y_ECD.reshape(E * cap, D), slot_bTK)
        if self.cfg.route_scale == "output":
            y_bTKD = y_bTKD * w_bTK[..., None]
        return jnp.sum(y_bTKD, axis=2)

    def _gathered(self, x_BTD, experts_BTK, w_BTK, keep_BTK) -> jax.Array:
        """Every assignment through its own expert's gathered weights: [B, T, K, D, F] reads."""
        ex, dt = self.experts, self.dtype
        pick = lambda name: (
            getattr(ex, name)[...][experts_BTK].astype(dt) if hasattr(ex, name) else 0
        )
        if self.cfg.route_scale == "input":
            x_BTKD = x_BTD[:, :, None, :] * w_BTK[..., None]
        else:
            x_BTKD = jnp.broadcast_to(x_BTD[:, :, None, :], (*experts_BTK.shape, x_BTD.shape[-1]))
        gate = jnp.einsum("btkd,btkdf->btkf", x_BTKD, pick("w_gate")) + pick("gate_bias")
        up = jnp.einsum("btkd,btkdf->btkf", x_BTKD, pick("w_up")) + pick("up_bias")
        y_BTKD = jnp.einsum("btkf,btkfd->btkd", jax.nn.silu(gate) * up, pick("w_down"))
        y_BTKD = y_BTKD + pick("down_bias")
        if self.cfg.route_scale == "output":
            y_BTKD = y_BTKD * w_BTK[..., None]
        return jnp.sum(jnp.where(keep_BTK[..., None], y_BTKD, 0), axis=2)
