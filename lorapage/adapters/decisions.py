"""What the residency rules (:mod:`lorapage.adapters.residency`) ask their driver to do.

Each decision is a plain value: the engine's :class:`~lorapage.adapters.cache.AdapterCache`
carries it out with I/O threads and the device, the simulator's
:class:`~lorapage.sim.loader.SimLoader` on its virtual clock; both report back to the rules when
a read or a copy is done. Keys are version keys (``id@N`` in the engine, trace names in the
simulator).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorapage.adapters.value import LoadTier


@dataclass(frozen=True)
class Read:
    """Bring ``key``'s packed copy into host RAM for a load from ``tier`` (RAM: it is there
    already; REMOTE: download first), then report :meth:`~lorapage.adapters.residency.Residency.read_done`."""

    key: str
    tier: LoadTier


@dataclass(frozen=True)
class Prefetch:
    """Read ``key`` into host RAM only, for ``tenant``, then report
    :meth:`~lorapage.adapters.residency.Residency.prefetch_done`."""

    key: str
    tenant: str


@dataclass(frozen=True)
class DropHost:
    """``key``'s host-RAM copy leaves (the LRU is full); a load waiting on it keeps its own."""

    key: str


@dataclass(frozen=True)
class Load:
    """Copy ``key``'s packed copy into ``pages`` and point lora ``slot`` at them, then report
    :meth:`~lorapage.adapters.residency.Residency.copy_done`. The slot and pages are reserved for it."""

    key: str
    slot: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Evict:
    """Lora ``slot`` no longer holds ``key``: clear its table rows (its pages are free already)."""

    key: str
    slot: int


@dataclass(frozen=True)
class Release:
    """The slot and pages a load reserved went back (its copy failed, or its version was removed
    while it ran): clear lora ``slot``'s table rows, which the copy may have written."""

    key: str
    slot: int


@dataclass(frozen=True)
class Yield:
    """Resident ``key`` admits nothing new: a starving load takes its slot once it is idle."""

    key: str


@dataclass(frozen=True)
class Ready:
    """Resident ``key`` admits requests (again): its queued requests may run."""

    key: str


@dataclass(frozen=True)
class Cancel:
    """``key`` was unregistered: stop its read or prefetch in flight; nothing reports back."""

    key: str


Decision = Read | Prefetch | DropHost | Load | Evict | Release | Yield | Ready | Cancel
