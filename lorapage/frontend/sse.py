"""Server-sent events in OpenAI's streaming format: ``data: <json>\\n\\n`` ... ``data: [DONE]``.

:func:`frame` and :data:`DONE` are the bytes on the wire, shared by every front end (the aiohttp
server, the Ray Serve ingress); :func:`event_stream` is the aiohttp response they are written to.
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


def event_stream(headers: dict[str, str]) -> web.StreamResponse:
    """One SSE response over aiohttp (``headers``: the answer's own besides :data:`SSE_HEADERS`);
    each ``write`` is written and flushed at once (no buffering), ``write_eof`` ends it."""
    return web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
