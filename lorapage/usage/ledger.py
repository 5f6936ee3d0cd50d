"""Cost attribution: what each tenant and adapter version used, hour by hour.

Per ``(hour, tenant, adapter)`` (``hour``: hours since the Unix epoch; ``adapter``: a version key
``id@N``, or ``""`` for the base model; ``tenant``: ``""`` for what belongs to an adapter rather
than to a request: its residency and its loads):

- ``requests``, ``prompt_tokens`` (prefilled, cache hits not counted), ``output_tokens``;
- ``device_s``: each step's time apportioned to its rows by the tokens each computed;
- ``kv_page_s``: each step's time times the KV pages each row held;
- ``adapter_page_s``: the wall time each adapter version was resident times its pages;
- ``load_bytes``, ``load_s``: bytes moved into the pool by its loads, and their time.

The parts add up to the engine's totals (:attr:`UsageLedger.totals`) by construction; the ledger
is pure (time comes in as arguments) and bounded (hours older than the retention are dropped).

Beside the rows, the ledger counts each adapter version's requests and tokens per hour since the
last :meth:`UsageLedger.take_traffic` (whoever takes them adds them to the registry's traffic
table in one batch, off the event loop: :mod:`lorapage.engine.tiering`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields

HOUR_S = 3600
RETENTION_HOURS = 14 * 24


@dataclass
class Usage:
    """Counters of one (hour, tenant, adapter), or of the whole engine."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    device_s: float = 0.0
    kv_page_s: float = 0.0
    adapter_page_s: float = 0.0
    load_bytes: int = 0
    load_s: float = 0.0

    def add(self, other: Usage) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


USAGE_FIELDS = tuple(f.name for f in fields(Usage))


@dataclass(frozen=True)
class StepRow:
    """One row of a step as the ledger sees it."""

    tenant: str
    adapter: str  # version key, or "" for the base
    prompt_tokens: int  # prompt tokens this step computed for it
    output_tokens: int  # 1 if it sampled a token this step
    kv_pages: int  # KV pages it held


Key = tuple[int, str, str]  # (hour, tenant, adapter)
TrafficKey = tuple[int, str]  # (hour, adapter version)


@dataclass
class Traffic:
    """An adapter version's requests and tokens in one hour, not yet taken (:meth:`UsageLedger.take_traffic`)."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


class UsageLedger:
    """Counters by hour, tenant and adapter, fed by the step loop and the adapter cache."""

    def __init__(self, retention_hours: int = RETENTION_HOURS, wall_offset: float = 0.0) -> None:
        """``wall_offset``: what to add to the times the ledger is given to make them Unix time, so
        that hours are the calendar's (the engine's clock is monotonic; it passes ``time.time() -
        clock()`` taken at its start)."""
        self.retention_hours = retention_hours
        self.wall_offset = wall_offset
        self.rows: dict[Key, Usage] = {}
        self.totals = Usage()
        self._resident_since: float | None = None  # the last time residency was accounted
        self.traffic: dict[TrafficKey, Traffic] = {}  # adapters' counts since take_traffic

    def _traffic(self, now: float, adapter: str) -> Traffic:
        key = (self.hour(now), adapter)
        t = self.traffic.get(key)
        if t is None:
            t = self.traffic[key] = Traffic()
        return t

    def _row(self, now: float, tenant: str, adapter: str) -> Usage:
        key = (self.hour(now), tenant, adapter)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = Usage()
        return row

    def hour(self, now: float) -> int:
        """The hour ``now`` falls in, counted from the Unix epoch."""
        return int((now + self.wall_offset) // HOUR_S)

    def record_request(self, now: float, tenant: str, adapter: str) -> None:
        self._row(now, tenant, adapter).requests += 1
        self.totals.requests += 1
        if adapter:
            self._traffic(now, adapter).requests += 1

    def record_step(self, now: float, seconds: float, rows: Iterable[StepRow]) -> None:
        """One step of ``seconds``: its time shared by the tokens each row computed."""
        rows = list(rows)
        tokens = sum(r.prompt_tokens + r.output_tokens for r in rows) or 1
        for r in rows:
            u = self._row(now, r.tenant, r.adapter)
            share = seconds * (r.prompt_tokens + r.output_tokens) / tokens
            page_s = seconds * r.kv_pages
            u.prompt_tokens += r.prompt_tokens
            u.output_tokens += r.output_tokens
            u.device_s += share
            u.kv_page_s += page_s
            self.totals.prompt_tokens += r.prompt_tokens
            self.totals.output_tokens += r.output_tokens
            self.totals.kv_page_s += page_s
            if r.adapter:
                t = self._traffic(now, r.adapter)
                t.prompt_tokens += r.prompt_tokens
                t.output_tokens += r.output_tokens
        if rows:
            self.totals.device_s += seconds

    def record_residency(self, now: float, resident: Mapping[str, int]) -> None:
        """Resident adapter versions and their pages as of ``now``: the time since the previous
        call is charged to each at these pages (call it at least at every change)."""
        since, self._resident_since = self._resident_since, now
        if since is None or now <= since:
            return
        for adapter, pages in resident.items():
            page_s = (now - since) * pages
            self._row(now, "", adapter).adapter_page_s += page_s
            self.totals.adapter_page_s += page_s

    def record_load(self, now: float, adapter: str, nbytes: int, seconds: float) -> None:
        u = self._row(now, "", adapter)
        u.load_bytes += nbytes
        u.load_s += seconds
        self.totals.load_bytes += nbytes
        self.totals.load_s += seconds

    def prune(self, now: float) -> None:
        """Drop hours past the retention."""
        oldest = self.hour(now) - self.retention_hours
        for key in [k for k in self.rows if k[0] < oldest]:
            del self.rows[key]
        for tkey in [k for k in self.traffic if k[0] < oldest]:
            del self.traffic[tkey]

    def take_traffic(self) -> dict[TrafficKey, Traffic]:
        """The adapters' counts per (hour, version) since the last call; the ledger starts afresh."""
        taken, self.traffic = self.traffic, {}
        return taken

    def restore_traffic(self, taken: Mapping[TrafficKey, Traffic]) -> None:
        """Give back counts :meth:`take_traffic` returned that could not be written (added to any
        counted since)."""
        for key, t in taken.items():
            mine = self.traffic.setdefault(key, Traffic())
            mine.requests += t.requests
            mine.prompt_tokens += t.prompt_tokens
            mine.output_tokens += t.output_tokens

    def query(
        self, *, tenants: set[str] | None = None, adapters: set[str] | None = None, since_hour: int | None = None
    ) -> list[tuple[Key, Usage]]:
        """Rows in (hour, tenant, adapter) order, filtered: a row is kept when its tenant is in
        ``tenants`` or its adapter in ``adapters`` (either filter None: no filter on it)."""
        out = []
        for key, usage in self.rows.items():  # filtered first: only the rows kept are sorted
            hour, tenant, adapter = key
            if since_hour is not None and hour < since_hour:
                continue
            if tenants is not None or adapters is not None:
                if not ((tenants is not None and tenant in tenants) or (adapters is not None and adapter in adapters)):
                    continue
            out.append((key, usage))
        out.sort(key=lambda row: row[0])
        return out
