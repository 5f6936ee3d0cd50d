"""Full KV blocks by content, so a prompt that repeats a cached prefix reuses its pages.

A block's key is a hash chain: ``sha256(parent key, the block's token ids)``, seeded by a
*namespace* that names everything the K/V depend on besides the tokens: the base checkpoint and
the adapter registration (the base alone for base-model requests), and who may share them: the
tenant, or the prefix group its operator put it in (a hit is a faster first token, which would
tell one tenant what another sent). Two adapters, two registrations of one adapter name, an
adapter and the base, or two tenants outside one group therefore never share a block, even for
identical tokens. Only full blocks are cached, and a sequence only ever writes past the
blocks it matched, so a shared page is never written again (no copy-on-write).

Pages stay in the pool as KV pages. A cached page is *in use* while sequences hold it (a
refcount) and *idle* once none does: idle pages keep their K/V for the next hit and are given
back under memory pressure, lowest use rate first, in one ranking with idle adapters
(:class:`lorapage.memory.reclaim.Reclaim`: rate x recompute cost per page).

A block's use rate is a decayed count of the requests that used it, as an adapter's is: the one
that computed it counts once (so a never-hit block's rate is ``2^(-age / half-life)``: a fresh
conversation turn's blocks are worth keeping for its next turn, old ones are not) and each
:meth:`PrefixCache.match` hit adds one. The rate is stored as a *score*, ``log2(rate at t) +
t / half-life``, which orders blocks the same way at every later time; a block's score changes
only when it is used, and a used block is held, not idle, so the idle blocks sit in a heap in
the order they leave. A child block is useless without its parent (a match walks the chain from
the root), so a child's score is capped at its parent's, and among equals the deepest goes first.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import struct
import time
from collections.abc import Callable

from lorapage.memory.pages import PageAllocator, PageKind
from lorapage.memory.reclaim import RATE_HALF_LIFE_S

HIT_HALF_LIFE_S = RATE_HALF_LIFE_S  # how fast a block's use rate forgets: as an adapter's (one currency)


def block_keys(namespace: bytes, token_ids: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of ``token_ids``, which continue the block whose key is
    ``parent`` (empty: they are a sequence's first blocks, chained to ``namespace``)."""
    keys = []
    prev = parent or hashlib.sha256(namespace).digest()
    for b in range(len(token_ids) // block_size):
        block = token_ids[b * block_size : (b + 1) * block_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(block)}q", *block)).digest()
        keys.append(prev)
    return keys


# An idle page's place in line: (score, -depth, sequence number, page). The lowest goes first:
# the least used, then the deepest in its chain, then the longest idle.
_Entry = tuple[float, int, int, int]


class PrefixCache:
    """Which pool pages hold which full blocks, who holds them, how often they are used, and
    which are idle (in the order they are given back)."""

    def __init__(self, pool: PageAllocator, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self._clock = clock
        self._page: dict[bytes, int] = {}  # block key -> page holding its K/V
        self._key: dict[int, bytes] = {}  # page -> its block key (cached pages only)
        self._refs: dict[int, int] = {}  # cached page -> sequences whose block table holds it
        self._score: dict[int, float] = {}  # cached page -> log2(use rate at t) + t / HIT_HALF_LIFE_S
        self._idle: dict[int, _Entry] = {}  # cached pages nobody holds -> their live heap entry
        self._heap: list[_Entry] = []  # idle pages' entries, plus stale ones of pages held again
        self._seq = 0  # entries made so far: the last tie-break (longest idle first)
        self.evicted = 0  # idle blocks given back to the pool, in all

    @property
    def num_cached(self) -> int:
        return len(self._key)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def match(self, keys: list[bytes], count: bool = True) -> list[int]:
        """Pages of the longest cached prefix of ``keys``, now held by the caller (refcounted);
        each counts a use unless ``count`` is False (the caller may not use them: it calls
        :meth:`count_uses` once it does)."""
        pages: list[int] = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._hold(page)
        if count:
            self.count_uses(pages)
        return pages

    def count_uses(self, pages: list[int]) -> None:
        """A request used these cached pages now (they are in its block table)."""
        x = self._clock() / HIT_HALF_LIFE_S
        for page in pages:
            # Adds one to the decayed count: the score of ``2^(score - x) + 1`` at time x.
            self._score[page] = x + math.log2(1.0 + math.exp2(self._score[page] - x))

    def offer(self, key: bytes, page: int) -> None:
        """``page`` (held by one sequence) now holds the full block ``key``: cache it, unless
        another page holds that block already (then ``page`` stays the sequence's own). The
        sequence that computed it counts as its first use."""
        if key in self._page or page in self._key:
            return
        self._page[key], self._key[page], self._refs[page] = page, key, 1
        self._score[page] = self._clock() / HIT_HALF_LIFE_S

    def release(self, block_table: list[int], first_depth: int = 0) -> None:
        """A sequence gives its blocks back: cached pages lose a holder (idle at none), the rest
        return to the pool; entries of 0 (blocks freed already) are skipped. ``block_table`` may
        be a slice starting at block ``first_depth``. Empties ``block_table``."""
        own: list[int] = []
        parent: int | None = None  # the previous block's page, when it is cached
        for depth, page in enumerate(block_table, first_depth):
            if page == 0:
                parent = None
                continue
            refs = self._refs.get(page)
            if refs is None:
                own.append(page)
                parent = None
                continue
            if parent is not None:  # the table is the chain: worth no more than its parent
                self._score[page] = min(self._score[page], self._score[parent])
            parent = page
            if refs == 1:
                del self._refs[page]
                self._push_idle(page, depth)
            else:
                self._refs[page] = refs - 1
        self.pool.free(own, PageKind.KV)
        block_table.clear()

    def evict(self, pages_needed: int, max_rate: float = math.inf) -> int:
        """Give idle cached pages back to the pool, lowest use rate first (the deepest among
        equals), until ``pages_needed`` pages are free, none is idle, or the next one's use
        rate per second is above ``max_rate``. Returns how many were freed."""
        freed: list[int] = []
        x = self._clock() / HIT_HALF_LIFE_S
        while self.pool.num_free + len(freed) < pages_needed:
            entry = self._first_idle()
            if entry is None or math.exp2(entry[0] - x) > max_rate:
                break
            heapq.heappop(self._heap)
            page = entry[3]
            del self._idle[page], self._score[page]
            del self._page[self._key.pop(page)]
            freed.append(page)
        self.pool.free(freed, PageKind.KV)
        self.evicted += len(freed)
        return len(freed)

    def clear(self) -> None:
        """Forget every idle block (their pages go back to the pool)."""
        self.evict(self.pool.capacity + 1)

    def _first_idle(self) -> _Entry | None:
        """The live heap entry first in line (stale ones on top are dropped), or None."""
        while self._heap:
            entry = self._heap[0]
            if self._idle.get(entry[3]) is entry:
                return entry
            heapq.heappop(self._heap)
        return None

    def _push_idle(self, page: int, depth: int) -> None:
        self._seq += 1
        entry = (self._score[page], -depth, self._seq, page)
        self._idle[page] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._idle) + 64:  # stale entries of pages held again
            self._heap = list(self._idle.values())
            heapq.heapify(self._heap)

    def _hold(self, page: int) -> None:
        if self._idle.pop(page, None) is not None:  # its heap entry goes stale
            self._refs[page] = 1
        else:
            self._refs[page] += 1
