"""LoRA adapters in the model: a low-rank pair beside a frozen weight (Hu et al. 2021).

    lora.attach(self, cfg, "attention", rngs)      # in a layer's __init__, after its weights
    y = weight_gather.einsum("btd,dhk->bthk", x, self.wq, dtype)
    y = y + lora.delta(self, "wq", x, "btd,dhk->bthk", dtype)   # 0 where wq has no adapter
    w = lora.merged(self, {"w_gate": ..., ...}, dtype)          # routed experts: W + s A B

A weight W [in..., out...] (a leading expert axis allowed) gets `lora_<name>`, a `LowRank`
holding A [in..., r] and B [r, out...]; the layer computes x W + (alpha / r) (x A) B.
A starts small and random, B at zero, so an adapted model starts equal to its base
(PEFT's initialisation, with a normal A of std 1/sqrt(fan_in) rather than its uniform).
A's input dims and B's output dims carry the weight's own logical axes, so each pair is
sharded like its weight (`sharding.LOGICAL_RULES`); the rank dim is replicated.

The routed experts' adapters (A [E, D, r], B [E, r, F], one pair per expert) are merged
into their weights as the layer reads them (`merged`: W_e + s A_e B_e, E D F r
multiply-adds a weight and layer, small beside the tokens' matmuls at any real batch),
and the merged weights go through whichever expert path runs (filled rows, the grouped
matmuls with their hand-written backwards, batched buffers, the decode gather). Their
weight gradients (which those paths compute anyway) flow on to A and B; no path is forked.
The price: no input dropout on the experts' adapters (`config.lora` refuses it).

Dropout (`lora.dropout`) applies in training steps only: `dropping(key)` around the
step's trace gives a key, each adapter folds in its own id (`LowRank.seed`, distinct per
weight, layer and block of the stack), and `delta` drops x's entries before A.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.sharding import LOGICAL_RULES, param

SEEDS = 1 << 24  # adapters' dropout seeds are integers below this (exact in float32)
PREFIX = "lora_"  # the attribute (and param path element) of a weight's adapter
# Each group of `lora.targets` and the weights of its layers that get adapters.
GROUP_WEIGHTS = {
    "attention": ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a"),
    "mlp": ("w_gate", "w_up", "w_down"),
    "shared": ("w_gate", "w_up", "w_down"),
    "experts": ("w_gate", "w_up", "w_down"),
}
IN_DIMS = {"wo": 2}  # dims a weight contracts (after any expert axis); 1 for the others

# (key, rate) of the training step being traced, or None: no dropout
_dropout: contextvars.ContextVar[tuple[jax.Array, float] | None] = contextvars.ContextVar(
    "lora_dropout", default=None
)


# True while tracing the base alone (DPO's reference): every adapter term left out
_off: contextvars.ContextVar[bool] = contextvars.ContextVar("lora_off", default=False)


@contextlib.contextmanager
def off():
    """Trace the model as its base: no adapter term, the experts' weights unmerged."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


@contextlib.contextmanager
def dropping(key: jax.Array, rate: float):
    """Trace a training step whose adapters drop their inputs at `rate`, masks from `key`."""
    token = _dropout.set((key, rate) if rate > 0 else None)
    try:
        yield
    finally:
        _dropout.reset(token)


class LowRank(nnx.Module):
    """A [lead..., in..., r] and B [lead..., r, out...] of one weight; `scale` = alpha / r."""

    def __init__(self, a: nnx.Param, b: nnx.Param, scale: float, lead: int, seed: jax.Array):
        self.a, self.b = a, b
        self.scale, self.lead = scale, lead
        # dropout's stream of this adapter: a param leaf, so that each block of the layer
        # stack holds its own; never trained (`params.TRAINED` names a and b only). An
        # integer in a float32 (exact below 2^24): an integer Param would stop `nnx.grad`.
        self.seed = nnx.Param(seed, out_sharding=(), sharding_rules=LOGICAL_RULES,
                              eager_sharding=False)  # fmt: skip


def attach(module: nnx.Module, cfg, group: str, rngs: nnx.Rngs) -> None:
    """Give `module`'s weights of `group` (GROUP_WEIGHTS) adapters of rank lora.rank, where
    lora.targets names the group."""
    lc = cfg.lora
    if lc.rank == 0 or group not in lc.targets:
        return
    lead = 1 if group == "experts" else 0
    for name in GROUP_WEIGHTS[group]:
        if not hasattr(module, name):
            continue
        w = getattr(module, name)
        shape, axes = tuple(w.shape), tuple(w.get_metadata()["out_sharding"])
        k = lead + IN_DIMS.get(name, 1)
        fan_in = math.prod(shape[lead:k])
        init_a = nnx.initializers.normal(fan_in**-0.5)
        a = param(rngs, init_a, shape[:k] + (lc.rank,), axes[:k] + (None,))
        b = param(rngs, nnx.initializers.zeros, shape[:lead] + (lc.rank,) + shape[k:],
                  axes[:lead] + (None,) + axes[k:])  # fmt: skip
        seed = jax.random.randint(rngs.params(), (), 0, SEEDS).astype(jnp.float32)
        setattr(module, PREFIX + name, LowRank(a, b, lc.alpha / lc.rank, lead, seed))


def has_adapter(module: nnx.Module, name: str) -> bool:
    return hasattr(module, PREFIX + name)


def _unused_letter(subscripts: str) -> str:
    return next(c for c in "zyxwvu" if c not in subscripts)


def delta(module: nnx.Module, name: str, x, subscripts: str, dtype):
    """The adapter's term (alpha / r) (x A) B of `jnp.einsum(subscripts, x, W)` for weight
    `name` of `module`, or 0 where it has none. x's letters shared with W's are contracted
    (W's first dims); the rest of W's are the output's."""
    if not has_adapter(module, name) or _off.get():
        return 0
    ad: LowRank = getattr(module, PREFIX + name)
    lhs, rest = subscripts.split(",")
    w, out = rest.split("->")
    r = _unused_letter(subscripts)
    contracted = "".join(c for c in w if c in lhs)
    kept = "".join(c for c in lhs if c not in contracted)
    state = _dropout.get()
    if state is not None:
        key, rate = state
        seed = jax.lax.stop_gradient(ad.seed[...]).astype(jnp.uint32)
        key = jax.random.fold_in(key, seed)
        keep = jax.random.bernoulli(key, 1 - rate, x.shape)
        x = jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)
    xa = jnp.einsum(f"{lhs},{contracted}{r}->{kept}{r}", x, ad.a[...].astype(dtype))
    y = jnp.einsum(f"{kept}{r},{r}{w[len(contracted) :]}->{out}", xa, ad.b[...].astype(dtype))
    return y * jnp.asarray(ad.scale, dtype)


def merged(module: nnx.Module, weights: dict) -> dict:
    """`weights` (name -> array) with each adapted one W replaced by W + (alpha / r) A B, in
    float32 (the layer casts it to its compute dtype as it reads it)."""
    out = dict(weights)
    for name, w in weights.items():
        if has_adapter(module, name) and not _off.get():
            ad: LowRank = getattr(module, PREFIX + name)
            ab = product(ad.a[...], ad.b[...], ad.lead)
            out[name] = w.astype(jnp.float32) + ad.scale * ab
    return out


def product(a, b, n_lead: int):
    """A B of an adapter's A [lead..., in..., r] and B [lead..., r, out...] (NumPy or JAX
    arrays; `n_lead` leading dims: a layer stack's, the experts'): float32
    [lead..., in..., out...]."""
    lead, r = a.shape[:n_lead], a.shape[-1]
    ab = a.reshape(*lead, -1, r).astype("float32") @ b.reshape(*lead, r, -1).astype("float32")
    return ab.reshape(*a.shape[:-1], *b.shape[n_lead + 1 :])
