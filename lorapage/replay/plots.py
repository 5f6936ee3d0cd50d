"""PNG plots of a replay (matplotlib, no display needed): TTFT CDF by tier, latency over time with
the arrival rate, throughput and queueing over time, per-tenant shares; and the CDF overlay of
``replay compare``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402

from lorapage.traces.records import OK, Record  # noqa: E402
from lorapage.traces.stats import grouped  # noqa: E402

TENANT_BARS = 20


def _cdf(ax, values: Sequence[float], label: str) -> None:
    v = sorted(values)
    if v:
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=f"{label} (n={len(v)})")


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def ttft_cdf(path: Path, records: Sequence[Record], slo: Mapping) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in records if r.outcome == OK and r.ttft_s is not None]
    _cdf(ax, [r.ttft_s for r in ok if r.ttft_s is not None], "all")
    for tier, group in grouped(ok, lambda r: r.tier).items():
        _cdf(ax, [r.ttft_s for r in group if r.ttft_s is not None], f"tier {tier}")
    ax.axvline(slo["ttft_s"], color="grey", linestyle="--", linewidth=0.8, label=f"SLO {slo['ttft_s']:g} s")
    ax.axvline(
        slo["ttft_cold_s"], color="grey", linestyle=":", linewidth=0.8, label=f"cold SLO {slo['ttft_cold_s']:g} s"
    )
    ax.set(xlabel="time to first token (s)", ylabel="fraction of requests", title="TTFT CDF by adapter tier")
    ax.legend(fontsize=8)
    return _save(fig, path)


def latency_over_time(path: Path, records: Sequence[Record], timeline: Mapping) -> str:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    timed = [r for r in records if r.ttft_s is not None and r.sent_s is not None]
    for tier, group in grouped(timed, lambda r: r.tier).items():
        xs = [r.sent_s or 0.0 for r in group]
        ax.scatter(xs, [r.ttft_s or 0.0 for r in group], s=6, alpha=0.5, label=f"TTFT, tier {tier}")
    t = timeline["t"]
    mids = [x + timeline["bin_s"] / 2 for x in t]
    ax.plot(mids, [v if v is not None else float("nan") for v in timeline["ttft_p95"]], color="black", label="TTFT p95")
    ax.set(xlabel="time since start (s)", ylabel="TTFT (s)", title="Latency over time, with the arrival rate")
    rate = ax.twinx()
    rate.step(t, timeline["sent_per_s"], where="post", color="tab:red", alpha=0.6, label="sent / s")
    rate.set_ylabel("requests sent per second", color="tab:red")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def throughput_over_time(path: Path, timeline: Mapping) -> str:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t, mids = timeline["t"], [x + timeline["bin_s"] / 2 for x in timeline["t"]]
    ax.step(t, timeline["output_tokens_per_s"], where="post", color="tab:blue", label="output tokens / s")
    ax.set(xlabel="time since start (s)", ylabel="output tokens per second", title="Throughput and queueing")
    q = ax.twinx()
    q.step(t, timeline["in_flight"], where="post", color="tab:green", label="in flight (client)")
    for (key, values), colour in zip(timeline["server"].items(), ("tab:orange", "tab:purple", "tab:brown")):
        ys = [v if v is not None else float("nan") for v in values]
        q.plot(mids, ys, color=colour, linestyle="--", marker=".", label=f"server {key}")
    q.set_ylabel("requests")
    lines = ax.get_legend_handles_labels()
    more = q.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    return _save(fig, path)


def tenant_share(path: Path, fairness: Mapping) -> str:
    rows = sorted(fairness["tenants"].items(), key=lambda kv: -kv[1]["demand_share"])[:TENANT_BARS]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 2), 4.5))
    x = range(len(rows))
    for k, (key, label) in enumerate(
        (("weight_share", "weight share"), ("demand_share", "demand share"), ("served_share", "served share"))
    ):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[key] for _, r in rows], width=0.27, label=label)
    ax.set_xticks(list(x), [t for t, _ in rows], rotation=60, fontsize=7)
    ax.set(ylabel="share", title="Per-tenant served tokens against weight and demand")
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(out: Path, records: Sequence[Record], report: Mapping) -> list[str]:
    """Every plot of a run into ``out``; returns the file names."""
    return [
        ttft_cdf(out / "ttft_cdf.png", records, report["goodput"]["slo"]),
        latency_over_time(out / "latency_over_time.png", records, report["timeline"]),
        throughput_over_time(out / "throughput.png", report["timeline"]),
        tenant_share(out / "tenant_share.png", report["fairness"]),
    ]


def cdf_overlay(path: Path, runs: Mapping[str, Mapping[str, Sequence[float]]]) -> Path:
    """TTFT CDFs of several runs (label -> tier -> values) on one plot."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, tiers in runs.items():
        for tier, values in tiers.items():
            _cdf(ax, values, f"{label}: {tier}")
    ax.set(xlabel="time to first token (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.legend(fontsize=8)
    _save(fig, path)
    return path
