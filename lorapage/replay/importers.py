"""Importers of public production-trace formats into the trace format.

The sources record when requests came and how long they were, not who sent them: each row's
tenant and adapter are drawn from a seeded :class:`~lorapage.replay.population.Population`
(Zipf over the adapters), so one CSV can be replayed against any number of adapters.

* Azure LLM inference traces (2023 and 2024): ``TIMESTAMP,ContextTokens,GeneratedTokens`` with
  ``TIMESTAMP`` a date-time such as ``2023-11-16 18:15:46.6805900`` (any number of fractional
  digits, an optional UTC offset).
* BurstGPT: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` with
  ``Timestamp`` in seconds from the trace's start. Rows with 0 response tokens are failed
  requests in that trace and are skipped (and counted).

Arrival times start at 0 at the first row kept; rows are sorted by time.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from lorapage.replay.population import Population
from lorapage.traces.trace import TraceError, TraceRequest


@dataclass(frozen=True)
class ImportOptions:
    """How rows become requests: the population they are drawn from and what is kept."""

    seed: int = 0
    adapters: int = 5000
    zipf_alpha: float = 1.3
    tenants: int = 50
    base_fraction: float = 0.0
    base_name: str = "base"
    start_s: float = 0.0  # skip rows before this many seconds after the first
    duration_s: float | None = None  # keep rows up to start_s + duration_s
    limit: int | None = None  # keep at most this many rows
    prompt_max: int | None = None  # clip lengths (to fit a small model's context)
    output_max: int | None = None


@dataclass(frozen=True)
class Imported:
    """What an import produced, and how many rows it skipped and why."""

    requests: list[TraceRequest]
    rows: int
    skipped: dict[str, int]


_FRACTION = re.compile(r"^(?P<main>[^.]+)(?:\.(?P<frac>\d+))?(?P<tz>Z|[+-]\d\d:?\d\d)?$")


def parse_azure_timestamp(text: str) -> float:
    """Seconds since the epoch of an Azure trace ``TIMESTAMP`` (naive times are taken as UTC)."""
    m = _FRACTION.match(text.strip())
    if m is None:
        raise ValueError(f"not a date-time: {text!r}")
    frac = (m["frac"] or "0")[:6].ljust(6, "0")
    tz = m["tz"] or ""
    stamp = datetime.fromisoformat(f"{m['main']}.{frac}{'+00:00' if tz == 'Z' else tz}")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _rows(path: str | Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Rows of a CSV as ``(line number, {wanted column: value})``; column names match loosely."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}: empty file; expected a header with {', '.join(columns)}")
        index = {h.strip().lower(): i for i, h in enumerate(header)}
        missing = [c for c in columns if c.lower() not in index]
        if missing:
            raise TraceError(f"{path}: header {header} lacks {missing}; expected columns {list(columns)}")
        for lineno, row in enumerate(reader, 2):
            if not row or not any(cell.strip() for cell in row):
                continue
            try:
                yield lineno, {c: row[index[c.lower()]].strip() for c in columns}
            except IndexError:
                raise TraceError(f"{path}:{lineno}: {len(row)} fields; the header has {len(header)}") from None


def _int(path: str | Path, lineno: int, column: str, value: str) -> int:
    try:
        number = float(value)
    except ValueError:
        raise TraceError(f"{path}:{lineno}: {column} must be a number; got {value!r}") from None
    if number < 0 or number != int(number):
        raise TraceError(f"{path}:{lineno}: {column} must be a whole number >= 0; got {value!r}")
    return int(number)


def _build(rows: list[tuple[float, int, int]], total: int, skipped: dict[str, int], opts: ImportOptions) -> Imported:
    """Requests from ``(time, prompt tokens, output tokens)`` rows, windowed, clipped and populated."""
    rows.sort(key=lambda r: r[0])
    kept: list[tuple[float, int, int]] = []
    t0 = rows[0][0] if rows else 0.0
    for t, p, o in rows:
        rel = t - t0 - opts.start_s
        if rel < 0 or (opts.duration_s is not None and rel > opts.duration_s):
            skipped["outside_window"] = skipped.get("outside_window", 0) + 1
            continue
        if opts.limit is not None and len(kept) >= opts.limit:
            skipped["over_limit"] = skipped.get("over_limit", 0) + 1
            continue
        kept.append((rel, p, o))
    population = Population.make(
        num_tenants=min(opts.tenants, opts.adapters) if opts.adapters else opts.tenants,
        num_adapters=opts.adapters,
        zipf_alpha=opts.zipf_alpha,
        base_name=opts.base_name,
        base_fraction=opts.base_fraction,
    )
    tenants, models = population.draw(np.random.default_rng(opts.seed), len(kept))
    first = kept[0][0] if kept else 0.0
    out = []
    for (rel, p, o), tenant, model in zip(kept, tenants, models):
        p = max(1, min(p, opts.prompt_max or p))
        o = max(1, min(o, opts.output_max or o))
        out.append(
            TraceRequest(
                arrival_s=round(rel - first, 6), tenant=tenant, model=model, max_tokens=o, prompt_len=p, output_len=o
            )
        )
    return Imported(out, total, skipped)


def import_azure(path: str | Path, opts: ImportOptions) -> Imported:
    """An Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    rows, skipped, total = [], {"no_output": 0}, 0
    for lineno, row in _rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        total += 1
        try:
            t = parse_azure_timestamp(row["TIMESTAMP"])
        except ValueError as exc:
            raise TraceError(f"{path}:{lineno}: TIMESTAMP: {exc}") from None
        p = _int(path, lineno, "ContextTokens", row["ContextTokens"])
        o = _int(path, lineno, "GeneratedTokens", row["GeneratedTokens"])
        if o == 0:
            skipped["no_output"] += 1
            continue
        rows.append((t, p, o))
    return _build(rows, total, skipped, opts)


_BURSTGPT = ("Timestamp", "Request tokens", "Response tokens")  # of its six columns, the ones used


def import_burstgpt(path: str | Path, opts: ImportOptions) -> Imported:
    """A BurstGPT CSV; rows whose response has 0 tokens (failures there) are skipped."""
    rows, skipped, total = [], {"failed": 0}, 0
    for lineno, row in _rows(path, _BURSTGPT):
        total += 1
        try:
            t = float(row["Timestamp"])
        except ValueError:
            raise TraceError(f"{path}:{lineno}: Timestamp must be seconds; got {row['Timestamp']!r}") from None
        p = _int(path, lineno, "Request tokens", row["Request tokens"])
        o = _int(path, lineno, "Response tokens", row["Response tokens"])
        if o == 0:
            skipped["failed"] += 1
            continue
        rows.append((t, p, o))
    return _build(rows, total, skipped, opts)


IMPORTERS = {"azure": import_azure, "burstgpt": import_burstgpt}
