"""Mixture-of-Experts feed-forward: top-k routing with a capacity factor, sort-based dispatch.

Semantics (DESIGN.md):
- Router logits `x @ W_r (+ b)` in float32. `softmax`: probabilities over all experts, top-k,
  optionally renormalised over the k (which is exactly "top-k, then softmax over the k").
  `sigmoid` (Llama 4): top-k on the raw logits, weight = sigmoid(logit), optionally renormalised;
  `sqrtsoftplus` (DeepSeek-V4) likewise with sqrt(softplus(logit)). Hash-routed layers
  (DeepSeek-V4's first, moe.hash_layers) take their experts from a fixed token-id table.
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
- Expert parallelism: under a mesh, each batch shard routes its own tokens (one group per
  shard) inside `jax.shard_map`; an `all_to_all` over the `expert` axis sends each expert's
  buffer slots (and, for the per-expert path, how many are filled) to the shard that owns the
  expert, the local experts run (hidden dim split over `tensor`, partial sums psum-ed), and a
  second `all_to_all` brings the results home. With the grouped impl on GPU / TPU
  (`backends.exchange`), only the kept assignments travel instead: sorted by expert, sent by
  `ragged_all_to_all` straight into each owner's rows grouped by its local expert, run as
  one grouped matmul and sent back the same way (no padding on the wire when dropless). Each
  owner's receive buffer holds `moe.recv_factor` times the average rows, not the worst case
  (every token of every shard to one owner); rows past it go in further rounds, never dropped
  (`exchange_rounds.py`; the rounds and the overflow are per-layer metrics). Expert weights
  never move. Aux statistics are psum-ed over the batch axes, so they are global.
- Padding (`valid_BT` False, from segment 0 of a packed batch) is not routed: it takes no
  slot of any expert's capacity, its output is 0 (plus the shared expert's), and it counts
  in no statistic. Capacity stays sized by the group's token count, padding included, so
  shapes do not depend on the data.
- Aux losses over all (valid) tokens of the call: Switch load balance `E * sum_e f_e * P_e`
  with f_e the fraction of top-k assignments to e and P_e the mean router probability
  (softmax; for sigmoid the per-token normalised sigmoid), and router z-loss
  `mean(logsumexp(logits)^2)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import backends
from moe_jax.config import Config
from moe_jax.model import lora, weight_gather
from moe_jax.model.exchange import expert_parallel
from moe_jax.model.experts import (
    GROUPED_IMPLS,
    Experts,
    SwiGLU,
    down_bias,
    expert_swiglu,
    filled_slots,
    picked_swiglu,
)
from moe_jax.model.glu import Activation
from moe_jax.model.grouped import grouped_swiglu, inverse, sort_rows, spread_rows, unsort_rows
from moe_jax.model.routing import (
    Routing,
    aux_stats,
    from_buffers,
    route_group,
    scale_inputs,
    sum_choices,
    to_buffers,
)
from moe_jax.named_scopes import COMBINE, DISPATCH, SHARED_EXPERT
from moe_jax.sharding import n_batch_shards, param

__all__ = ["FLOAT32_PARAMS", "MoE", "SwiGLU"]

# Params kept float32 whatever the checkpoint's dtype, as the releases keep them (DeepSeek-V3,
# Kimi K2, GLM-4.5: e_score_correction_bias): the bias moves by steps of bias_update_rate
# (1e-3), which bf16 rounds away beside a bias of order 1. An export never narrows them.
# DeepSeek-V4's hash table holds expert ids, exact in float32 (below 2^24), not in bf16.
FLOAT32_PARAMS = frozenset({"correction_bias", "tid2eid"})


def hash_table(n_experts: int):
    """The initialiser of a hash-routed layer's `tid2eid` [vocab_size, top_k]: for each token
    id, top_k distinct experts drawn at random (Roller et al. 2021's random hash), stored as
    float32 ids. An integer param would stop `nnx.grad`; read through an integer cast it gets
    a zero gradient, and `train.step.decay_mask` spares it, so AdamW never moves it."""

    def init(key, shape, dtype):
        V, K = shape
        order_VE = jnp.argsort(jax.random.uniform(key, (V, n_experts)), axis=-1)
        return order_VE[:, :K].astype(dtype)

    return init


class MoE(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, hashed: bool = False):
        """`hashed`: DeepSeek-V4's hash routing (moe.hash_layers): the experts a token takes
        are its row of `tid2eid`, and the layer has no correction bias (`__call__`)."""
        m = cfg.moe
        D, E = cfg.model.d_model, m.n_experts
        self.cfg = m
        self.dtype = jnp.dtype(backends.compute_dtype(cfg.model.dtype))
        self.router = param(
            rngs, nnx.initializers.normal(cfg.model.init_std), (D, E), ("embed", None)
        )
        if m.router_bias:
            self.router_bias = param(rngs, nnx.initializers.zeros, (E,), (None,))
        if hashed:  # [V, K] expert ids (float32), never trained
            V = cfg.model.vocab_size
            self.tid2eid = param(rngs, hash_table(E), (V, m.top_k), ("vocab", None))
        elif m.correction_bias:  # chooses experts only; trained without a gradient (routing.py)
            self.correction_bias = param(rngs, nnx.initializers.zeros, (E,), (None,))
        self.experts = Experts(cfg, rngs=rngs)
        lora.attach(self.experts, cfg, "experts", rngs)
        if m.shared_expert_hidden > 0:
            self.shared = SwiGLU(D, m.shared_expert_hidden, cfg, rngs=rngs)
            lora.attach(self.shared, cfg, "shared", rngs)
        if m.shared_expert_gate:  # Qwen3-Next's: a scalar gate per token on the shared expert
            init = nnx.initializers.normal(cfg.model.init_std)
            self.shared_gate = param(rngs, init, (D, 1), ("embed", None))

    def router_logits(self, x_BTD: jax.Array) -> jax.Array:
        logits = x_BTD.astype(jnp.float32) @ self.router[...]
        if hasattr(self, "router_bias"):
            logits = logits + self.router_bias[...]
        return logits

    def __call__(
        self,
        x_BTD: jax.Array,
        n_groups: int = 1,
        valid_BT: jax.Array | None = None,
        replay_BTK: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        """x_BTD -> (y_BTD, stats). Without a mesh the batch is routed in `n_groups` groups.
        `valid_BT` (bool, optional): False marks padding, which is not routed. `replay_BTK`
        (int, optional): routing replay, the experts to use (-1: route the token itself;
        `routing.route`). stats["experts"] [B, T, K]: the experts every token took.
        A hash-routed layer is given its table's rows for the tokens as `replay_BTK`
        (`hashed_experts`): routed as a replay (expert parallelism carries them the same
        way), weighted by the router's scores at them as `routing.route` weighs a replay's,
        which is transformers' DeepseekV4HashRouter."""
        if hasattr(self, "tid2eid") and replay_BTK is None:
            raise ValueError(
                "a hash-routed MoE layer (moe.hash_layers) routes by token id: "
                "pass hashed_experts(tokens) as replay_BTK"
            )
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            y_BTD, stats = self._local(x_BTD, n_groups, valid_BT, replay_BTK)
        else:  # rows split over the batch axes, or (a batch they do not divide) replicated
            replicated = x_BTD.shape[0] % n_batch_shards(mesh) != 0
            y_BTD, sums, experts_BTK = expert_parallel(
                x_BTD,
                valid_BT,
                replay_BTK,
                weights=self.experts.weights(),
                router=self._router_params(),
                cfg=self.cfg,
                dtype=self.dtype,
                impl=self._impl(),
                mesh=mesh,
                replicated=replicated,
            )
            stats = aux_stats(sums, x_BTD.shape[0] * x_BTD.shape[1], self.cfg)
            stats["experts"] = experts_BTK
        if hasattr(self, "shared"):
            with jax.named_scope(SHARED_EXPERT):
                y_BTD = y_BTD + self._shared(x_BTD)
        return y_BTD.astype(x_BTD.dtype), stats

    def hashed_experts(self, tokens_BT: jax.Array) -> jax.Array:
        """A hash-routed layer's experts [B, T, K] for the token ids (int32, no gradient)."""
        table_VK = jax.lax.stop_gradient(self.tid2eid[...])
        return jnp.take(table_VK, tokens_BT, axis=0).astype(jnp.int32)

    def _shared(self, x_BTD: jax.Array) -> jax.Array:
        """The shared expert's output, times sigmoid(x . w_gate) with moe.shared_expert_gate."""
        y_BTD = self.shared(x_BTD)
        if hasattr(self, "shared_gate"):
            gate = weight_gather.einsum("btd,do->bto", x_BTD, self.shared_gate, self.dtype)
            y_BTD = y_BTD * jax.nn.sigmoid(gate)
        return y_BTD

    def _local(self, x_BTD: jax.Array, n_groups: int, valid_BT, replay_BTK) -> tuple:
        B, T, D = x_BTD.shape
        G, K, E = n_groups, self.cfg.top_k, self.cfg.n_experts
        assert B % G == 0, f"batch {B} does not split into {G} routing groups"
        split = lambda a: None if a is None else a.reshape(G, B // G, *a.shape[1:])
        router, cfg, dtype = self._router_params(), self.cfg, self.dtype
        r_G = jax.vmap(
            lambda x, v, e: route_group(
                x, **router, cfg=cfg, dtype=dtype, valid_bT=v, replay_bTK=e
            ),
            out_axes=Routing(0, 0, 0, 0, None, 0),
        )(split(x_BTD), split(valid_BT), split(replay_BTK))
        sums = jax.tree.map(lambda a: jnp.sum(a, axis=0), r_G.sums)
        merge = lambda a: a.reshape(B, *a.shape[2:])
        if B * T * K < E:
            # Few tokens in flight (decoding): read only the picked experts' weights instead
            # of running all E experts on mostly empty buffers. Same drops as the buffers.
            # (LoRA: the merged weights of every expert; merge adapters before serving)
            ex = self.experts.weights() if self.experts.has_adapters() else self.experts
            y_BTD = picked_swiglu(
                x_BTD, merge(r_G.experts), merge(r_G.weights), merge(r_G.keep), ex,
                self.dtype, route_scale=self.cfg.route_scale, act=Activation.from_config(self.cfg),
                impl=self.cfg.decode_impl,
            )  # fmt: skip
        elif self._impl() in GROUPED_IMPLS:
            # With a capacity no expert takes more than the groups' slots: the weight gradient
            # runs padded to them; dropless that bound is every row (ragged_dot's own).
            bound = G * r_G.cap if self.cfg.capacity_factor > 0 else None
            r = Routing(*(merge(a) for a in r_G[:4]), r_G.cap, sums)
            y_BTD = self._grouped(x_BTD, r, bound)
        else:
            y_BTD = merge(self._buffered(split(x_BTD), r_G))
        return y_BTD, aux_stats(sums, B * T, self.cfg) | {"experts": merge(r_G.experts)}

    def _router_params(self) -> dict:
        """route_group's router arguments, by name."""
        bias = self.router_bias[...] if hasattr(self, "router_bias") else jnp.zeros(())
        params = {"router_DE": self.router[...], "router_bias_E": bias}
        if hasattr(self, "correction_bias"):
            params["correction_E"] = self.correction_bias[...]
        return params

    def _impl(self) -> str:
        mesh = jax.sharding.get_abstract_mesh()
        impl = backends.choose(
            "moe",
            self.cfg.impl,
            dtype=self.dtype,
            dropless=self.cfg.capacity_factor <= 0,
            shape=self._kernel_shape(mesh),
        )
        if impl == "megablox" and not jax.sharding.get_abstract_mesh().empty:
            raise backends.KernelError(
                "moe.impl=megablox runs without a mesh only (jax's megablox pallas_call "
                "declares no varying mesh axes for shard_map); use moe.impl=ragged or auto"
            )
        return impl

    def _kernel_shape(self, mesh) -> dict:
        """What `backends.takes` weighs for the MoE kernels: the contracted and output dims
        of the expert matmuls (the hidden dim as each tensor shard holds it) and the
        expert-parallel degree."""
        axes = {} if mesh.empty else dict(mesh.shape)
        tp, ep = axes.get("tensor", 1), axes.get("expert", 1)
        return {"dims": (self.router.shape[0], self.cfg.expert_hidden // tp), "ep": ep}

    def _grouped(self, x_BTD, r: Routing, max_group=None) -> jax.Array:
        """Every kept assignment through its expert as rows sorted by expert, one grouped
        matmul per projection: no [E, C] buffers and no padding rows (`grouped.py`).
        `max_group`: no expert has more rows (see `grouped.grouped_matmul`)."""
        B, T, K = r.experts.shape
        D, E = x_BTD.shape[-1], self.cfg.n_experts
        with jax.named_scope(DISPATCH):
            order_n, sizes_E = sort_rows(r.experts.reshape(-1), r.keep.reshape(-1), E)
            expert_n = r.experts.reshape(-1)[order_n]
            inv_n = inverse(order_n)
            x_nD = spread_rows(x_BTD.reshape(B * T, D), order_n, inv_n, K)
            x_nD = scale_inputs(x_nD, r.weights.reshape(-1)[order_n], self.cfg.route_scale)
        w = self.experts.weights()
        bias = w.pop("down_bias", None)
        y_nD = grouped_swiglu(
            x_nD, w, sizes_E, expert_n, self.dtype, self._impl(), max_group, self.cfg.row_chunks,
            act=Activation.from_config(self.cfg),
        )  # fmt: skip
        if bias is not None:
            y_nD = y_nD + down_bias(bias[expert_n], self.dtype)
        with jax.named_scope(COMBINE):
            y_BTKD = unsort_rows(y_nD, inv_n, order_n).reshape(B, T, K, D)
            return sum_choices(y_BTKD, r.weights, r.keep, self.cfg.route_scale)

    def _buffered(self, x_GbTD, r_G: Routing) -> jax.Array:
        """G routing groups through fixed [E, C, D] buffers on this device. Only dispatch and
        combine are vmapped over the groups: the experts take them as segments, so that each
        segment's filled-row bucket stays a scalar (a vmapped switch runs every branch)."""
        E, D = self.cfg.n_experts, x_GbTD.shape[-1]
        G, cap, scale = x_GbTD.shape[0], r_G.cap, self.cfg.route_scale
        in_axes = Routing(0, 0, 0, 0, None, 0)
        buf_GSD = jax.vmap(to_buffers, in_axes=(0, in_axes, None, None))(x_GbTD, r_G, E, scale)
        filled_GE = jax.vmap(filled_slots, in_axes=(0, None, None))(r_G.slot, E, cap)
        y_EGCD = expert_swiglu(
            buf_GSD.reshape(G, E, cap, D).transpose(1, 0, 2, 3),
            self.experts.weights(),
            self.dtype,
            filled_ES=filled_GE.T,
            impl=self._impl(),
            act=Activation.from_config(self.cfg),
        )
        y_GSD = y_EGCD.transpose(1, 0, 2, 3).reshape(G, E * cap, D)
        return jax.vmap(from_buffers, in_axes=(0, 0, 0, None))(y_GSD, r_G.slot, r_G.weights, scale)
