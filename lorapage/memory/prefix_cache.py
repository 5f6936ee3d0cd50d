"""Full KV blocks by content, so a prompt that repeats a cached prefix reuses its pages.

A block's key is a hash chain: ``sha256(parent key, the block's token ids)``, seeded by a
*namespace* that names everything the K/V depend on besides the tokens: the base checkpoint and
the adapter registration (the base alone for base-model requests). Two adapters, two
registrations of one adapter name, or an adapter and the base therefore never share a block,
even for identical tokens. Only full blocks are cached, and a sequence only ever writes past the
blocks it matched, so a shared page is never written again (no copy-on-write).

Pages stay in the pool as KV pages. A cached page is *in use* while sequences hold it (a
refcount) and *idle* once none does: idle pages keep their K/V for the next hit and are the first
pages given back under memory pressure, least recently used first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from lorapage.memory.pool import PageKind, PagePool


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


class PrefixCache:
    """Which pool pages hold which full blocks, who holds them, and which are idle."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._page: dict[bytes, int] = {}  # block key -> page holding its K/V
        self._key: dict[int, bytes] = {}  # page -> its block key (cached pages only)
        self._refs: dict[int, int] = {}  # cached page -> sequences whose block table holds it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, LRU first

    @property
    def num_cached(self) -> int:
        return len(self._key)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def match(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest cached prefix of ``keys``, now held by the caller (refcounted)."""
        pages: list[int] = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._hold(page)
        return pages

    def offer(self, key: bytes, page: int) -> None:
        """``page`` (held by one sequence) now holds the full block ``key``: cache it, unless
        another page holds that block already (then ``page`` stays the sequence's own)."""
        if key in self._page or page in self._key:
            return
        self._page[key], self._key[page], self._refs[page] = page, key, 1

    def release(self, block_table: list[int]) -> None:
        """A sequence gives its blocks back: cached pages lose a holder (idle at none), the rest
        return to the pool. Empties ``block_table``."""
        own: list[int] = []
        for page in block_table:
            refs = self._refs.get(page)
            if refs is None:
                own.append(page)
            elif refs == 1:
                del self._refs[page]
                self._idle[page] = None
            else:
                self._refs[page] = refs - 1
        self.pool.free(own, PageKind.KV)
        block_table.clear()

    def evict(self, pages_needed: int) -> int:
        """Give idle cached pages back to the pool, least recently used first, until
        ``pages_needed`` pages are free (or none is idle). Returns how many were freed."""
        freed: list[int] = []
        while self._idle and self.pool.num_free + len(freed) < pages_needed:
            page, _ = self._idle.popitem(last=False)
            del self._page[self._key.pop(page)]
            freed.append(page)
        self.pool.free(freed, PageKind.KV)
        return len(freed)

    def clear(self) -> None:
        """Forget every idle block (their pages go back to the pool)."""
        self.evict(self.pool.capacity + 1)

    def _hold(self, page: int) -> None:
        if page in self._idle:
            del self._idle[page]
            self._refs[page] = 1
        else:
            self._refs[page] += 1
