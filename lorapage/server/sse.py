"""Server-sent events in OpenAI's streaming format: ``data: <json>\\n\\n`` ... ``data: [DONE]``."""

from __future__ import annotations

import msgspec
from aiohttp import web

_encoder = msgspec.json.Encoder()


class EventStream:
    """One SSE response. Each :meth:`send` is written and flushed at once (no buffering)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # reverse proxies: do not hold the stream back
                **headers,
            },
        )

    async def open(self, request: web.Request) -> None:
        await self.response.prepare(request)

    async def send(self, event: msgspec.Struct | bytes) -> None:
        data = event if isinstance(event, bytes) else _encoder.encode(event)
        await self.response.write(b"data: " + data + b"\n\n")

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
