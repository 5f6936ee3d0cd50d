"""The request log (``--access-log FILE|-``): one JSON object per answered request, opt-in.

Each line: ``ts`` (UTC, ISO), ``request_id`` (what the client was told), ``method``, ``route`` (the
route's pattern, not the path: no adapter ids or query strings from the URL), ``status``,
``e2e_s``, and for generation requests ``tenant``, ``model``, ``adapter`` (``id@N``, null for the
base), ``tier`` (where the adapter was when the request started), ``prompt_tokens``,
``output_tokens`` and ``ttft_s``. Never prompt or output text, never a key: an SRE's record of who
asked what of which adapter version, how fast, and how it ended, safe to ship to a log store.

Lines are written whole with one ``write`` on the event loop (a file opened for append, line
buffered), so concurrent requests never interleave inside a line.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO, Any

import msgspec
from aiohttp import web

from lorapage.frontend.error_json import Handler

# request[JOB]: the generation request's Job, set by ServerState.run (a typed key where aiohttp has them).
JOB: Any = web.RequestKey("lorapage_job", object) if hasattr(web, "RequestKey") else "lorapage_job"
# The status a streamed answer's headers carried (set once they are sent): what a stream the client
# cut mid-way is recorded with, since its handler ends cancelled rather than returning a response.
SENT: Any = web.RequestKey("lorapage_sent_status", int) if hasattr(web, "RequestKey") else "lorapage_sent_status"
CLIENT_GONE = 499  # nginx's "client closed request": cut before any answer was sent


def status_when_cut(request: web.Request) -> int:
    """The status a request whose client went away is recorded with: its stream's (200) when the
    stream had started, else 499."""
    return int(request.get(SENT, CLIENT_GONE))


class AccessLog:
    """Writes the lines to ``target``: a path (appended to) or ``-`` (standard output)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._out: IO[str] = sys.stdout if target == "-" else open(target, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._out.write(msgspec.json.encode(record).decode() + "\n")

    def close(self) -> None:
        if self._out is not sys.stdout:
            self._out.close()
        else:
            self._out.flush()


def record(request: web.Request, status: int, started: float) -> dict[str, Any]:
    """The line for one answered request (see the module's docstring)."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    return line(request.method, route, status, time.monotonic() - started, request.get(JOB))


def line(method: str, route: str, status: int, e2e_s: float, job: Any | None) -> dict[str, Any]:
    """The line of a request answered with ``status`` after ``e2e_s`` seconds; ``job`` (a
    :class:`~lorapage.frontend.generation.Job`) for a generation request, else None. Shared by
    ``lorapage serve`` and the fleet's ingress, so both write one format."""
    out: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
        "request_id": None,
        "method": method,
        "route": route,
        "status": status,
        "e2e_s": round(e2e_s, 6),
    }
    if job is not None:
        ttft = job.ttft_s
        out.update(
            request_id=job.request_id,
            tenant=job.tenant,
            model=job.model,
            adapter=_version(job.adapter, job.adapter_version),
            tier=job.tier,
            prompt_tokens=job.prompt_tokens,
            output_tokens=job.generated,
            ttft_s=None if ttft is None else round(ttft, 6),
        )
    return out


def _version(adapter: str | None, version: int | None) -> str | None:
    """``id@N`` of the version a request ran on (None: the base model)."""
    if adapter is None or version is None:
        return adapter
    return f"{adapter.partition('@')[0]}@{version}"


def access_log_middleware(log: AccessLog):
    """A middleware writing each answer's line (outermost: it sees the status the client got)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = status_when_cut(request)
            raise
        finally:
            log.write(record(request, status, started))

    return middleware
