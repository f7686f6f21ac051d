"""A paged KV cache (the generation engine's, `inference.engine`): one pool of fixed-size pages
per layer, shared by every decode slot, and a page table per slot naming the pages that hold
its positions, so a sequence holds pages for its actual length rather than for the whole
context, and pages of a common prompt prefix can be shared between slots.

A layer's paged cache is {"k": [N, PS, K, hd], "v": ..., "table": [B, M]} (MLA: {"latent":
[N, PS, 1, L], "table"}): N pages of PS positions; slot b's position p lies in page
table[b, p // PS] at offset p % PS. attention.py and mla.py take it where they take the
contiguous cache: the call's keys are written at their positions, then each slot's pages are
gathered in table order into [B, M * PS, K, hd], whose slot s holds position s. Masking by
position then works as for the contiguous cache: table entries past a slot's length (any
page, e.g. one another slot owns) and stale offsets of its last page sit at positions after
every query, so no query sees them. A negative position (padding) is written nowhere.

A sliding-window layer reads its pages the same way, the window being the mask's; the engine
gives such layers a pool and table of their own and releases each page once it lies behind
every later query's window (a ring of pages): a released entry may then name a page another
slot has rewritten, at gathered positions the window masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.model.kv_cache import KVCache


def is_paged(cache: KVCache | None) -> bool:
    return cache is not None and "table" in cache


def write_pages(pages_NPKD, table_BM, new_BTKD, positions_BT) -> jax.Array:
    """The pool with each token's k or v at its position's page and offset (padding: none)."""
    N, PS = pages_NPKD.shape[:2]
    page_BT = jnp.take_along_axis(table_BM, jnp.maximum(positions_BT, 0) // PS, axis=1)
    page_BT = jnp.where(positions_BT >= 0, page_BT, N)  # N: out of range, dropped
    offset_BT = jnp.maximum(positions_BT, 0) % PS
    new = new_BTKD.astype(pages_NPKD.dtype)
    return pages_NPKD.at[page_BT, offset_BT].set(new, mode="drop")


def read_pages(pages_NPKD, table_BM) -> jax.Array:
    """Each slot's pages in table order: [B, M * PS, K, hd], slot s holding position s."""
    B, M = table_BM.shape
    gathered_BMPKD = pages_NPKD[table_BM]
    return gathered_BMPKD.reshape(B, M * pages_NPKD.shape[1], *pages_NPKD.shape[2:])


def key_positions(table_BM, page_size: int, dtype) -> jax.Array:
    """[B, M * PS]: the position each gathered key slot holds."""
    B, M = table_BM.shape
    return jnp.broadcast_to(jnp.arange(M * page_size, dtype=dtype), (B, M * page_size))


def paged_keys(cache: KVCache, new: dict[str, jax.Array], positions_BT):
    """Write `new` ({"k": .., "v": ..} or {"latent": ..}, [B, T, K, hd] each) into the pages
    -> (the gathered keys per name [B, S, K, hd], their positions [B, S], the new cache)."""
    table_BM = cache["table"]
    updated = {n: write_pages(cache[n], table_BM, a, positions_BT) for n, a in new.items()}
    gathered = {n: read_pages(p, table_BM) for n, p in updated.items()}
    PS = next(iter(updated.values())).shape[1]
    k_pos_BS = key_positions(table_BM, PS, positions_BT.dtype)
    return gathered, k_pos_BS, updated | {"table": table_BM}
