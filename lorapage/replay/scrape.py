"""Server-side counters: Prometheus text parsed into ``{"name{labels}": value}`` and compared.

Histogram buckets and ``_created`` timestamps are dropped (the report keeps counts and sums), so a
snapshot stays small whatever the server exports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

MAX_SERIES = 5000  # a snapshot keeps at most this many series (metric label sets are bounded, but not ours)

# What report.md shows first among the series that changed: residency, eviction, preemption,
# pool pages, refusals and requests by tier (lorapage's names; others' are listed after).
HIGHLIGHT = re.compile(
    r"preempt|evict|yield|drain|pool_pages|resident|host_ram|rejected|queue_depth|running"
    r"|time_to_first_token_seconds_count|requests_total|generation_tokens"
)


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed by ``name{labels}`` exactly as written."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):  # label values may hold spaces: cut at the last }
            end = line.rindex("}") + 1
            key, rest = line[:end], line[end:]
        else:
            key, _, rest = line.partition(" ")
        name = key.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value) and len(out) < MAX_SERIES:
            out[key] = value
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for every series in either (a gauge's change, a counter's increase)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}


def highlights(before: Mapping[str, float], after: Mapping[str, float], limit: int = 40) -> list[str]:
    """The series worth a line in report.md: those that changed, the highlighted kinds first."""
    changed = [k for k, d in delta(before, after).items() if d != 0]
    first = [k for k in changed if HIGHLIGHT.search(k)]
    return (first + [k for k in changed if k not in first])[:limit]
