"""Clients that hang up mid-stream get their requests aborted and their pages freed."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import BASE, make_engine, running_server

from lorapage.frontend.app import STATE

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODELS = ["acme", "globex", BASE]


async def _settle(engine, server_state, free_before: int, timeout: float = 20.0) -> None:
    """Wait (bounded) until no request runs and the pool is back where it started."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        stats = engine.stats()
        if (
            not server_state.request_ids
            and stats.running == 0
            and stats.queue_depth == 0
            and engine.debug.pool_free_pages() == free_before
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(
        f"pool did not settle: free {engine.debug.pool_free_pages()} (was {free_before}), stats {engine.stats()}, "
        f"server requests {len(server_state.request_ids)}"
    )


async def test_two_hundred_streams_cut_mid_generation_free_their_pages():
    engine = make_engine()
    try:
        async with running_server(engine) as srv:
            state = srv.app[STATE]
            # Warm every adapter into the pool first: their pages are not the requests' to free.
            for model in MODELS:
                assert (await srv.post("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}))[0] == 200
            await _settle(engine, state, engine.debug.pool_free_pages())
            free_before = engine.debug.pool_free_pages()
            cut_after_first_token = 0

            async def cut(i: int) -> None:
                nonlocal cut_after_first_token
                body = {
                    "model": MODELS[i % 3],
                    "prompt": f"long story {i} " * 8,
                    "max_tokens": 200,
                    "temperature": 1.0,
                    "stream": True,
                }
                resp = await srv.session.post(srv.url + "/v1/completions", json=body, headers=srv.auth())
                assert resp.status == 200
                await resp.content.readline()  # the first event: generation has started
                cut_after_first_token += 1
                resp.close()  # drop the connection without reading the rest

            for wave in range(4):  # 4 waves of 50 concurrent streams
                await asyncio.wait_for(asyncio.gather(*(cut(wave * 50 + i) for i in range(50))), timeout=60)
            assert cut_after_first_token == 200
            await _settle(engine, state, free_before)

            # A hang-up before the first token (while queued or prefilling) frees its pages too.
            host, port = srv.url.removeprefix("http://").split(":")
            for i in range(10):
                reader, writer = await asyncio.open_connection(host, int(port))
                payload = b'{"model": "acme", "prompt": "early", "max_tokens": 200, "stream": true}'
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: {srv.auth()['Authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                writer.transport.abort()
            await _settle(engine, state, free_before)
            assert (await srv.post("/v1/completions", {"model": "acme", "prompt": "x", "max_tokens": 2}))[0] == 200
    finally:
        await engine.close()
