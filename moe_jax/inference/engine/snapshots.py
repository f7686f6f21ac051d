"""Prefix caching on hybrid stacks (attention.linear): the state snapshots, on the host.

A shared prefix's pages hold its full layers' keys and values, but its linear layers' state
is rebuilt from no page. So the engine keeps the state at page boundaries of prompts, each in
a row of the state pools past the slots' (`programs` module doc), known by the chained hash
of the prefix's pages (`pages.page_hashes`). A request whose prompt's first n full pages are
found takes the first m <= n of them whose state is kept and starts from that state; the
pages past m go back.

    snaps = Snapshots(n_rows=8, first_row=4, page_size=16)
    m, row = snaps.find(tokens, n_found)         # restore m pages' state from `row` (m > 0)
    end = snaps.boundary(prompt, done, end)      # a chunk stops at the prompt's last page
    row = snaps.target(prompt, end)              # keep the state at `end` there (-1: none)

A state is kept where a prefill chunk ends on a page boundary within the prompt: chunks of a
multiple of the page size end on them, and a prompt's chunk stops at its last full page
before its last token (`boundary`; one call more for that prompt), the longest prefix a
request with the same prompt can find (`PagePool.match_prefix` leaves one token). A row
someone admitted is about to read is pinned until its first prefill call has read it; a new
state takes a free row, else the least recently used unpinned one.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from moe_jax.inference.engine.pages import page_hashes


class Snapshots:
    def __init__(self, n_rows: int, first_row: int, page_size: int):
        """Rows `first_row` .. `first_row + n_rows - 1` of the state pools."""
        self.page_size = page_size
        self.free = list(range(first_row + n_rows - 1, first_row - 1, -1))
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # hash -> row, least recent first
        self.pins: Counter[int] = Counter()  # row -> requests admitted to read it

    def find(self, tokens: Sequence[int], n_found: int) -> tuple[int, int]:
        """The most of `tokens`' `n_found` findable full pages whose state is kept, and its
        row: (m, row), or (0, -1)."""
        hashes = page_hashes(tokens, self.page_size, n_found)
        for m in range(n_found, 0, -1):
            if (row := self.rows.get(hashes[m - 1])) is not None:
                self.rows.move_to_end(hashes[m - 1])
                return m, row
        return 0, -1

    def pin(self, row: int) -> None:
        self.pins[row] += 1

    def unpin(self, row: int) -> None:
        self.pins[row] -= 1
        assert self.pins[row] >= 0, f"snapshot row {row} unpinned more often than pinned"

    def boundary(self, prompt: Sequence[int], done: int, end: int) -> int:
        """A chunk from `done` to `end`, stopped at the prompt's last full page boundary
        before its last token if it would pass it."""
        last = (len(prompt) - 1) // self.page_size * self.page_size
        return last if done < last < end else end

    def target(self, prompt: Sequence[int], end: int) -> int:
        """The row to keep the state after `end` positions of `prompt` in: a page boundary
        within the prompt not kept yet, with a row to give; else -1."""
        PS = self.page_size
        if end == 0 or end % PS or end > len(prompt):
            return -1
        h = page_hashes(prompt, PS, end // PS)[-1]
        if h in self.rows:
            self.rows.move_to_end(h)
            return -1
        if self.free:
            row = self.free.pop()
        else:
            old = next((k for k, r in self.rows.items() if not self.pins[r]), None)
            if old is None:
                return -1
            row = self.rows.pop(old)
        self.rows[h] = row
        return row
