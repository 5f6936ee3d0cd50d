"""A replay's report directory: ``records.jsonl`` (one line per request), ``report.json`` (every
figure), ``report.md`` (the same, readable) and PNG plots (:mod:`lorapage.replay.plots`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from lorapage.replay.driver import RunResult
from lorapage.replay.scrape import delta, highlights
from lorapage.traces import stats
from lorapage.traces.records import Record, write_records
from lorapage.traces.trace import TraceRequest

REPORT_VERSION = 1
_NICE_BINS = (0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)
TENANT_ROWS = 20  # report.md lists this many tenants (report.json has all)


def prompt_tokens_of(req: TraceRequest) -> int:
    """Prompt length as the trace states it (text: its characters, an upper bound on tokens)."""
    if req.prompt_ids is not None:
        return len(req.prompt_ids)
    if req.prompt_len is not None:
        return req.prompt_len
    return len(req.prompt or "")


def auto_bin_s(duration_s: float) -> float:
    """A round bin width giving about 60 bins over the run."""
    return next((b for b in _NICE_BINS if duration_s / b <= 60), _NICE_BINS[-1])


def build_report(
    trace: Sequence[TraceRequest],
    result: RunResult,
    *,
    meta: Mapping,
    slo: stats.Slo,
    weights: Mapping[str, float] | None = None,
    bin_s: float | None = None,
) -> dict:
    """Every figure of a run, as ``report.json`` holds it."""
    records = result.records
    duration = stats.span_s(records)
    demand: Counter[str] = Counter()
    for req in trace:
        demand[req.tenant] += prompt_tokens_of(req) + req.max_tokens
    sent = [r for r in records if r.sent_s is not None]
    before, after = result.counters_before or {}, result.counters_after or {}
    changes = delta(before, after)
    return {
        "version": REPORT_VERSION,
        "meta": {**meta, "requests": len(records), "interrupted": result.interrupted, "duration_s": round(duration, 6)},
        "statuses": stats.statuses(records),
        "throughput": stats.throughput(records, duration),
        "goodput": stats.goodput(records, slo, duration),
        "latency": {
            "overall": stats.latency(records),
            "by_tier": {t: stats.latency(g) for t, g in stats.grouped(records, lambda r: r.tier).items()},
            "by_tenant": {t: stats.latency(g) for t, g in stats.grouped(records, lambda r: r.tenant).items()},
        },
        "fairness": stats.fairness(records, demand, weights or {}),
        "send_lateness": stats.summarize([r.sent_s - r.scheduled_s for r in sent if r.sent_s is not None]),
        "timeline": stats.timeline(records, bin_s or auto_bin_s(duration), result.samples),
        "server": {
            "note": result.metrics_note,
            "before": result.counters_before,
            "after": result.counters_after,
            "delta": {k: v for k, v in changes.items() if v != 0},
            "highlights": highlights(before, after),
        },
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _latency_rows(label: str, groups: Mapping[str, Mapping]) -> list[str]:
    head = f"| {label} | n | TTFT p50 | p90 | p95 | p99 | ITL p50 | p95 | p99 | E2E p50 | p95 | p99 |"
    rows = [head, "|" + " --- |" + " ---: |" * 11]
    for name, lat in groups.items():
        t, i, e = lat["ttft"], lat["itl"], lat["e2e"]
        cells = [t["count"], *(_ms(t[f"p{q}"]) for q in (50, 90, 95, 99))]
        cells += [*(_ms(i[f"p{q}"]) for q in (50, 95, 99)), *(_ms(e[f"p{q}"]) for q in (50, 95, 99))]
        rows.append(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    return rows


def render_markdown(report: Mapping) -> str:
    """``report.md``: the run, statuses, throughput and goodput, latency by tier and tenant,
    fairness, server counters and the plots. Latencies in milliseconds."""
    m, st, tp, gp = report["meta"], report["statuses"], report["throughput"], report["goodput"]
    lines = [f"# Replay: {m.get('trace', '')}", ""]
    lines += [f"- {k}: `{json.dumps(v)}`" for k, v in m.items()]
    lines += ["", "## Statuses", "", "| 200 | 429 | 503 | other | none |", "| ---: | ---: | ---: | ---: | ---: |"]
    lines.append("| " + " | ".join(str(st["by_status"][k]) for k in ("200", "429", "503", "other", "none")) + " |")
    lines += ["", "Outcomes: " + ", ".join(f"{k} {v}" for k, v in st["by_outcome"].items()), ""]
    slo = gp["slo"]
    lines += [
        "## Throughput and goodput",
        "",
        f"- {_num(tp['requests_per_s'])} requests/s, {_num(tp['output_tokens_per_s'], 1)} output tokens/s, "
        f"{_num(tp['prompt_tokens_per_s'], 1)} prompt tokens/s over {_num(tp['duration_s'], 1)} s",
        f"- goodput (TTFT <= {slo['ttft_s']:g} s resident, <= {slo['ttft_cold_s']:g} s for "
        f"{', '.join(slo['cold_tiers'])}): {gp['good']} of {gp['sent']} sent "
        f"({_num(100 * gp['fraction'] if gp['fraction'] is not None else None, 1)}%), "
        f"{_num(gp['requests_per_s'])} requests/s",
    ]
    for tier, g in gp["by_tier"].items():
        frac = _num(100 * g["fraction"] if g["fraction"] is not None else None, 1)
        lines.append(f"  - tier `{tier}`: {g['good']} of {g['sent']} ({frac}%)")
    lat = report["latency"]
    lines += ["", "## Latency (ms)", ""] + _latency_rows("tier", {"all": lat["overall"], **lat["by_tier"]})
    busiest = sorted(lat["by_tenant"].items(), key=lambda kv: -kv[1]["ttft"]["count"])[:TENANT_ROWS]
    lines += ["", f"By tenant (the {len(busiest)} with the most answers):", ""] + _latency_rows("tenant", dict(busiest))
    fair = report["fairness"]
    lines += [
        "",
        f"## Fairness (Jain's index of served / weight: {_num(fair['jain_index'], 3)})",
        "",
        "| tenant | weight share | demand share | served share | served tokens | served / weight |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t, row in sorted(fair["tenants"].items(), key=lambda kv: -kv[1]["demand_share"])[:TENANT_ROWS]:
        lines.append(
            f"| {t} | {_num(row['weight_share'], 3)} | {_num(row['demand_share'], 3)} | "
            f"{_num(row['served_share'], 3)} | {row['served_tokens']} | {_num(row['served_over_weight'], 2)} |"
        )
    lines += ["", "## Server counters (before -> after)", ""]
    srv = report["server"]
    if srv["note"]:
        lines.append(f"Not available: {srv['note']}.")
    else:
        lines += ["| series | before | after | change |", "| --- | ---: | ---: | ---: |"]
        before, after = srv["before"] or {}, srv["after"] or {}
        for key in srv["highlights"]:
            lines.append(f"| `{key}` | {before.get(key, 0):g} | {after.get(key, 0):g} | {srv['delta'][key]:+g} |")
    late = report["send_lateness"]
    lines += ["", f"Send lateness (the driver's own delay) p50 {_ms(late['p50'])} ms, max {_ms(late['max'])} ms.", ""]
    if report.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, records: Sequence[Record], report: dict, *, plots: bool = True) -> Path:
    """Write the report directory; returns its path. Plots need matplotlib (``lorapage[replay]``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "records.jsonl", records)
    report["plots"] = []
    if plots:
        try:
            from lorapage.replay import plots as plotting
        except ImportError as exc:  # matplotlib missing: the figures are all in report.json anyway
            report["plots_note"] = f"no plots: {exc}; pip install 'lorapage[replay]'"
        else:
            report["plots"] = plotting.write_plots(out, records, report)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    return out


def load_report(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "report.json").read_text())
