"""The soak's attacks of issue 38 (tenant isolation, third pass), beside the edge attacks of
issue 26 in :mod:`bench_soak`: each one a tenant with an ordinary quota doing what the review
found costly, and what it must get.

- ``grammar_compile_flood``: four concurrent requests, each with a fresh ~39 KB JSON schema (a
  compile each, nothing cached), from a tenant with rpm 60 and max_concurrency 4: answered 200,
  400 (refused, or past the compile deadline) or 429, never 5xx; its compiles take its share of
  the grammar threads only.
- ``usage_route_flood``: 20 concurrent ``GET /v1/usage`` from a tenant with rpm 1: at most one
  answered, the rest 429.
- ``owner_write_flood``: 20 concurrent check-prompt PUTs on its own adapter from an owner with
  rpm 1: at most one answered, the rest 429 (and no audit row for the unchanged ones).
- ``over_cap_connections``: from another loopback address (127.0.0.2, so the good tenants on
  127.0.0.1 keep their own count), connections up to the per-address cap are held open, then 50
  more each ask for ``/health``: every one of those is answered 429 and closed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from lorapage.tiny import demo_adapter_dirs

# The soak run (bench_soak.Soak: its URL, keys and HTTP session) and its tally of answers; typed
# loosely so this module, which bench_soak imports, imports no script back.
Soak = Any
Tally = Any

TENANTS = {  # name -> its limits in the tenants file
    "compiler": "rpm = 60\nmax_concurrency = 4\n",
    "counter": "rpm = 1\n",
    "owner": "rpm = 1\n",
}
CONNECTION_CAP = 160  # the server's --max-connections-per-ip in the soak
SERVER_FLAGS = ["--max-connections-per-ip", str(CONNECTION_CAP)]
OVER_CAP = 50
FLOOD = 20
ATTACKER = "127.0.0.2"  # a loopback address of its own: the cap is per address


def big_schema() -> dict:
    """A JSON schema of about 39 KB, with names no earlier schema had (so it is compiled afresh)."""
    salt = secrets.token_hex(3)
    props = {
        f"f_{salt}_{i}": {"type": "string", "pattern": f"^[a-z]{{2,8}}-{i}[0-9]{{1,4}}$", "maxLength": 24}
        for i in range(420)
    }
    return {"type": "object", "properties": props, "required": list(props)[:40], "additionalProperties": False}


async def prepare(soak: Soak) -> None:
    """The owner's adapter, registered before the clean run."""
    root = soak.root / "owned"
    shutil.copytree(demo_adapter_dirs()["acme"], root)
    body = {"id": "owned", "path": str(root), "tenant": "owner"}
    async with soak.session.post(soak.url + "/v1/adapters", json=body, headers=soak.auth("admin")) as resp:
        if resp.status not in (200, 201):
            raise SystemExit(f"could not register the owner's adapter: {resp.status} {await resp.text()}")


def _flood_verdict(statuses: Counter[int], allowed: set[int], most_200: int | None = None) -> tuple:
    if not set(statuses) <= allowed or (most_200 is not None and statuses[200] > most_200):
        return 0, str(dict(statuses))
    return "flood", "contained"


def isolation_cases(soak: Soak, tally: Tally) -> dict[str, tuple[Callable[[], Awaitable], set]]:
    """Name -> (the attack, returning what it got, and the answers it may get)."""

    async def status_of(method: str, path: str, who: str, body: object) -> int:
        headers = {**soak.auth(who), "Content-Type": "application/json"}
        async with soak.session.request(method, soak.url + path, data=json.dumps(body), headers=headers) as resp:
            await resp.read()
            tally.statuses[resp.status] += 1
            return resp.status

    async def compile_flood():
        bodies = [
            {
                "model": "base",
                "messages": [{"role": "user", "content": "fill it in"}],
                "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema()}},
            }
            for _ in range(4)
        ]
        got = await asyncio.gather(*(status_of("POST", "/v1/chat/completions", "compiler", b) for b in bodies))
        return _flood_verdict(Counter(got), {200, 400, 429})

    async def usage_flood():
        got = await asyncio.gather(*(status_of("GET", "/v1/usage", "counter", None) for _ in range(FLOOD)))
        return _flood_verdict(Counter(got), {200, 429}, most_200=1)

    async def owner_flood():
        path, body = "/v1/adapters/owned/check_prompts", {"prompts": ["Hello there"]}
        got = await asyncio.gather(*(status_of("PUT", path, "owner", body) for _ in range(FLOOD)))
        return _flood_verdict(Counter(got), {200, 429}, most_200=1)

    async def over_cap():
        held = [await _open(soak) for _ in range(CONNECTION_CAP)]
        try:
            answers = await asyncio.gather(*(_over_cap_answer(soak) for _ in range(OVER_CAP)))
        finally:
            for _, writer in held:
                writer.close()
        for status in answers:
            tally.statuses[status] += 1
        return _flood_verdict(Counter(answers), {429})

    contained = {("flood", "contained")}
    return {
        "grammar_compile_flood": (compile_flood, contained),
        "usage_route_flood": (usage_flood, contained),
        "owner_write_flood": (owner_flood, contained),
        "over_cap_connections": (over_cap, contained),
    }


async def _open(soak: Soak) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.bind((ATTACKER, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (soak.host, soak.port))
    return await asyncio.open_connection(sock=sock)


async def _over_cap_answer(soak: Soak) -> int:
    reader, writer = await _open(soak)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = await asyncio.wait_for(reader.read(), 30.0)
    except ConnectionError:
        return 0  # reset: not answered
    finally:
        writer.close()
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/") else 0
