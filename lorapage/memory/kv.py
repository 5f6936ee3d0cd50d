"""KV block bookkeeping: how many pages a sequence needs, and growing its block table.

A block table is a sequence's list of page ids, one KV block each. These functions know pages,
not requests. An entry of 0 (the dummy page) is a block given back while the sequence runs: one
that every layer's sliding window has left behind (``model/windows.py``).
"""

from __future__ import annotations

from lorapage.memory.pages import PageKind
from lorapage.memory.pool import PagePool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def grow_block_table(pool: PagePool, block_table: list[int], num_tokens: int, block_size: int) -> bool:
    """Extend ``block_table`` to hold ``num_tokens`` tokens; False (nothing taken) if short."""
    missing = blocks_needed(num_tokens, block_size) - len(block_table)
    if missing <= 0:
        return True
    pages = pool.allocate(missing, PageKind.KV)
    if pages is None:
        return False
    block_table.extend(pages)
    return True


def held_pages(block_table: list[int]) -> int:
    """Pages ``block_table`` still holds: its blocks less those a sliding window freed (page 0)."""
    return sum(1 for page in block_table if page)
