"""``lorapage replay compare A B``: two runs' headline figures side by side, and their TTFT CDFs
overlaid in one plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from lorapage.replay.report import load_report
from lorapage.traces.records import OK, read_records
from lorapage.traces.stats import grouped


def _get(report: Mapping, path: str) -> float | None:
    node = report
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, (int, float)) else None


def rows(a: Mapping, b: Mapping) -> list[tuple[str, float | None, float | None]]:
    """(figure, A, B) for the headline figures, overall and for every tier either run saw."""
    paths = [
        ("requests", "meta.requests"),
        ("duration s", "meta.duration_s"),
        ("requests/s", "throughput.requests_per_s"),
        ("output tokens/s", "throughput.output_tokens_per_s"),
        ("goodput fraction", "goodput.fraction"),
        ("goodput requests/s", "goodput.requests_per_s"),
        ("status 200", "statuses.by_status.200"),
        ("status 429", "statuses.by_status.429"),
        ("status 503", "statuses.by_status.503"),
        ("status other", "statuses.by_status.other"),
        ("jain index", "fairness.jain_index"),
    ]
    for q in ("p50", "p95", "p99"):
        paths += [(f"TTFT {q} s", f"latency.overall.ttft.{q}")]
    paths += [("ITL p95 s", "latency.overall.itl.p95"), ("E2E p95 s", "latency.overall.e2e.p95")]
    tiers = sorted(set(a["latency"]["by_tier"]) | set(b["latency"]["by_tier"]))
    for tier in tiers:
        paths += [(f"[{tier}] TTFT {q} s", f"latency.by_tier.{tier}.ttft.{q}") for q in ("p50", "p95", "p99")]
        paths += [(f"[{tier}] goodput fraction", f"goodput.by_tier.{tier}.fraction")]
    return [(label, _get(a, p), _get(b, p)) for label, p in paths]


def table(a_name: str, b_name: str, data: list[tuple[str, float | None, float | None]]) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:,.4g}"

    width = max(len(label) for label, _, _ in data)
    lines = [f"{'':{width}}  {a_name[-24:]:>24}  {b_name[-24:]:>24}  {'B/A':>8}"]
    for label, x, y in data:
        ratio = fmt(y / x) if x and y is not None else "-"
        lines.append(f"{label:{width}}  {fmt(x):>24}  {fmt(y):>24}  {ratio:>8}")
    return "\n".join(lines)


def ttft_by_tier(run_dir: str | Path) -> dict[str, list[float]]:
    ok = [r for r in read_records(Path(run_dir) / "records.jsonl") if r.outcome == OK and r.ttft_s is not None]
    out = {"all": [r.ttft_s for r in ok if r.ttft_s is not None]}
    out.update({t: [r.ttft_s for r in g if r.ttft_s is not None] for t, g in grouped(ok, lambda r: r.tier).items()})
    return out


def compare(a_dir: str | Path, b_dir: str | Path, plot: str | Path | None) -> str:
    """The side-by-side table; writes the CDF overlay to ``plot`` when given."""
    a, b = load_report(a_dir), load_report(b_dir)
    text = table(str(a_dir), str(b_dir), rows(a, b))
    if plot is not None:
        from lorapage.replay.plots import cdf_overlay

        runs = {"A": ttft_by_tier(a_dir), "B": ttft_by_tier(b_dir)}
        cdf_overlay(Path(plot), runs)
        text += f"\n\nTTFT CDFs overlaid: {plot}"
    return text
