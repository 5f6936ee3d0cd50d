"""The trace format: one JSON object per line, one line per request (see ``docs/replay.md``).

```json
{"arrival_s": 0.125, "tenant": "t03", "model": "a0042", "prompt_len": 512, "max_tokens": 64,
 "system_prompt": "t03-sys0", "system_prompt_len": 200, "output_len": 58, "temperature": 0.0}
```

A request carries exactly one of ``prompt`` (text), ``prompt_ids`` (token ids) or ``prompt_len``
(a length: the driver makes deterministic token ids of that length, whose first
``system_prompt_len`` are shared by every request naming the same ``system_prompt``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import msgspec


class TraceError(ValueError):
    """A trace line is malformed; the message names the file, the line and the field."""


class TraceRequest(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One request of a trace."""

    arrival_s: float  # seconds from the trace's start
    tenant: str
    model: str  # "base", "adapter" or "base:adapter", as the server's /v1/models names them
    max_tokens: int
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    prompt_len: int | None = None
    system_prompt: str | None = None  # id of a system prompt shared by the tenant's requests
    system_prompt_len: int = 0  # its length in tokens (part of prompt_len)
    output_len: int | None = None  # the output length the source saw (informational)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None

    def check(self) -> None:
        """Raise :class:`ValueError` naming the first field that cannot be replayed."""
        given = [name for name in ("prompt", "prompt_ids", "prompt_len") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, prompt_ids, prompt_len; got {given or 'none'}")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number >= 0; got {self.arrival_s}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.prompt_len is not None and self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1; got {self.prompt_len}")
        if not 0 <= self.system_prompt_len <= (self.prompt_len or 0):
            raise ValueError(
                f"system_prompt_len must be between 0 and prompt_len ({self.prompt_len}); got {self.system_prompt_len}"
            )
        if not self.tenant or not self.model:
            raise ValueError("tenant and model must be non-empty")

    def sampling_fields(self) -> dict:
        """The OpenAI sampling fields this request sets (absent ones are left to the server)."""
        fields = ("temperature", "top_p", "top_k", "seed", "stop")
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TraceRequest)


def dumps(req: TraceRequest) -> bytes:
    return _encoder.encode(req)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` as JSONL; returns how many were written."""
    n = 0
    with open(path, "wb") as f:
        for req in requests:
            f.write(_encoder.encode(req) + b"\n")
            n += 1
    return n


def parse_line(line: bytes | str, where: str = "<trace>") -> TraceRequest:
    """One request from one JSON line; :class:`TraceError` says where and what is wrong."""
    try:
        req = _decoder.decode(line)
        req.check()
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None
    return req


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace in file order (blank lines skipped); at most ``limit``."""
    out: list[TraceRequest] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(parse_line(line, f"{path}:{lineno}"))
    if not out:
        raise TraceError(f"{path}: the trace holds no requests")
    return out
