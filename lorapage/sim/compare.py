"""Routing policies side by side on one trace: the table ``replay run --simulate`` and
``bench/bench_fleet.py`` print."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from lorapage.sim.fleet import SEED_SLO, SimFleetConfig, fewest_replicas, simulate
from lorapage.traces.stats import Slo
from lorapage.traces.trace import TraceRequest


def compare_routers(
    trace: Sequence[TraceRequest],
    config: SimFleetConfig,
    routers: Sequence[str],
    *,
    find_most: int = 0,
    slo: Slo = SEED_SLO,
) -> list[dict]:
    """One summary per router at ``config.replicas``; with ``find_most`` > 0 each also carries
    ``fewest_replicas``: the fewest (up to ``find_most``) that meet ``slo`` (None: none does)."""
    rows = []
    for name in routers:
        cfg = replace(config, router=name)
        row = simulate(trace, cfg).summary(slo)
        if find_most:
            k = row["fewest_replicas"] = fewest_replicas(trace, cfg, most=find_most, slo=slo)
            # What binds there: how busy the devices are at the fewest and one fewer (~1: compute).
            for key, n in (("at_fewest", k), ("one_fewer", None if k is None else k - 1)):
                if n:
                    s = simulate(trace, replace(cfg, replicas=n)).summary(slo)
                    row[key] = {
                        "replicas": n,
                        "device_busy": s["device_busy"],
                        "rows_per_step": s["rows_per_step"],
                        "warm_p95": s["ttft"]["warm"]["p95"],
                    }
        rows.append(row)
    return rows


def _s(v: float | None) -> str:
    return "-" if v is None else "inf" if v == math.inf else f"{v:.3f}"


def _busy(at: dict | None) -> str:
    if not at or at["device_busy"] is None:
        return "-"
    return f"{100 * at['device_busy']:.0f}%, {at['rows_per_step']:.1f} rows"


def render_table(rows: Sequence[dict], slo: Slo = SEED_SLO) -> str:
    """A Markdown table: TTFT warm / cold percentiles (s), hit rates, SLO verdict, fewest replicas and
    how busy the devices are there and with one fewer."""
    head = (
        "| router | replicas | warm p50 | warm p95 | warm p99 | cold p50 | cold p95 | cold p99 | pool hits | "
        f"host hits | goodput | p95 warm < {slo.ttft_s:g} s and cold < {slo.ttft_cold_s:g} s | fewest replicas | "
        "there: device busy, rows a step | one fewer: warm p95, device busy, rows a step |"
    )
    lines = [head, "| --- |" + " ---: |" * 14]
    for r in rows:
        w, c = r["ttft"]["warm"], r["ttft"]["cold"]
        fewest = r.get("fewest_replicas", "-")
        cells = [
            r["router"],
            r["replicas"],
            *(_s(w[f"p{q}"]) for q in (50, 95, 99)),
            *(_s(c[f"p{q}"]) for q in (50, 95, 99)),
            f"{100 * r['hit_rate']['gpu']:.1f}%",
            f"{100 * r['hit_rate']['ram']:.1f}%",
            f"{100 * r['goodput_fraction']:.1f}%",
            "yes" if r["meets_slo"] else "no",
            "none" if fewest is None else fewest,
            _busy(r.get("at_fewest")),
            f"{_s(r['one_fewer']['warm_p95'])} s, {_busy(r['one_fewer'])}" if r.get("one_fewer") else "-",
        ]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)
