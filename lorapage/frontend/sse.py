"""Server-sent events in OpenAI's streaming format: ``data: <json>\\n\\n`` ... ``data: [DONE]``.

:func:`frame` and :data:`DONE` are the bytes on the wire, shared by every front end (the aiohttp
server, the Ray Serve ingress); :class:`EventStream` writes them to an aiohttp response.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

_encoder = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"

# Headers of every SSE answer besides the request's own.
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies: do not hold the stream back
}


def frame(event: msgspec.Struct | bytes) -> bytes:
    """One event as its SSE frame (bytes are taken as JSON already encoded)."""
    data = event if isinstance(event, bytes) else _encoder.encode(event)
    return b"data: " + data + b"\n\n"


class EventStream:
    """One SSE response over aiohttp. Each :meth:`write` is written and flushed at once (no buffering)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})

    async def open(self, request: web.Request) -> None:
        await self.response.prepare(request)

    async def write(self, data: bytes) -> None:
        await self.response.write(data)

    async def close(self) -> None:
        await self.response.write_eof()
