"""The page pool's bookkeeping, on the host: which pages are free, who holds each (a reference
count), and the prefix cache.

Prefix caching: a full page of prompt tokens is known by a hash of its tokens chained with
the hash of every page before it, so equal hashes mean equal whole prefixes (sha256: no
collision to guard). A new request takes the pages of its longest known prefix of full pages
instead of computing them (their count goes up; they are never written again: a request
writes only positions past its shared prefix, which lie in its own pages). A page whose count
falls to 0 keeps its hash and stays findable until the pool needs it (least recently freed
first), so a prompt seen before is found again while there is room.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def page_hashes(tokens: Sequence[int], page_size: int, n_pages: int) -> list[bytes]:
    """The chained hashes of the first `n_pages` full pages of `tokens`."""
    hashes, parent = [], b""
    for i in range(n_pages):
        chunk = np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)
    return hashes


class PagePool:
    def __init__(self, n_pages: int, page_size: int):
        self.n_pages, self.page_size = n_pages, page_size
        self.refs = np.zeros(n_pages, np.int32)
        self.free = list(range(n_pages - 1, -1, -1))  # never hashed (pop() takes page 0 first)
        self.cached: OrderedDict[int, None] = OrderedDict()  # hashed, count 0: oldest first
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}

    def available(self) -> int:
        """Pages an allocation may take (free, or cached and unreferenced)."""
        return len(self.free) + len(self.cached)

    def in_use(self) -> int:
        return int(np.sum(self.refs > 0))

    def allocate(self, n: int) -> list[int] | None:
        """n pages for one holder (count 1 each), or None (nothing taken) if too few."""
        if n > self.available():
            return None
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:  # the least recently freed cached page gives up its prefix
                page, _ = self.cached.popitem(last=False)
                del self.by_hash[self.hash_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released more often than held"
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Pages of the longest known prefix of full pages of `tokens`, held (count + 1). At
        least one token is left over: a request's last prompt token must run for its logits."""
        pages = []
        for h in page_hashes(tokens, self.page_size, (len(tokens) - 1) // self.page_size):
            page = self.by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.refs[page] == 0:
                del self.cached[page]
            self.refs[page] += 1
        return pages

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Make the full pages of `tokens` (held in `pages`, in order) findable by prefix;
        -> the indices in `pages` of those newly findable."""
        n = min(len(tokens) // self.page_size, len(pages))
        new, hashes = [], page_hashes(tokens, self.page_size, n)
        for i, (h, page) in enumerate(zip(hashes, pages, strict=False)):
            if h not in self.by_hash and page not in self.hash_of:
                self.by_hash[h], self.hash_of[page] = page, h
                new.append(i)
        return new
