"""Gated DeltaNet (Yang et al., 2024), the linear-attention layer of Qwen3-Next and Qwen3.5-MoE,
computed as transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5MoeGatedDeltaNet` compute it.

Each value head keeps a [K, V] state S, a fast-weight memory from keys to values. A token
decays it by exp(g) (g < 0), reads what it holds for its key, writes back a beta-weighted
correction toward its value (the delta rule), and its query reads the updated state:

    S' = exp(g_t) S;   S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T;   o_t = S_t^T q_t

Training runs that recurrence a chunk of `CHUNK` tokens at a time (`chunked_rule`): within a
chunk the writes are solved for at once (the UT / WY form: a unit lower-triangular system),
and a `lax.scan` over the chunks carries S. Decoding runs it one token at a time
(`recurrent_rule`), with the last `conv_kernel - 1` inputs of the short convolution beside S
(`GDNState`). Both forms compute the same function; tests/test_gated_deltanet.py checks them
against each other in float64 and the layer against transformers' torch layer.

Shape letters here (the house's, except):

    N  key heads (`num_k_heads`)       H  value heads (`num_v_heads`), the rule's heads
    G  value heads per key head        K  a key (and query) head's width
    V  a value head's width            C  the convolved channels, q | k | v (2 N K + H V)
    W  the convolution's kernel (the window it keeps holds its W - 1 previous inputs)
    L  a chunk's tokens (`CHUNK`; LL its square)
    n  chunks (lower case: it varies with the call's length)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.model import weight_gather
from moe_jax.named_scopes import ATTENTION, scoped
from moe_jax.sharding import param

# The training form's chunk: the reference's and fla's kernels' (64 rows of the triangular
# solve; larger chunks trade the scan's length for [L, L] work that grows as L squared).
CHUNK = 64
# The L2 norm's epsilon on q and k: fixed in the reference (fla's), not the config's rms eps.
L2_EPS = 1e-6
# The log decay put on a document's first token of a packed row: exp of it is 0 in float32
# and float64 alike, so the state the previous document left is wiped, yet it is finite, so
# no sum of decays becomes inf - inf and no gradient NaN.
RESET_G = -1e4


@dataclasses.dataclass(frozen=True)
class GDNSizes:
    """A Gated DeltaNet layer's sizes (transformers' `linear_*` config fields)."""

    d_model: int
    n_key_heads: int
    n_value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6  # the gated RMSNorm's (the config's rms_norm_eps)

    def __post_init__(self):
        if self.n_value_heads % self.n_key_heads:
            raise ValueError(
                f"num_v_heads {self.n_value_heads} is not a multiple of num_k_heads "
                f"{self.n_key_heads}: each key head serves a whole group of value heads"
            )

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_key_heads * self.key_dim + self.n_value_heads * self.value_dim

    @classmethod
    def from_hf_config(cls, c: dict) -> GDNSizes:
        """Sizes from a transformers Qwen3-Next / Qwen3.5 (text) `config.json`."""
        return cls(
            d_model=c["hidden_size"],
            n_key_heads=c["linear_num_key_heads"],
            n_value_heads=c["linear_num_value_heads"],
            key_dim=c["linear_key_head_dim"],
            value_dim=c["linear_value_head_dim"],
            conv_kernel=c.get("linear_conv_kernel_dim", 4),
            eps=c.get("rms_norm_eps", 1e-6),
        )


class GDNState(NamedTuple):
    """A layer's decode state: the convolution's last W - 1 inputs, channels in the reference's
    order (q | k | v, as its cache holds them), and the rule's state per value head."""

    conv_BCW: jax.Array  # [B, C, W - 1], the layer's dtype
    rule_BHKV: jax.Array  # [B, H, K, V], float32 (the rule's dtype)


# ----------------------------------------------------------------------------- the rule


def _rule_dtype(x):
    """The reference runs the rule (and the conv, the norms, the decay) in float32 whatever
    the activations' dtype: float32 at least, float64 kept (the tests' exact runs)."""
    return jnp.promote_types(getattr(x, "dtype", x), jnp.float32)


def _rule_inputs(q_BTNK, k_BTNK, v_BTHV, g_BTH, beta_BTH):
    """The rule's inputs in its dtype, q and k repeated over their value heads (value head h
    reads key head h // G, as the fused projection groups them)."""
    dt = _rule_dtype(v_BTHV)
    G = v_BTHV.shape[2] // k_BTNK.shape[2]
    q_BTHK, k_BTHK = (jnp.repeat(x.astype(dt), G, axis=2) for x in (q_BTNK, k_BTNK))
    return q_BTHK, k_BTHK, v_BTHV.astype(dt), g_BTH.astype(dt), beta_BTH.astype(dt)


def _initial_state(state_BHKV, v_BTHV, K: int) -> jax.Array:
    B, _, H, V = v_BTHV.shape
    dt = _rule_dtype(v_BTHV)
    return jnp.zeros((B, H, K, V), dt) if state_BHKV is None else state_BHKV.astype(dt)


def _rule_step(S_BHKV, inputs):
    """One token of the recurrence: decay, the delta-rule write, then the read."""
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH = inputs
    S_BHKV = S_BHKV * jnp.exp(g_BH)[..., None, None]
    held_BHV = jnp.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK)
    write_BHV = (v_BHV - held_BHV) * beta_BH[..., None]
    S_BHKV = S_BHKV + k_BHK[..., :, None] * write_BHV[..., None, :]
    return S_BHKV, jnp.einsum("bhkv,bhk->bhv", S_BHKV, q_BHK)


def recurrent_rule(q_BTNK, k_BTNK, v_BTHV, g_BTH, beta_BTH, state_BHKV=None):
    """The gated delta rule token by token: outputs [B, T, H, V] (v's dtype) and the final
    state [B, H, K, V] (float32, or float64 for float64 inputs). q and k as the rule takes
    them (L2-normalised, q scaled by 1/sqrt(K))."""
    q, k, v, g, beta = _rule_inputs(q_BTNK, k_BTNK, v_BTHV, g_BTH, beta_BTH)
    S_BHKV = _initial_state(state_BHKV, v_BTHV, q.shape[-1])
    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    S_BHKV, o_TBHV = jax.lax.scan(_rule_step, S_BHKV, tuple(map(time_major, (q, k, v, g, beta))))
    return jnp.moveaxis(o_TBHV, 0, 1).astype(v_BTHV.dtype), S_BHKV


def _in_chunks(x_BTX, chunk: int):
    """[B, T, H, ...] -> [n, B, H, L, ...]: chunks leading, for the scan over them."""
    B, T = x_BTX.shape[:2]
    x = x_BTX.reshape(B, T // chunk, chunk, *x_BTX.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def _gaps(g_nBHL) -> jax.Array:
    """gap[i, j] = sum of g over j < m <= i, the log decay from token j's write to token i's
    read (0 on the diagonal), -inf above it (no decay there: exp gives 0, and no gradient).

    Summed over the pair's own tokens rather than as c_i - c_j: the cumulative c reaches
    -1e3 within a chunk of strongly decaying heads (A up to 16), where float32's c_i - c_j
    of two close tokens loses ~1e-4 of its value, an error of that size on what is read of
    recent tokens (transformers' form; on such decays the float32 rule's outputs were 1.6e-5
    from float64's that way, 2e-7 this way)."""
    L = g_nBHL.shape[-1]
    strict_LL = jnp.tril(jnp.ones((L, L), bool), -1)
    # x[m, j] = g_m for m > j; summed down column j to row i: g over j < m <= i
    gap_nBHLL = jnp.cumsum(jnp.where(strict_LL, g_nBHL[..., :, None], 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((L, L), bool)), gap_nBHLL, -jnp.inf)


def _within_chunks(q, k, v, g, beta):
    """Each chunk's own part of the rule, for all chunks at once ([n, B, H, L, ...]).

    With c_i the chunk's cumulative log decay to token i and S0 the state at its start, the
    writes u_i = beta_i (v_i - S'^T k_i) of the chunk's tokens satisfy
        u_i + sum_{j<i} beta_i exp(c_i - c_j) (k_i . k_j) u_j
            = beta_i v_i - beta_i exp(c_i) S0^T k_i,
    a unit lower-triangular system (I + A) U = beta V - (beta exp(c) K) S0 (the UT form).
    Solving it for both right-hand sides gives U = u0 - w S0 with u0 and w free of S0, so
    only `w S0` waits for the previous chunk. The decays between two tokens of the chunk come
    from `_gaps`, not from differences of c.
    """
    L = g.shape[-1]
    c_nBHL = jnp.cumsum(g, axis=-1)
    gap_nBHLL = _gaps(g)
    decay_nBHLL = jnp.exp(gap_nBHLL)
    kk_nBHLL = jnp.einsum("...ik,...jk->...ij", k, k)
    strict_LL = jnp.tril(jnp.ones((L, L), bool), -1)
    A_nBHLL = jnp.where(strict_LL, beta[..., None] * kk_nBHLL * decay_nBHLL, 0.0)
    V = v.shape[-1]
    rhs = jnp.concatenate([v, k * jnp.exp(c_nBHL)[..., None]], axis=-1) * beta[..., None]
    # unit_diagonal: the solver takes the diagonal as ones, so A's zero diagonal stands for I
    solved = jax.lax.linalg.triangular_solve(
        A_nBHLL, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    u0_nBHLV, w_nBHLK = solved[..., :V], solved[..., V:]
    # what each query reads of the chunk's own writes, and of the state it starts from
    attn_nBHLL = jnp.einsum("...ik,...jk->...ij", q, k) * decay_nBHLL
    q_decayed = q * jnp.exp(c_nBHL)[..., None]
    # each key's write decayed to the chunk's end, and the whole chunk's decay, for the state
    k_decayed = k * jnp.exp(gap_nBHLL[..., -1, :])[..., None]
    chunk_decay_nBH = jnp.exp(c_nBHL[..., -1])
    return u0_nBHLV, w_nBHLK, attn_nBHLL, q_decayed, k_decayed, chunk_decay_nBH


def _chunk_step(S_BHKV, chunk):
    """One chunk given the state at its start: its outputs and the state at its end."""
    u0, w, attn, q_decayed, k_decayed, decay_BH = chunk
    u_BHLV = u0 - jnp.einsum("bhlk,bhkv->bhlv", w, S_BHKV)
    o_BHLV = jnp.einsum("bhlk,bhkv->bhlv", q_decayed, S_BHKV)
    o_BHLV = o_BHLV + jnp.einsum("bhij,bhjv->bhiv", attn, u_BHLV)
    S_BHKV = S_BHKV * decay_BH[..., None, None] + jnp.einsum("bhlk,bhlv->bhkv", k_decayed, u_BHLV)
    return S_BHKV, o_BHLV


def chunked_rule(q_BTNK, k_BTNK, v_BTHV, g_BTH, beta_BTH, state_BHKV=None, chunk: int = CHUNK):
    """The gated delta rule `chunk` tokens at a time; same contract as `recurrent_rule`.

    The length is padded to whole chunks with g = 0 and beta = 0: a padded token neither
    decays nor writes the state, so the final state is the last real token's."""
    q, k, v, g, beta = _rule_inputs(q_BTNK, k_BTNK, v_BTHV, g_BTH, beta_BTH)
    B, T, H, V = v.shape
    S_BHKV = _initial_state(state_BHKV, v_BTHV, q.shape[-1])
    pad = -T % chunk
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = (_in_chunks(padded(x), chunk) for x in (q, k, v, g, beta))
    S_BHKV, o_nBHLV = jax.lax.scan(_chunk_step, S_BHKV, _within_chunks(q, k, v, g, beta))
    o_BTHV = jnp.moveaxis(o_nBHLV, 0, 1).swapaxes(2, 3).reshape(B, T + pad, H, V)
    return o_BTHV[:, :T].astype(v_BTHV.dtype), S_BHKV


# ----------------------------------------------------------------------------- the layer


def causal_conv(x_BTC, w_CW, window_BCW=None, taps_BTW=None):
    """Depthwise causal convolution over time (the reference's `conv1d`, padded on the left
    with the previous W - 1 inputs: `window_BCW`, zeros at a sequence's start), in float32
    at least (the reference's: in its weights' dtype). `taps_BTW` (bool): which of token t's
    W inputs (the oldest first) it reads, the others taken as zeros (`document_taps`).
    Returns the outputs [B, T, C] and the last W - 1 inputs [B, C, W - 1], the next window."""
    B, T, C = x_BTC.shape
    W = w_CW.shape[-1]
    if window_BCW is None:
        window_BCW = jnp.zeros((B, C, W - 1), x_BTC.dtype)
    x_BSC = jnp.concatenate([window_BCW.swapaxes(1, 2).astype(x_BTC.dtype), x_BTC], axis=1)
    dt = _rule_dtype(x_BTC)
    xf_BSC, wf_CW = x_BSC.astype(dt), w_CW.astype(dt)
    tap = lambda j: xf_BSC[:, j : j + T] * wf_CW[:, j]
    if taps_BTW is None:
        y_BTC = sum(tap(j) for j in range(W))
    else:
        y_BTC = sum(jnp.where(taps_BTW[:, :, j, None], tap(j), 0.0) for j in range(W))
    return y_BTC, x_BSC[:, T:].swapaxes(1, 2)


def _kept_window(x_BTC, window_BCW, valid_BT) -> jax.Array:
    """[B, C, W - 1]: the last W - 1 valid inputs of the window then x (oldest first), where
    padding may sit anywhere (the sampler's prompts are padded on the right)."""
    B, T, C = x_BTC.shape
    W1 = window_BCW.shape[-1]
    x_BSC = jnp.concatenate([window_BCW.swapaxes(1, 2).astype(x_BTC.dtype), x_BTC], axis=1)
    valid_BS = jnp.concatenate([jnp.ones((B, W1), bool), valid_BT], axis=1)
    rank_BS = jnp.cumsum(valid_BS, axis=1)  # valid inputs up to and including s
    # slot j takes the valid input of rank total - (W - 2) + j (the window's are valid: >= 1)
    want_BJ = rank_BS[:, -1:] - (W1 - 1) + jnp.arange(W1)
    hit_BJS = valid_BS[:, None, :] & (rank_BS[:, None, :] == want_BJ[:, :, None])
    index_BJ = jnp.argmax(hit_BJS, axis=-1)
    return jnp.take_along_axis(x_BSC, index_BJ[..., None], axis=1).swapaxes(1, 2)


def document_taps(segments_BT, W: int) -> jax.Array:
    """[B, T, W] bool: whether token t's convolution input j (token t - (W - 1) + j) is of
    its own document, for packed rows (documents contiguous, numbered in `segments_BT`)."""
    T = segments_BT.shape[1]
    padded_BS = jnp.pad(segments_BT, ((0, 0), (W - 1, 0)), constant_values=-1)
    return jnp.stack([padded_BS[:, j : j + T] == segments_BT for j in range(W)], axis=-1)


def document_starts(segments_BT) -> jax.Array:
    """[B, T] bool: a token whose document differs from the previous token's (not the
    row's first: the state is empty there anyway)."""
    return jnp.pad(segments_BT[:, 1:] != segments_BT[:, :-1], ((0, 0), (1, 0)))


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """x / sqrt(|x|^2 + eps) over the last axis, in float32 at least (the reference's)."""
    x = x.astype(_rule_dtype(x))
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(o_BTHV, z_BTHV, scale_V, eps: float, dtype) -> jax.Array:
    """RMSNorm of each head's output, then the SiLU gate of z: norm before gate, as the
    reference's `RMSNormGated` (scale initialised to ones and multiplied as is, not 1 + w)."""
    of = o_BTHV.astype(_rule_dtype(o_BTHV))
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    y = scale_V.astype(dtype) * y.astype(dtype)
    return (y * jax.nn.silu(z_BTHV.astype(of.dtype))).astype(dtype)


def _a_log_init(key, shape, dtype):
    """log A with A ~ U(0.01, 16): the reference's, kept off 0 so log A is finite."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 0.01, 16.0))


class GatedDeltaNet(nnx.Module):
    """The layer: x [B, T, D] -> [B, T, D]. `__call__` (training) and `prefill` run the rule
    in chunks, `step` one token from a `GDNState`.

    Its weights, one per stream, heads as axes (as `Attention`'s): q and k [D, N, K], v and
    the output gate z [D, H, V], the write strength b and the decay's input a [D, H]; the
    convolution's [C, W] over the channels q | k | v; the decay's `A_log` and `dt_bias` [H];
    the gated norm's scale [V]; the output projection [H, V, D]. Both transformers layouts
    (Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba`, Qwen3.5's separate projections) map
    onto these by `from_hf`."""

    def __init__(self, sizes: GDNSizes, *, rngs: nnx.Rngs, init_std=0.02, dtype=jnp.float32):
        s = sizes
        D, N, H, K, V = s.d_model, s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim
        self.sizes = s
        self.dtype = jnp.dtype(dtype)
        normal = nnx.initializers.normal(init_std)
        ones = nnx.initializers.ones
        self.wq = param(rngs, normal, (D, N, K), ("embed", "kv_heads", "head_dim"))
        self.wk = param(rngs, normal, (D, N, K), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, normal, (D, H, V), ("embed", "heads", "head_dim"))
        self.wz = param(rngs, normal, (D, H, V), ("embed", "heads", "head_dim"))
        self.wb = param(rngs, normal, (D, H), ("embed", "heads"))
        self.wa = param(rngs, normal, (D, H), ("embed", "heads"))
        # the channels mix q's, k's and v's heads, so no head axis names them
        self.conv = param(rngs, normal, (s.conv_channels, s.conv_kernel), (None, None))
        self.dt_bias = param(rngs, ones, (H,), ("heads",))
        self.A_log = param(rngs, _a_log_init, (H,), ("heads",))
        self.norm_scale = param(rngs, ones, (V,), ("head_dim",))
        self.wo = param(rngs, normal, (H, V, D), ("heads", "head_dim", "embed"))

    def _project(self, x_BTD, name: str, spec: str) -> jax.Array:
        return weight_gather.einsum(spec, x_BTD, getattr(self, name), self.dtype)

    def _streams(self, x_BTD, window_BCW, mask_BT, segments_BT=None):
        """The rule's inputs from x: q, k, v through the convolution and SiLU, q and k
        L2-normalised (q also by 1/sqrt(K)), the decay g and the write strength beta; the
        gate z; the convolution's next window. A masked token (0 in `mask_BT`) enters as
        zeros, as the reference's padding does, and leaves the state and the window as they
        were (no decay, no write), so prompts may be padded on either side.
        `segments_BT` (packed rows): no document reads another's inputs through the
        convolution, and each document's first token wipes the state (`RESET_G`)."""
        s = self.sizes
        B, T, _ = x_BTD.shape
        if mask_BT is not None:
            x_BTD = x_BTD * mask_BT[:, :, None].astype(x_BTD.dtype)
        q = self._project(x_BTD, "wq", "btd,dnk->btnk").reshape(B, T, -1)
        k = self._project(x_BTD, "wk", "btd,dnk->btnk").reshape(B, T, -1)
        v = self._project(x_BTD, "wv", "btd,dhv->bthv").reshape(B, T, -1)
        taps = None if segments_BT is None else document_taps(segments_BT, s.conv_kernel)
        qkv_BTC = jnp.concatenate([q, k, v], -1)
        if window_BCW is None:  # a sequence's start: zeros before it
            window_BCW = jnp.zeros((B, s.conv_channels, s.conv_kernel - 1), qkv_BTC.dtype)
        y_BTC, next_BCW = causal_conv(qkv_BTC, self.conv[...], window_BCW, taps)
        if mask_BT is not None:  # the window the real tokens leave, padding skipped
            next_BCW = _kept_window(qkv_BTC, window_BCW, mask_BT != 0)
        y_BTC = jax.nn.silu(y_BTC).astype(self.dtype)
        NK = s.n_key_heads * s.key_dim
        q_BTNK = y_BTC[..., :NK].reshape(B, T, s.n_key_heads, s.key_dim)
        k_BTNK = y_BTC[..., NK : 2 * NK].reshape(B, T, s.n_key_heads, s.key_dim)
        v_BTHV = y_BTC[..., 2 * NK :].reshape(B, T, s.n_value_heads, s.value_dim)
        q_BTNK = l2_normalize(q_BTNK) * s.key_dim**-0.5
        k_BTNK = l2_normalize(k_BTNK)
        beta_BTH = jax.nn.sigmoid(self._project(x_BTD, "wb", "btd,dh->bth"))
        a_BTH = self._project(x_BTD, "wa", "btd,dh->bth")
        a_BTH = a_BTH.astype(_rule_dtype(a_BTH))
        g_BTH = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a_BTH + self.dt_bias[...])
        if segments_BT is not None:
            g_BTH = jnp.where(document_starts(segments_BT)[..., None], RESET_G, g_BTH)
        if mask_BT is not None:  # padding neither decays nor writes the state
            keep_BT1 = (mask_BT != 0)[..., None]
            g_BTH, beta_BTH = jnp.where(keep_BT1, g_BTH, 0.0), jnp.where(keep_BT1, beta_BTH, 0.0)
        z_BTHV = self._project(x_BTD, "wz", "btd,dhv->bthv")
        return (q_BTNK, k_BTNK, v_BTHV, g_BTH, beta_BTH), z_BTHV, next_BCW

    def _out(self, o_BTHV, z_BTHV) -> jax.Array:
        y_BTHV = gated_rms_norm(o_BTHV, z_BTHV, self.norm_scale[...], self.sizes.eps, self.dtype)
        return self._project(y_BTHV, "wo", "bthv,hvd->btd")

    def __call__(self, x_BTD: jax.Array, mask_BT=None, segments_BT=None) -> jax.Array:
        """The training form: the sequence from a zero state, in chunks. `segments_BT`:
        packed rows' document ids (0: padding, masked), each document on its own."""
        if segments_BT is not None:
            valid_BT = segments_BT != 0
            mask_BT = valid_BT if mask_BT is None else valid_BT & (mask_BT != 0)
        return self.prefill(x_BTD, None, mask_BT, segments_BT)[0]

    @scoped(ATTENTION)  # the layer stands in for attention: profiles count it there
    def prefill(self, x_BTD, state: GDNState | None = None, mask_BT=None, segments_BT=None):
        """The chunked form from `state` (None: a sequence's start): the outputs and the state
        after the call's last real token (`mask_BT`: 0 marks padding, on either side)."""
        window_BCW, S_BHKV = (None, None) if state is None else state
        rule_in, z_BTHV, window_BCW = self._streams(x_BTD, window_BCW, mask_BT, segments_BT)
        o_BTHV, S_BHKV = chunked_rule(*rule_in, S_BHKV)
        return self._out(o_BTHV, z_BTHV), GDNState(window_BCW, S_BHKV)

    @scoped(ATTENTION)
    def step(self, x_BD: jax.Array, state: GDNState) -> tuple[jax.Array, GDNState]:
        """One decoded token per row, by the recurrence."""
        rule_in, z_BTHV, window_BCW = self._streams(x_BD[:, None], state.conv_BCW, None)
        o_BTHV, S_BHKV = recurrent_rule(*rule_in, state.rule_BHKV)
        return self._out(o_BTHV, z_BTHV)[:, 0], GDNState(window_BCW, S_BHKV)

    def init_state(self, batch: int) -> GDNState:
        """A sequence's start: an empty window and a zero state."""
        s = self.sizes
        return GDNState(
            jnp.zeros((batch, s.conv_channels, s.conv_kernel - 1), self.dtype),
            jnp.zeros((batch, s.n_value_heads, s.key_dim, s.value_dim), _rule_dtype(self.dtype)),
        )


# ----------------------------------------------------------------------- transformers' weights

# The input projections of each transformers layout: (weight, the streams it stacks, whether
# its rows are grouped by key head). Qwen3-Next fuses them, each key head's rows together
# (q, k, then its G value heads' v and z; its G b's then its G a's); Qwen3.5 keeps one per
# stream, heads in order. Both are read by the same split (`_unstack`) and written back by the
# same concatenation (`to_hf`).
HF_INPUTS = {
    "qwen3_next": (("in_proj_qkvz", "qkvz", True), ("in_proj_ba", "ba", True)),
    "qwen3_5_moe": (
        ("in_proj_qkv", "qkv", False),
        ("in_proj_z", "z", False),
        ("in_proj_b", "b", False),
        ("in_proj_a", "a", False),
    ),
}


def hf_layout(tensors: dict) -> str:
    """Which layout a layer's transformers weights (names without the layer's prefix) are in."""
    return "qwen3_next" if "in_proj_qkvz.weight" in tensors else "qwen3_5_moe"


def _unstack(w_OD: np.ndarray, streams: str, groups: int, s: GDNSizes) -> dict:
    """Split a stacked torch projection [out, D] into our weights [D, heads..., width]."""
    N, H, K, V = s.n_key_heads, s.n_value_heads, s.key_dim, s.value_dim
    shapes = {"q": (N, K), "k": (N, K), "v": (H, V), "z": (H, V), "b": (H,), "a": (H,)}
    widths = [int(np.prod(shapes[c])) // groups for c in streams]
    pieces = np.split(w_OD.reshape(groups, -1, w_OD.shape[-1]), np.cumsum(widths)[:-1], axis=1)
    return {
        f"w{c}": piece.reshape(-1, w_OD.shape[-1]).T.reshape(w_OD.shape[-1], *shapes[c])
        for c, piece in zip(streams, pieces, strict=True)
    }


def split_projection(w_OD, streams: str, grouped: bool, sizes: GDNSizes) -> dict:
    """One stacked transformers projection (an `HF_INPUTS` entry's weight [out, D]) as our
    weights of its `streams` (`{"wq": [D, N, K], ...}`)."""
    groups = sizes.n_key_heads if grouped else 1
    return _unstack(np.asarray(w_OD), streams, groups, sizes)


def join_projection(weights: dict, streams: str, grouped: bool, sizes: GDNSizes) -> np.ndarray:
    """The inverse of `split_projection`: the stacked [out, D] weight of our `streams`."""
    D = sizes.d_model
    groups = sizes.n_key_heads if grouped else 1
    rows = [np.asarray(weights[f"w{c}"]).reshape(D, -1).T for c in streams]
    return np.concatenate([r.reshape(groups, -1, D) for r in rows], axis=1).reshape(-1, D)


def from_hf(tensors: dict, sizes: GDNSizes) -> dict[str, np.ndarray]:
    """Our weights (by attribute name) from one transformers linear-attention layer's
    (`{"in_proj_qkvz.weight": ..., "conv1d.weight": ...}`, numpy), either layout."""
    out = {}
    for name, streams, grouped in HF_INPUTS[hf_layout(tensors)]:
        out |= split_projection(tensors[f"{name}.weight"], streams, grouped, sizes)
    H, V = sizes.n_value_heads, sizes.value_dim
    out["conv"] = np.asarray(tensors["conv1d.weight"])[:, 0, :]  # [C, 1, W]: depthwise
    out["dt_bias"] = np.asarray(tensors["dt_bias"])
    out["A_log"] = np.asarray(tensors["A_log"])
    out["norm_scale"] = np.asarray(tensors["norm.weight"])
    out["wo"] = np.asarray(tensors["out_proj.weight"]).T.reshape(H, V, -1)
    return out


def to_hf(weights: dict, sizes: GDNSizes, layout: str) -> dict[str, np.ndarray]:
    """transformers' tensors for `layout` from our weights (by attribute name, numpy): the
    inverse of `from_hf`, each stacked projection put back together by key-head group."""
    D = sizes.d_model
    out = {}
    for name, streams, grouped in HF_INPUTS[layout]:
        out[f"{name}.weight"] = join_projection(weights, streams, grouped, sizes)
    out["conv1d.weight"] = np.asarray(weights["conv"])[:, None, :]
    out["dt_bias"] = np.asarray(weights["dt_bias"])
    out["A_log"] = np.asarray(weights["A_log"])
    out["norm.weight"] = np.asarray(weights["norm_scale"])
    out["out_proj.weight"] = np.asarray(weights["wo"]).reshape(-1, D).T
    return out


def load_hf(layer: GatedDeltaNet, tensors: dict) -> None:
    """Set `layer`'s weights from transformers' (`from_hf`), checking every shape."""
    for name, value in from_hf(tensors, layer.sizes).items():
        v = getattr(layer, name)
        if v[...].shape != value.shape:
            raise ValueError(f"{name}: transformers' {value.shape}, the layer's {v[...].shape}")
        v[...] = jnp.asarray(value, v[...].dtype)
