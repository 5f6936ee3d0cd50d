"""What pool pages are worth: recent use rate x the cost of losing them / pages.

For an adapter that cost is reloading it; for an idle cached KV block (one page) it is
recomputing the block. Both are ranked in one currency by :mod:`lorapage.memory.reclaim`
(``value_per_page``: expected seconds of reloading or recomputing per second, per page kept);
this module measures what an adapter's reload costs.

An adapter that leaves the pool falls to host RAM when its packed copy is there (bringing it
back is one copy into the pool), else to disk (a read, the digest check, parsing and packing,
then the copy), or, for a remote source not in the disk cache, to the network (a download
first). Eviction and yields take the adapter whose pages are worth least: the one whose loss
costs the fewest expected seconds of reloading per page freed.

Reload costs are measured, not assumed: :class:`ReloadCosts` keeps, for each stage of a load, an
exponentially weighted mean of the seconds per page that stage took, seeded from bandwidths so
the ranking is sensible before the first load (see the ``SEED_*`` constants).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from enum import Enum

from lorapage.memory.reclaim import EWMA_WEIGHT


class LoadTier(Enum):
    """Where a load into the pool starts from (and so which stages it runs)."""

    RAM = "ram"  # the packed host copy: copy into the pool
    DISK = "disk"  # a local directory or the disk cache: read + verify + pack, then copy
    REMOTE = "remote"  # a remote source not in the disk cache: download, read, then copy


class Stage(Enum):
    """One measured part of a load."""

    COPY = "copy"  # host RAM -> pool pages (forward thread, queued behind the step in flight)
    READ = "read"  # files -> packed host copy (I/O pool): read, sha256, safetensors parse, pack
    DOWNLOAD = "download"  # source -> verified disk-cache entry


_STAGES = {
    LoadTier.RAM: (Stage.COPY,),
    LoadTier.DISK: (Stage.READ, Stage.COPY),
    LoadTier.REMOTE: (Stage.DOWNLOAD, Stage.READ, Stage.COPY),
}

# Seeds, in bytes per second, used until a stage has been measured. They only need the right
# order of magnitude (the ratios decide evictions) and are replaced as loads are timed:
# - copy: a pageable host-to-device copy over PCIe 4 runs at ~4-10 GB/s (the driver stages it);
#   4 GB/s is the low end, and a CPU pool's memcpy is faster still.
# - read: NVMe reads at 2+ GB/s but a load also hashes (sha256 ~1-2 GB/s per core), parses and
#   packs the weights: about 0.5 GB/s end to end.
# - download: one object-store or Hub stream sustains ~50-100 MB/s; 50 MB/s, before the read.
SEED_BYTES_PER_S = {Stage.COPY: 4e9, Stage.READ: 5e8, Stage.DOWNLOAD: 5e7}


class ReloadCosts:
    """Seconds per page of each load stage: an EWMA of measured loads over bandwidth seeds."""

    def __init__(self, page_bytes: int) -> None:
        self._s_per_page = {stage: page_bytes / bw for stage, bw in SEED_BYTES_PER_S.items()}
        self.measured = {stage: 0 for stage in Stage}  # loads timed per stage

    def observe(self, stage: Stage, seconds: float, pages: int) -> None:
        """A stage of a load of ``pages`` pages took ``seconds``."""
        if pages <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        old = self._s_per_page[stage]
        self._s_per_page[stage] = old + EWMA_WEIGHT * (seconds / pages - old)
        self.measured[stage] += 1

    def seconds_per_page(self, stage: Stage) -> float:
        return self._s_per_page[stage]

    def reload_s(self, tier: LoadTier, pages: int) -> float:
        """Expected seconds to bring ``pages`` pages back into the pool from ``tier``."""
        return pages * sum(self._s_per_page[s] for s in _STAGES[tier])


class RecentAdapters:
    """Per tenant, the adapters it used most recently (at most ``per_tenant``, none older than
    ``window_s``), for at most ``max_tenants`` tenants (the least recently active go first)."""

    def __init__(self, per_tenant: int = 4, window_s: float = 600.0, max_tenants: int = 1024) -> None:
        self.per_tenant, self.window_s, self.max_tenants = per_tenant, window_s, max_tenants
        self._by_tenant: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()

    def use(self, tenant: str, adapter: str, now: float) -> list[str]:
        """``tenant`` sent a request for ``adapter`` at ``now``: the tenant's other adapters
        used within the window, most recent first."""
        recent = self._by_tenant.pop(tenant, None) or OrderedDict()
        self._by_tenant[tenant] = recent
        while len(self._by_tenant) > self.max_tenants:
            self._by_tenant.popitem(last=False)
        others = [a for a, t in reversed(recent.items()) if a != adapter and now - t <= self.window_s]
        recent.pop(adapter, None)
        recent[adapter] = now
        while len(recent) > self.per_tenant:
            recent.popitem(last=False)
        return others

    def forget(self, adapter: str) -> None:
        """``adapter`` was unregistered."""
        for recent in self._by_tenant.values():
            recent.pop(adapter, None)
