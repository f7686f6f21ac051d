"""The engine's compiled programs: one model call over the paged KV cache, then one token per
row sampled by that row's own rule.

    progs = Programs(sampler, n_pages=256, page_size=16)
    tokens_B = progs.run(batch, mode)        # batch: a `Batch` of host arrays; pages updated

Sliding-window layers shorter than the context (`is_ring`) keep their keys in a pool of their
own, read through a second table (`Batch.window_BM`): the engine releases a slot's window
pages once behind its window, so those layers hold about window + chunk positions per slot.

A hybrid stack's linear layers (attention.linear) hold no pages: each keeps a pool of
fixed-size recurrent states ({"conv": [S, C, W - 1], "state": [S, H, K, V]}: `linear_attention`'s
cache, pool rows for batch rows), a row per engine slot and then the prefix cache's snapshots
(`snapshots.py`). A call reads each row's state from the row `Batch.from_B` names (its slot;
a snapshot, when it starts past a restored prefix; none, zeros, when it starts at position
0), runs the layer's chunked form (prefill) or its recurrence (decode) from it, and writes
the new state to the row's slot and, where `Batch.snap_B` names one, a snapshot row; padding
rows read zeros and write nowhere.

Two shapes run: a prefill chunk ([1, chunk] tokens of one slot) and a decode step ([slots, 1]:
every slot's last token). The page table is cut to a power-of-two number of pages (the
longest row's), so attention reads about the rows' actual lengths, not the whole context; a
program is compiled per (tokens shape, table width, sampling mode): a few, whatever the
requests. The weights, the graph and the capacity-free MoE are the sampler's
(`moe_jax.inference.sampling.Sampler`), so the engine computes what `sample.py` computes.

Sampling per row (`pick`): greedy rows take the argmax; sampled rows with neither top-k nor
top-p draw from the tempered logits, filtered rows through `draws.sample_tokens`'s
sorted path, each exactly as `Sampler.generate` draws that request alone (row key
fold_in(seed, r), folded with the step), so a request's text does not depend on the other
requests in flight. The static mode only skips work no row needs (all greedy; no filter).
"""

from __future__ import annotations

import contextlib
import functools
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.inference.decoding import Weights, model_of, stack_blocks, unstack_blocks
from moe_jax.inference.next_token import Mode, in_vocab, sample_tokens


class Batch(NamedTuple):
    """One call's rows (host arrays; B rows of T tokens)."""

    table_BM: np.ndarray  # int32: each row's pages in position order
    window_BM: np.ndarray  # int32: the same for the sliding-window layers' pool (module doc)
    tokens_BT: np.ndarray  # int32
    positions_BT: np.ndarray  # int32, -1: padding (written nowhere)
    last_B: np.ndarray  # int32: the index in T whose logits pick the row's token
    keys_B2: np.ndarray  # uint32: each row's key data (fold_in(key(seed), r))
    step_B: np.ndarray  # int32: the index of the token being picked in the row's output
    temperature_B: np.ndarray  # float32, 0: greedy
    top_k_B: np.ndarray  # int32, >= V: off
    top_p_B: np.ndarray  # float32, > 1: off
    n_vocab: np.ndarray  # int32 scalar: sample ids below it only
    # int32, linear layers' state pools (module doc); out of range: none. The row the state
    # is read from (the slot, a snapshot; none: zeros), the slot it is written to, and a
    # snapshot row it is kept in too.
    from_B: np.ndarray
    slot_B: np.ndarray
    snap_B: np.ndarray


# Alternatives returned with each picked token's log-probability (OpenAI's completions take
# up to 5): always computed, a top-k of the vocabulary per row, so no program varies with it.
TOP_LOGPROBS = 5


class Picked(NamedTuple):
    """A call's picks per row (host arrays): the token, its log-probability under the model
    (before temperature and filters, as OpenAI and vLLM report it), the most likely tokens;
    recording (`PickMode.record`), every fed token's experts and the picked token's
    log-probability at the row's temperature (`tempered_logprobs`)."""

    tokens_B: np.ndarray
    logprob_B: np.ndarray
    top_ids_BK: np.ndarray
    top_logprobs_BK: np.ndarray
    routes_LBTK: np.ndarray | None = None  # int32 [n_moe_layers, B, T, top_k]
    tempered_B: np.ndarray | None = None  # float32


class PickMode(NamedTuple):
    """Static: which sampling code the call compiles."""

    all_greedy: bool
    any_filter: bool
    record: bool = False  # the call returns its experts and tempered log-probs too


def pick(logits_BV, b: Batch, mode: PickMode) -> jax.Array:
    """Each row's token by its own rule (module doc)."""
    logits_BV = in_vocab(logits_BV, b.n_vocab)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if mode.all_greedy:
        return greedy_B
    keys_B = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(b.keys_B2), b.step_B)
    is_greedy_B = b.temperature_B == 0
    temperature_B1 = jnp.where(is_greedy_B, 1.0, b.temperature_B)[:, None]
    plain_B = jax.vmap(jax.random.categorical)(keys_B, logits_BV / temperature_B1)
    tok_B = plain_B.astype(jnp.int32)
    if mode.any_filter:
        filters = (b.top_k_B[:, None], b.top_p_B[:, None])
        filtered_B = sample_tokens(
            logits_BV, keys_B, temperature_B1, *filters, Mode(False, True, True)
        )
        is_filtered_B = (b.top_k_B < logits_BV.shape[-1]) | (b.top_p_B <= 1)
        tok_B = jnp.where(is_filtered_B, filtered_B, tok_B)
    return jnp.where(is_greedy_B, greedy_B, tok_B)


def is_ring(cfg, layer: int) -> bool:
    """Whether `layer` attends within a window shorter than the context: its keys live in the
    window pool, whose pages are released once behind every future query's window."""
    window = cfg.attention.sliding_window
    return cfg.uses_window(layer) and 0 < window < cfg.model.max_seq_len


def layer_numbers(cfg, n_blocks: int, n_tail: int) -> dict:
    """The layer number of each cache entry, in the cache's layout with the blocks apart:
    {"blocks": [[block b's layers]], "tail": [...], "prefix": [...]} (as `init_cache`)."""
    P, k = cfg.layer_period, cfg.prefix_layers
    out = {
        "blocks": [[k + b * P + j for j in range(P)] for b in range(n_blocks)],
        "tail": [k + n_blocks * P + j for j in range(n_tail)],
    }
    return out | ({"prefix": list(range(k))} if k else {})


def _slot_rows(pool: dict, b: Batch) -> dict:
    """A linear layer's rows from its state pool (module doc): zeros where `from_B` is out of
    range."""
    return {n: jnp.take(a, b.from_B, axis=0, mode="fill", fill_value=0) for n, a in pool.items()}


def _into_slots(pool: dict, rows: dict, b: Batch) -> dict:
    """The pool with each row's new state in its slot and its snapshot row (out of range:
    dropped)."""
    put = lambda a, at, new: a.at[at].set(new.astype(a.dtype), mode="drop")
    return {n: put(put(a, b.slot_B, rows[n]), b.snap_B, rows[n]) for n, a in pool.items()}


def _is_layer(tree) -> bool:
    return isinstance(tree, dict) and not {"k", "latent", "state"}.isdisjoint(tree)


def _with_tables(pages: dict, cfg, b: Batch) -> dict:
    """Every layer's pages with its page table beside them (the window pool's for ring
    layers), each block's before the blocks are stacked; a linear layer's rows of its state
    pool instead (`_slot_rows`)."""
    n_tail = len(pages["tail"])
    numbers = layer_numbers(cfg, len(pages["blocks"]), n_tail)
    table = lambda n: b.window_BM if is_ring(cfg, n) else b.table_BM
    put = lambda d, n: _slot_rows(d, b) if "state" in d else d | {"table": table(n)}
    out = {
        name: [put(d, n) for d, n in zip(pages[name], numbers[name], strict=True)]
        for name in ("tail", "prefix")
        if name in pages
    }
    blocks = zip(pages["blocks"], numbers["blocks"], strict=True)
    out["blocks"] = [[put(d, n) for d, n in zip(ds, ns, strict=True)] for ds, ns in blocks]
    return out


def _without_table(cache):
    if isinstance(cache, dict):
        return {k: _without_table(v) for k, v in cache.items() if k != "table"}
    return [_without_table(c) for c in cache] if isinstance(cache, list) else cache


def forward_pages(model, n_blocks: int, pages: dict, b: Batch, *, with_aux=False, **kw):
    """The model over the pages (blocks kept apart, as `decoding` keeps them) -> (its first
    output, the updated pages), and with `with_aux` the model's aux (its "routes": the
    experts each token took); `kw`: the model's `logits_at` or `head`."""
    # The tables join each block's layers before they are stacked: the model slices every
    # leaf of the stacked blocks by block.
    paged = _with_tables(pages, model.cfg, b)
    paged["blocks"] = stack_blocks(paged["blocks"])
    out, aux, new = model(b.tokens_BT, positions=b.positions_BT, cache=paged, **kw)
    new = _without_table(new)
    new["blocks"] = unstack_blocks(new["blocks"], n_blocks)
    put = lambda old, d: _into_slots(old, d, b) if "state" in old else d
    new = jax.tree.map(put, pages, new, is_leaf=_is_layer)
    return (out, new, aux) if with_aux else (out, new)


def token_logprobs(logits_XV, tokens_X, n_vocab):
    """The picked tokens' log-probabilities under the model [X] (before temperature and
    filters) and the TOP_LOGPROBS likeliest (ids, log-probabilities) [X, TOP_LOGPROBS], for
    logits of any leading shape X."""
    logprobs_XV = jax.nn.log_softmax(in_vocab(logits_XV, n_vocab), axis=-1)
    top_lp_XK, top_ids_XK = jax.lax.top_k(logprobs_XV, TOP_LOGPROBS)
    picked_X = jnp.take_along_axis(logprobs_XV, tokens_X[..., None], axis=-1)[..., 0]
    return picked_X, top_ids_XK, top_lp_XK


def tempered_logprobs(logits_BV, tokens_B, temperature_B):
    """log p(token) under the logits at the row's temperature (1 for greedy rows), over the
    whole vocabulary: `Sampler.generate(record=True)`'s log-probs, what a trainer recomputes
    (`moe_jax.posttrain.rl.rollouts.token_logps`)."""
    t_B1 = jnp.where(temperature_B == 0, 1.0, temperature_B)[:, None]
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32) / t_B1, axis=-1)
    return jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]


def _call(graphdef, weights: Weights, pages: dict, b: Batch, *, mode: PickMode):
    """The model over the pages -> (tokens [B], their log-probabilities, the top ones, and
    recording, the routes and tempered log-probs; the updated pages)."""
    model = model_of(graphdef, weights.params, weights.blocks)
    n_blocks = len(weights.blocks)
    logits_B1V, new, aux = forward_pages(
        model, n_blocks, pages, b, with_aux=True, logits_at=b.last_B
    )
    logits_BV = logits_B1V[:, 0]
    tokens_B = pick(logits_BV, b, mode)
    picked = (tokens_B, *token_logprobs(logits_BV, tokens_B, b.n_vocab))
    if mode.record:
        picked += (aux["routes"], tempered_logprobs(logits_BV, tokens_B, b.temperature_B))
    return picked, new


def init_pages(
    model,
    n_pages: int,
    n_window_pages: int,
    page_size: int,
    mesh=None,
    mtp_depth: int = 0,
    n_slots: int = 1,
) -> dict:
    """Zeroed page pools, one per layer, in the model's cache layout (`init_cache`) with its
    layer blocks kept apart: {"k", "v"} [N, PS, K, hd] (MLA: {"latent"} [N, PS, 1, L]); ring
    layers' (`is_ring`) of `n_window_pages`; linear layers' state pools of `n_slots` (module
    doc); with `mtp_depth`, "mtp": the first MTP layers' (speculative decoding, `drafting`).
    Under a mesh the kv heads split over `tensor` where they divide, pages whole; the states
    are replicated."""
    max_len = model.cfg.model.max_seq_len
    shapes = jax.eval_shape(lambda: model.init_cache(1, max_len, mtp=mtp_depth > 0))

    def states(d):  # [*lead, 1, ...] per row -> [*lead, n_slots, ...]
        out = {}
        for n, a in d.items():
            row = a.ndim - (3 if n == "state" else 2) - 1  # the batch axis
            zeros = jnp.zeros((*a.shape[:row], n_slots, *a.shape[row + 1 :]), a.dtype)
            out[n] = zeros if mesh is None else jax.device_put(zeros, NamedSharding(mesh, P()))
        return out

    def layer(d):
        if "state" in d:
            return states(d)
        names = ("latent",) if "latent" in d else ("k", "v")
        N = n_window_pages if "pos" in d else n_pages  # "pos": init_cache's ring
        out = {}
        for n in names:
            *lead, _, _, K, hd = d[n].shape
            spec = P(*(None,) * (len(lead) + 2), _heads_axis(mesh, K), None)
            zeros = jnp.zeros((*lead, N, page_size, K, hd), d[n].dtype)
            out[n] = zeros if mesh is None else jax.device_put(zeros, NamedSharding(mesh, spec))
        return out

    pages = {k: [layer(d) for d in ds] for k, ds in shapes.items()}
    if mtp_depth:
        pages["mtp"] = pages["mtp"][:mtp_depth]
    pages["blocks"] = unstack_blocks(pages["blocks"], model.n_blocks) if model.n_blocks else []
    return pages


def _heads_axis(mesh, K: int):
    if mesh is None or "tensor" not in mesh.shape or K % mesh.shape["tensor"]:
        return None
    return "tensor"


# The narrowest page table a call takes: fewer widths, fewer compiles (a few pages of extra
# keys cost a short sequence little).
MIN_TABLE_PAGES = 4
# From this many pages on, widths of 3 * 2**k as well as 2**k: every row's keys are gathered
# to the table's width, and on CPU a 64-row decode step of the small benchmark model took 43
# ms at 32 pages against 34 at 16 (rows of 20 pages paid for 32).
THREE_QUARTER_PAGES = 12


def table_width(n_pages_B: np.ndarray, limit: int) -> int:
    """Pages the table is cut to: the longest row's, rounded up to a power of two (at least
    MIN_TABLE_PAGES) or, from THREE_QUARTER_PAGES on, to three quarters of one; at most
    `limit`."""
    longest = max(MIN_TABLE_PAGES, int(np.max(n_pages_B, initial=1)))
    width = 1 << math.ceil(math.log2(longest))
    if longest <= width * 3 // 4 and width * 3 // 4 >= THREE_QUARTER_PAGES:
        width = width * 3 // 4
    return min(limit, width)


@functools.lru_cache(maxsize=8)
def _jitted(graphdef):
    """The jitted call for one graph, shared by the engines of one model (their compiles
    too); the graph is bound, not hashed at every call."""
    return jax.jit(partial(_call, graphdef), static_argnames="mode", donate_argnames="pages")


class Programs:
    """The sampler's weights, the page pools, and the jitted call (one per shape and mode)."""

    def __init__(
        self,
        sampler,
        n_pages: int,
        n_window_pages: int,
        page_size: int,
        mtp_depth: int = 0,
        n_slots: int = 1,
    ):
        """`mtp_depth`: pools for the first MTP layers too (`draft_programs`); `n_slots`: the
        linear layers' state rows (the engine's slots, then its snapshots)."""
        self.sampler = sampler
        self.mesh = sampler.mesh
        self.weights = Weights(sampler.params, sampler.param_blocks)
        model = sampler.inference_model()
        sizes = (n_pages, n_window_pages, page_size, self.mesh, mtp_depth, n_slots)
        with self._on_mesh():
            self.pages = init_pages(model, *sizes)
        numbers = layer_numbers(model.cfg, model.n_blocks, len(model.tail))
        flat = [n for ns in numbers["blocks"] for n in ns] + numbers["tail"]
        self.has_rings = any(is_ring(model.cfg, n) for n in flat + numbers.get("prefix", []))
        self.has_states = model.cfg.attention.linear != "none"  # linear layers' state rows
        self._jitted = _jitted(sampler.graphdef)
        self.shapes: set[tuple] = set()  # (tokens shape, table widths, mode) run so far

    def _on_mesh(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def run(self, batch: Batch, mode: PickMode) -> Picked:
        """One call: the pages updated in place (donated), the rows' tokens back on the host."""
        widths = (batch.table_BM.shape[1], batch.window_BM.shape[1])
        self.shapes.add((batch.tokens_BT.shape, widths, mode))
        if self.mesh is not None:  # rows and rules replicated over the mesh
            batch = jax.device_put(batch, NamedSharding(self.mesh, P()))
        with self._on_mesh():
            picked, self.pages = self._jitted(self.weights, self.pages, batch, mode=mode)
        return Picked(*(np.asarray(a) for a in picked))
