"""Giving pool pages back under pressure: idle cached KV blocks and idle adapters in one ranking.

Both kinds of idle page are worth what losing them costs, in one currency (value per page):

    value per page = use rate x seconds to bring it back / pages

For an idle adapter the seconds are its reload from the tier it would fall to
(:mod:`lorapage.adapters.value`); for an idle cached block (one page) they are its recompute
(:class:`RecomputeCost`). Both rates are counts decayed with :data:`RATE_HALF_LIFE_S`, so the
two are comparable: expected seconds of reloading or recomputing per second, per page kept.

:class:`Reclaim` is the one place that ranks them. The prefix cache keeps its idle blocks in the
order they leave; the adapters' residency rules (:mod:`lorapage.adapters.residency`) hand it
their idle adapters with their values when a load or a KV admission needs pages, and evict the
ones it names. Nothing here knows what an adapter is beyond a key and a value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol

RATE_HALF_LIFE_S = 60.0  # how fast a use rate forgets: cached blocks' and adapters' (one currency)
EWMA_WEIGHT = 0.2  # the newest measurement's share in a measured cost: about the last five count
# Recomputing KV, in bytes of KV written per second of prefill, until prefill is measured: a 7-8B
# model prefills ~10k tokens/s on one H100-class GPU and writes 128 KB (GQA) to 512 KB of KV per
# token, ~1-5 GB/s. At 2 GB/s a cached block's page costs about twice a page copied back from host
# RAM and a quarter of one read from disk (the seeds of lorapage.adapters.value).
SEED_PREFILL_KV_BYTES_PER_S = 2e9


def value_per_page(rate: float, reload_s: float, pages: int) -> float:
    """What keeping pages is worth: expected reload (or recompute) seconds per second avoided
    (rate x cost), per page held."""
    return rate * reload_s / max(pages, 1)


class RecomputeCost:
    """Seconds to recompute one cached KV block (``block_size`` tokens of prefill): an EWMA of
    measured prefill seconds per token over a seed (``SEED_PREFILL_KV_BYTES_PER_S``)."""

    def __init__(self, page_bytes: int, block_size: int) -> None:
        self.block_size = block_size
        self._s_per_token = page_bytes / block_size / SEED_PREFILL_KV_BYTES_PER_S
        self.measured = 0  # prefill timings observed

    def observe(self, seconds: float, tokens: int) -> None:
        """A forward pass that prefilled ``tokens`` tokens took ``seconds``."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._s_per_token += EWMA_WEIGHT * (seconds / tokens - self._s_per_token)
        self.measured += 1

    def block_s(self) -> float:
        """Expected seconds to recompute one block."""
        return self._s_per_token * self.block_size


class FreePages(Protocol):
    """The pool's free count (:class:`~lorapage.memory.pages.PageAllocator`)."""

    @property
    def num_free(self) -> int: ...


class IdleBlocks(Protocol):
    """Idle cached blocks, in the order they leave (:class:`~lorapage.memory.prefix_cache.PrefixCache`)."""

    def evict(self, pages_needed: int, max_rate: float = math.inf) -> int:
        """Give idle blocks back until ``pages_needed`` pages are free, none is left, or the
        next one's use rate is above ``max_rate``; how many went."""
        ...


class Reclaim:
    """Frees pages by giving back the least valuable idle pages first, cached blocks and
    adapters interleaved (``blocks`` None: adapters only; ``recompute`` is what a block costs)."""

    def __init__(
        self, pages: FreePages, blocks: IdleBlocks | None = None, recompute: RecomputeCost | None = None
    ) -> None:
        if blocks is not None and recompute is None:
            raise ValueError("idle blocks are ranked by their recompute cost: pass one")
        self.pages, self.blocks, self.recompute = pages, blocks, recompute

    def run(self, pages_needed: int, adapters: Iterable[tuple[float, str]], evict: Callable[[str], None]) -> bool:
        """Free pages until ``pages_needed`` are free; whether they are. ``adapters`` are the
        idle adapters as (value per page, key); ``evict`` gives one back (its pages free at
        once). Least valuable first; at equal value the blocks go first. The adapters are sorted
        here (they are few: at most the lora slots); the blocks already wait in their order, so
        each run of them cheaper than the next adapter is given back in one call."""
        if self.pages.num_free >= pages_needed:
            return True
        for value, key in [*sorted(adapters), (math.inf, None)]:
            if self.pages.num_free >= pages_needed:
                break
            if self.blocks is not None and self.recompute is not None:  # the blocks worth no more per page
                self.blocks.evict(pages_needed, max_rate=value / self.recompute.block_s())
            if key is not None and self.pages.num_free < pages_needed:
                evict(key)
        return self.pages.num_free >= pages_needed
