"""What happened to each request of a replay: filled in by a target, written as JSONL.

Every request of the trace ends as exactly one :class:`Record`, whatever became of it
(``outcome``): ``ok``; ``http_error`` (answered with a non-200 status, in ``status``);
``stream_error`` (the stream started, then carried an error or broke off); ``client_error`` (no
answer: connection refused, reset...); ``timeout``; ``interrupted`` (in flight at Ctrl-C);
``not_sent`` (its time had not come at Ctrl-C).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

OK, HTTP_ERROR, STREAM_ERROR, CLIENT_ERROR = "ok", "http_error", "stream_error", "client_error"
TIMEOUT, INTERRUPTED, NOT_SENT = "timeout", "interrupted", "not_sent"
UNKNOWN_TIER = "unknown"  # the target did not say (no x-adapter-tier header)


@dataclass
class Result:
    """A request in flight, as a target sees it; times are the driver's clock readings.

    The target fills it as the answer streams in, so what it had when the request was cut short
    (timeout, Ctrl-C) is still reported.
    """

    status: int = 0  # HTTP status (the embedded engine: the status the server would answer)
    outcome: str = ""
    tier: str = UNKNOWN_TIER
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # each arrival of new tokens
    end: float | None = None

    def chunk(self, now: float, total: int) -> None:
        """New tokens arrived at ``now``, ``total`` output tokens so far (at least one more)."""
        self.chunk_times.append(now)
        self.output_tokens = max(total, self.output_tokens + 1)


class Record(msgspec.Struct, omit_defaults=False):
    """One request's fate; times in seconds, ``*_s`` from the start of the run."""

    index: int  # line of the trace (0-based, among its requests)
    tenant: str
    model: str
    tier: str
    outcome: str
    status: int
    scheduled_s: float  # when the trace (over --speed) said to send it; closed loop: when sent
    sent_s: float | None
    end_s: float | None
    ttft_s: float | None  # sent to the first output token
    e2e_s: float | None  # sent to the end of a complete answer
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    chunks_s: list[float]  # each token arrival, from sent_s (chunks_s[0] == ttft_s)
    error: str | None = None

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive arrivals of tokens."""
        c = self.chunks_s
        return [b - a for a, b in zip(c, c[1:])]


def to_record(
    index: int, tenant: str, model: str, max_tokens: int, scheduled: float, sent: float | None, res: Result, t0: float
) -> Record:
    """The record of a finished (or cut-short) request; clock readings become run-relative."""
    chunks = [round(t - sent, 6) for t in res.chunk_times] if sent is not None else []
    return Record(
        index=index,
        tenant=tenant,
        model=model,
        tier=res.tier,
        outcome=res.outcome,
        status=res.status,
        scheduled_s=round(scheduled - t0, 6),
        sent_s=round(sent - t0, 6) if sent is not None else None,
        end_s=round(res.end - t0, 6) if res.end is not None else None,
        ttft_s=chunks[0] if chunks else None,
        e2e_s=round(res.end - sent, 6) if res.outcome == OK and res.end is not None and sent is not None else None,
        prompt_tokens=res.prompt_tokens,
        output_tokens=res.output_tokens,
        max_tokens=max_tokens,
        chunks_s=chunks,
        error=res.error,
    )


_encoder = msgspec.json.Encoder()


def write_records(path: str | Path, records: Iterable[Record]) -> None:
    with open(path, "wb") as f:
        for rec in records:
            f.write(_encoder.encode(rec) + b"\n")


def read_records(path: str | Path) -> list[Record]:
    decoder = msgspec.json.Decoder(Record)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]
