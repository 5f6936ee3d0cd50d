"""Bodies are bounded as they stream (issue 26, case 10): the fleet ingress read a body without a
Content-Length whole before it looked at its size (256 MiB for a 4 MiB limit), and admin bodies
had no limit of their own. A raw HTTP client streams a chunked body and counts what it got to
send before the answer came: the fleet's real ingress and ``lorapage serve`` (one aiohttp front
end) stop reading at the limit and answer 413."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from front_end_cases import replica_less_ingress
from server_harness import ADMIN_KEY, KEYS, assert_openai_error, make_engine, running_server

from lorapage.frontend.bodies import ADMIN_MAX_BODY_BYTES
from lorapage.frontend.run import start

_CHUNK = b"x" * (64 << 10)


async def _post_streaming(url: str, path: str, key: str, total: int) -> tuple[int, dict, int]:
    """POST ``total`` bytes as a chunked body to ``url`` + ``path``, writing until the answer
    comes (or the server stops reading); returns the status, the JSON answer and the bytes sent."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    )
    answer = asyncio.ensure_future(_read_response(reader))
    sent = 0
    try:
        while sent < total and not answer.done():
            writer.write(b"%x\r\n%s\r\n" % (len(_CHUNK), _CHUNK))
            sent += len(_CHUNK)
            drained = asyncio.ensure_future(writer.drain())
            await asyncio.wait([drained, answer], return_when=asyncio.FIRST_COMPLETED, timeout=30)
            if not drained.done():
                drained.cancel()
                break  # the server reads no more: the answer is coming, or already here
            if drained.exception() is not None:
                break  # the server closed the connection
        if not answer.done() and sent >= total:
            writer.write(b"0\r\n\r\n")
        status, body = await asyncio.wait_for(answer, 60)
    finally:
        writer.close()
    return status, body, sent


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        raw = await reader.readexactly(int(headers["content-length"]))
    else:  # chunked
        raw = b""
        while size := int((await reader.readline()).strip(), 16):
            raw += await reader.readexactly(size + 2)
            raw = raw[:-2]
    return status, json.loads(raw)


@asynccontextmanager
async def _fleet_ingress(max_body_bytes: int) -> AsyncIterator[str]:
    """The fleet's real ingress on 127.0.0.1, with no engine replicas behind it (nothing here reaches one)."""
    pytest.importorskip("ray")
    runner, port = await start(replica_less_ingress(max_body_bytes).app, ("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_fleet_ingress_stops_reading_a_chunked_body_at_its_limit():
    limit, total = 1 << 20, 64 << 20
    async with _fleet_ingress(limit) as url:
        status, body, sent = await _post_streaming(url, "/v1/completions", KEYS["alpha"], total)
        assert status == 413, body
        assert_openai_error(body, 413)
        assert body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
        # What the kernel's socket buffers take in is all that was sent past the limit.
        assert sent < total // 4, f"{sent >> 20} MiB were sent for a {limit >> 20} MiB limit"

        status, body, sent = await _post_streaming(url, "/v1/adapters", ADMIN_KEY, 16 << 20)
        assert status == 413 and str(ADMIN_MAX_BODY_BYTES) in body["error"]["message"], body


async def test_admin_bodies_have_a_limit_of_their_own():
    engine = make_engine()
    try:
        async with running_server(engine) as srv:
            status, body, _ = await _post_streaming(srv.url, "/v1/adapters", ADMIN_KEY, 16 << 20)
            assert status == 413, body
            assert_openai_error(body, 413)
            assert str(ADMIN_MAX_BODY_BYTES) in body["error"]["message"], body
            big = {"id": "x", "tenant": "alpha", "source": "/" + "a" * (1 << 20)}  # under --max-body-bytes
            status, body, _ = await srv.post("/v1/adapters", big, tenant=None, headers=srv.admin())
            assert status == 413 and body["error"]["code"] == "request_too_large", body
            status, body, _ = await srv.request(
                "PUT", "/v1/adapters/acme/current", headers=srv.admin(), body={"version": 1, "pad": "a" * (1 << 20)}
            )
            assert status == 413, body
    finally:
        await engine.close()
