"""KV block bookkeeping: how many pages a sequence needs, and growing its block table.

A block table is a sequence's list of page ids, one KV block each. These functions know pages,
not requests.
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
