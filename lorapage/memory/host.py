"""Host buffers for data written once and then kept: adapters' host-RAM copies and file reads.

Memory fresh from the kernel is mapped page by page as it is first written, and under a
hypervisor each 4 KB fault is costly. Writing 10.6 MB (a rank-16 adapter of the 100M bench model)
into a new ``torch.empty`` took 29 ms in isolation on the 2-vCPU machines this project runs on,
against 2.4 ms into memory advised for transparent huge pages (one fault per 2 MB). Inside a
replay pass the packed copy still took ~20 ms either way: there the VM's host was backing memory
the guest had handed back (bench/RESULTS.md, session 7), which no advice avoids: packing into a
buffer this process had written before took 2-3 ms (bench/RESULTS.md, wt-replay). So large
buffers are anonymous mappings with ``MADV_HUGEPAGE`` (which takes effect where the system's THP
mode is ``madvise``, a common default, or ``always``), taken from :data:`HOST_ARENA`: a mapping
whose last tensor is gone stays mapped, and the next buffer of about its size reuses it, its
pages already backed. An evicted host copy's memory is the next load's; an engine closed in a
process leaves its buffers to the next one. At most :attr:`HostArena.keep_bytes` stay idle. Small
buffers, and any off Linux, are plain ``torch.empty``. (PyTorch's ``THP_MEM_ALLOC_ENABLE=1``
advises every large CPU allocation of a process, but only when set before torch's first
allocation, and frees them as usual, so it is not ours to set.)
"""

from __future__ import annotations

import math
import mmap
import threading
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

HUGE_PAGE_BYTES = 2 << 20  # below one huge page, advice has nothing to act on
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
KEEP_IDLE_BYTES = 1 << 30  # idle mappings kept for reuse, at most (a hundred 10 MB adapters)


@dataclass
class _Mapping:
    """One anonymous mapping and the storage of the buffer now viewing it (None: never lent)."""

    region: mmap.mmap
    size: int
    lent: StorageWeakRef | None = None

    def idle(self) -> bool:
        """No tensor views the mapping: every view of its last buffer is gone."""
        return self.lent is None or self.lent.expired()

    def lend(self, nbytes: int) -> torch.Tensor:
        buf = torch.frombuffer(self.region, dtype=torch.uint8, count=nbytes)  # holds the mmap object
        self.lent = StorageWeakRef(buf.untyped_storage())
        return buf


class HostArena:
    """Huge-page-advised mappings lent as uint8 buffers and lent again once nothing views them.

    A mapping is idle when the storage of the buffer it last lent has been freed (every view of
    it gone), which :class:`~torch.multiprocessing.reductions.StorageWeakRef` tells without a
    hook on the tensors. :meth:`take` lends the smallest idle mapping that holds ``nbytes`` and
    is at most a quarter larger than a new one would be, else maps a new one, first unmapping
    idle ones while more than :attr:`keep_bytes` are idle. Thread-safe: loads take buffers on
    I/O threads.
    """

    def __init__(self, keep_bytes: int = KEEP_IDLE_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._mappings: list[_Mapping] = []
        self._lock = threading.Lock()
        self.reused = 0  # buffers lent from a mapping lent before (tests read it)

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 buffer of ``nbytes`` (at least one huge page) in a mapping of this arena."""
        whole = math.ceil(nbytes / HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # what a new mapping would be
        with self._lock:
            fits = [m for m in self._mappings if m.idle() and nbytes <= m.size <= whole + whole // 4]
            if fits:
                self.reused += 1
                return min(fits, key=lambda m: m.size).lend(nbytes)
            self._trim(self.keep_bytes)
            mapping = _Mapping(_map(whole), whole)
            self._mappings.append(mapping)
            return mapping.lend(nbytes)

    def idle_bytes(self) -> int:
        """Bytes of mappings no tensor views now (kept for reuse)."""
        with self._lock:
            return sum(m.size for m in self._mappings if m.idle())

    def trim(self, keep_bytes: int = 0) -> int:
        """Unmap idle mappings, largest first, until at most ``keep_bytes`` are idle; the bytes unmapped."""
        with self._lock:
            return self._trim(keep_bytes)

    def _trim(self, keep_bytes: int) -> int:
        idle = sorted((m for m in self._mappings if m.idle()), key=lambda m: -m.size)
        excess, freed = sum(m.size for m in idle) - keep_bytes, 0
        for m in idle:
            if freed >= excess:
                break
            self._mappings.remove(m)
            m.region.close()  # no tensor views it: nothing reads the memory again
            freed += m.size
        return freed


def _map(nbytes: int) -> mmap.mmap:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if _MADV_HUGEPAGE is not None:  # off Linux an arena's mappings have small pages
            region.madvise(_MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP: small pages, as torch.empty would have
        pass
    return region


HOST_ARENA = HostArena()  # the process's: host copies and read buffers of every engine in it


def host_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised CPU tensor, huge-page backed and from :data:`HOST_ARENA` when it is large
    enough and the OS allows."""
    shape = (shape,) if isinstance(shape, int) else shape
    nbytes = math.prod(shape) * dtype.itemsize
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    return HOST_ARENA.take(nbytes).view(dtype).view(shape)
