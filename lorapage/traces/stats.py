"""The arithmetic of a report, as plain functions over records: percentiles, goodput under SLOs,
throughput, fairness and the timeline. Nothing here reads a clock or a file."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from lorapage.traces.records import NOT_SENT, OK, Record

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default): with sorted values v, position (n - 1) q / 100. ``None`` for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, p50 / p90 / p95 / p99 and max of ``values``."""
    out: dict[str, float | int | None] = {"count": len(values), "mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    out["max"] = max(values) if values else None
    return out


def tpot(rec: Record) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
    if rec.e2e_s is None or rec.ttft_s is None or rec.output_tokens < 2:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


def latency(records: Iterable[Record]) -> dict[str, dict]:
    """TTFT, ITL (every gap between token arrivals), E2E and TPOT of the requests that succeeded."""
    ok = [r for r in records if r.outcome == OK]
    return {
        "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": summarize([g for r in ok for g in r.gaps]),
        "e2e": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "tpot": summarize([t for r in ok if (t := tpot(r)) is not None]),
    }


def grouped(records: Iterable[Record], key: Callable[[Record], str]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        out[key(r)].append(r)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Slo:
    """TTFT targets: ``ttft_s`` for a resident adapter (tier ``gpu``), the base model (``none``) and
    servers that do not say (``unknown``); ``ttft_cold_s`` for the tiers in ``cold_tiers``."""

    ttft_s: float = 1.0
    ttft_cold_s: float = 2.0
    cold_tiers: tuple[str, ...] = ("ram", "disk")

    def ttft_target(self, tier: str) -> float:
        return self.ttft_cold_s if tier in self.cold_tiers else self.ttft_s

    def met(self, rec: Record) -> bool:
        """Succeeded, with its first token within its tier's target."""
        return rec.outcome == OK and rec.ttft_s is not None and rec.ttft_s <= self.ttft_target(rec.tier)


def span_s(records: Sequence[Record]) -> float:
    """From the first request sent to the last answer's end (0 when nothing was sent)."""
    sent = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    if not sent or not ends:
        return 0.0
    return max(0.0, max(ends) - min(sent))


def _per_s(n: float, duration: float) -> float | None:
    return n / duration if duration > 0 else None


def goodput(records: Sequence[Record], slo: Slo, duration_s: float) -> dict:
    """Requests that met their SLO, as a fraction of those sent and per second; also by tier."""
    sent = [r for r in records if r.outcome != NOT_SENT]

    def one(group: Sequence[Record]) -> dict:
        good = [r for r in group if slo.met(r)]
        return {
            "good": len(good),
            "sent": len(group),
            "fraction": len(good) / len(group) if group else None,
            "requests_per_s": _per_s(len(good), duration_s),
            "output_tokens_per_s": _per_s(sum(r.output_tokens for r in good), duration_s),
        }

    out = one(sent)
    out["by_tier"] = {tier: one(group) for tier, group in grouped(sent, lambda r: r.tier).items()}
    out["slo"] = {"ttft_s": slo.ttft_s, "ttft_cold_s": slo.ttft_cold_s, "cold_tiers": list(slo.cold_tiers)}
    return out


def throughput(records: Sequence[Record], duration_s: float) -> dict:
    """Completed requests and tokens per second over ``duration_s``."""
    ok = [r for r in records if r.outcome == OK]
    return {
        "duration_s": duration_s,
        "requests_per_s": _per_s(len(ok), duration_s),
        "output_tokens_per_s": _per_s(sum(r.output_tokens for r in records), duration_s),
        "prompt_tokens_per_s": _per_s(sum(r.prompt_tokens for r in ok), duration_s),
    }


def statuses(records: Iterable[Record]) -> dict[str, dict[str, int]]:
    """Answers by HTTP status (200, 429, 503, other; none: no status came back) and by outcome."""
    by_status: Counter[str] = Counter({"200": 0, "429": 0, "503": 0, "other": 0, "none": 0})
    outcomes: Counter[str] = Counter()
    for r in records:
        key = str(r.status) if r.status in (200, 429, 503) else "none" if r.status == 0 else "other"
        by_status[key] += 1
        outcomes[r.outcome] += 1
    return {"by_status": dict(by_status), "by_outcome": dict(sorted(outcomes.items()))}


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n at worst."""
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def fairness(records: Sequence[Record], demand: Mapping[str, float], weights: Mapping[str, float]) -> dict:
    """Per tenant: its share of the weights, of the demand (``demand``: tokens asked for, e.g.
    prompt + max tokens) and of the tokens served (prompt + output of what it got), and served
    over weight and over demand; Jain's index over served / weight (1: served exactly by weight;
    meaningful when every tenant keeps a backlog). Tenants absent from ``weights`` weigh 1."""
    served: Counter[str] = Counter()
    for r in records:
        if r.output_tokens:
            served[r.tenant] += r.prompt_tokens + r.output_tokens
    tenants = sorted(set(demand) | set(served))
    wsum = sum(weights.get(t, 1.0) for t in tenants) or 1.0
    dsum = sum(demand.values()) or 1.0
    ssum = sum(served.values()) or 1.0
    rows, ratios = {}, []
    for t in tenants:
        w, d, s = weights.get(t, 1.0) / wsum, demand.get(t, 0.0) / dsum, served[t] / ssum
        rows[t] = {
            "weight_share": w,
            "demand_share": d,
            "served_share": s,
            "served_tokens": served[t],
            "served_over_weight": s / w if w > 0 else None,
            "served_over_demand": s / d if d > 0 else None,
        }
        if w > 0:
            ratios.append(s / w)
    return {"tenants": rows, "jain_index": jain_index(ratios)}


def timeline(records: Sequence[Record], bin_s: float, samples: Sequence[tuple[float, dict]] = ()) -> dict:
    """Per bin of ``bin_s`` seconds from the start: requests sent and completed per second, output
    tokens per second, TTFT p50 / p95 of the requests sent in the bin, requests in flight at the
    bin's middle, and the means of server gauges sampled in it (``samples``: (time, gauges))."""
    ends = [r.end_s for r in records if r.end_s is not None] + [t for t, _ in samples]
    sent = [r.sent_s for r in records if r.sent_s is not None]
    horizon = max(ends + sent, default=0.0)
    n = max(1, math.ceil(horizon / bin_s)) if horizon > 0 else 0
    arrivals, done, tokens = [0] * n, [0] * n, [0.0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]

    def at(t: float) -> int:
        return min(n - 1, int(t / bin_s))

    for r in records:
        if r.sent_s is None:
            continue
        arrivals[at(r.sent_s)] += 1
        if r.ttft_s is not None:
            ttfts[at(r.sent_s)].append(r.ttft_s)
        if r.outcome == OK and r.end_s is not None:
            done[at(r.end_s)] += 1
        per_chunk = r.output_tokens / len(r.chunks_s) if r.chunks_s else 0.0
        for c in r.chunks_s:
            tokens[at(r.sent_s + c)] += per_chunk
    mids = [(i + 0.5) * bin_s for i in range(n)]
    in_flight = [
        sum(1 for r in records if r.sent_s is not None and r.sent_s <= m and (r.end_s is None or r.end_s > m))
        for m in mids
    ]
    gauges: dict[str, list[float | None]] = {}
    for key in sorted({k for _, g in samples for k in g}):
        sums, counts = [0.0] * n, [0] * n
        for t, g in samples:
            if key in g and n:
                sums[at(t)] += g[key]
                counts[at(t)] += 1
        gauges[key] = [s / c if c else None for s, c in zip(sums, counts)]
    return {
        "bin_s": bin_s,
        "t": [i * bin_s for i in range(n)],
        "sent_per_s": [a / bin_s for a in arrivals],
        "completed_per_s": [d / bin_s for d in done],
        "output_tokens_per_s": [x / bin_s for x in tokens],
        "ttft_p50": [percentile(x, 50) for x in ttfts],
        "ttft_p95": [percentile(x, 95) for x in ttfts],
        "in_flight": in_flight,
        "server": gauges,
    }
