"""The usage ledger's rows as ``GET /v1/usage`` answers them: JSON or CSV, one row per
(hour, tenant, adapter version), hours as UTC ISO times. Framework-neutral: the server's route
decides who sees which rows; this module only parses the query and writes the rows."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from lorapage.errors import InvalidRequestError
from lorapage.usage.ledger import HOUR_S, USAGE_FIELDS, Key, Usage

FORMATS = ("json", "csv")
COLUMNS = ("hour", "tenant", "adapter", *USAGE_FIELDS)


def hour_iso(hour: int) -> str:
    """Hour ``hour`` since the epoch as ``2026-12-03T12:00:00Z``."""
    return datetime.fromtimestamp(hour * HOUR_S, UTC).strftime("%Y-%m-%dT%H:00:00Z")


def parse_since(text: str) -> int:
    """``since`` as an hour since the epoch: Unix seconds, or an ISO time (UTC unless it says)."""
    return int(parse_instant(text) // HOUR_S)


def parse_instant(text: str, param: str = "since") -> float:
    """A query's time as Unix seconds: Unix seconds, or an ISO time (UTC unless it says)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is not None:
        if not 0 <= seconds < 1e11:  # NaN, infinities and negatives name no time
            raise InvalidRequestError(f"{param}={text!r}: Unix seconds must be between 0 and 1e11", param=param)
        return seconds
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequestError(
            f"{param}={text[:64]!r} is neither Unix seconds nor an ISO time (2026-12-03T12:00:00Z)", param=param
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def parse_format(text: str | None) -> str:
    fmt = text or "json"
    if fmt not in FORMATS:
        raise InvalidRequestError(f"format={fmt!r}: one of {', '.join(FORMATS)}", param="format")
    return fmt


def _row(key: Key, usage: Usage) -> dict[str, object]:
    hour, tenant, adapter = key
    return {"hour": hour_iso(hour), "tenant": tenant, "adapter": adapter, **usage.as_dict()}


def usage_json(rows: Sequence[tuple[Key, Usage]]) -> dict[str, object]:
    """``{"object": "list", "data": [rows], "total": {sums}}``: ``tenant`` is "" on what belongs to an
    adapter version (its residency and loads), ``adapter`` "" on the base model's."""
    total = Usage()
    for _, usage in rows:
        total.add(usage)
    return {"object": "list", "data": [_row(k, u) for k, u in rows], "total": total.as_dict()}


def usage_csv(rows: Sequence[tuple[Key, Usage]]) -> str:
    """The rows as CSV with a header line (:data:`COLUMNS`)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for key, usage in rows:
        writer.writerow(_row(key, usage))
    return out.getvalue()


def tenant_rows(rows: Sequence[tuple[Key, Usage]], tenant: str, owners: Mapping[str, str]) -> list[tuple[Key, Usage]]:
    """What ``tenant`` may see: its requests' rows, and the residency and loads of adapter
    versions it owns (``owners``: adapter id -> owning tenant)."""
    return [
        (key, usage)
        for key, usage in rows
        if key[1] == tenant or (key[1] == "" and key[2] and owners.get(key[2].rpartition("@")[0]) == tenant)
    ]


def summed(parts: Iterable[Sequence[tuple[Key, Usage]]]) -> list[tuple[Key, Usage]]:
    """Several ledgers' rows (a fleet's replicas') as one ledger's: summed by (hour, tenant,
    adapter version), in that order, so they still add up to the sum of the parts' totals."""
    out: dict[Key, Usage] = {}
    for rows in parts:
        for key, usage in rows:
            out.setdefault(key, Usage()).add(usage)
    return sorted(out.items())
