"""KV block bookkeeping for sequences: how many pages a sequence needs and handing them out."""

from __future__ import annotations

from lorapage.memory.pool import PageKind, PagePool
from lorapage.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def grow_block_table(pool: PagePool, req: Request, num_tokens: int, block_size: int) -> bool:
    """Give ``req`` pages for its first ``num_tokens`` tokens; False (nothing taken) if short."""
    missing = blocks_needed(num_tokens, block_size) - len(req.block_table)
    if missing <= 0:
        return True
    pages = pool.allocate(missing, PageKind.KV)
    if pages is None:
        return False
    req.block_table.extend(pages)
    return True


def free_block_table(pool: PagePool, req: Request) -> None:
    pool.free(req.block_table, PageKind.KV)
    req.block_table = []
    req.num_computed = 0
