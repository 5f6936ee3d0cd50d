"""The per-address connection cap on each event loop the server runs (issue 38, finding 8):
``lorapage serve`` runs uvloop where it is installed, whose transports are not asyncio's classes,
and an over-cap connection there must still get its 429, not a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import pytest
import uvloop
from aiohttp import web
from server_harness import assert_openai_error

from lorapage.frontend.edge import EDGE_LIMITS, EdgeLimits
from lorapage.frontend.run import start

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
CAP = 2


async def _health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()


async def _over_the_cap() -> tuple[list[bytes], bytes]:
    app = web.Application()
    app.router.add_get("/health", _health)
    app[EDGE_LIMITS] = EdgeLimits(max_connections_per_ip=CAP)
    runner, port = await start(app, ("127.0.0.1", 0))
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CAP)]
        refused = await asyncio.gather(*(_get(port) for _ in range(20)))
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.2)  # the server sees them go
        return refused, await _get(port)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("loop", LOOPS)
def test_over_cap_connections_are_answered_429_on_every_loop(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO), asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        refused, after = runner.run(_over_the_cap())
    for answer in refused:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429") and b"Retry-After: 1" in head, answer[:200]
        assert_openai_error(json.loads(body), 429)
    assert after.startswith(b"HTTP/1.1 200"), after[:200]
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks, tracebacks
    assert sum("refusing connections" in r.getMessage() for r in caplog.records) == 1  # one line per episode
