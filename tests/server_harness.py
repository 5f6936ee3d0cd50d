"""A real lorapage server on an ephemeral 127.0.0.1 port, over the tiny model and demo adapters.

Tenants: ``alpha`` owns the ``acme`` and ``globex`` demo adapters, ``beta`` owns ``initech``,
``gamma`` may use the base model only, at two requests per minute.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest_asyncio

from lorapage import Engine, EngineConfig
from lorapage.server import Access, create_app, hash_key
from lorapage.server.run import start
from lorapage.tenants import TenantsConfig
from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "gamma": "key-gamma"}
ADMIN_KEY = "key-admin"
TENANTS_TOML = f"""
[admin]
key_sha256 = ["{hash_key(ADMIN_KEY)}"]

[tenants.alpha]
key_sha256 = ["{hash_key(KEYS["alpha"])}"]
adapters = ["acme", "globex"]

[tenants.beta]
key_sha256 = ["{hash_key(KEYS["beta"])}"]
adapters = ["initech"]

[tenants.gamma]  # base model only, two requests per minute
key_sha256 = ["{hash_key(KEYS["gamma"])}"]
adapters = []
rpm = 2
"""
BASE = TINY_BASE_DIR.name


def make_engine(**overrides: Any) -> Engine:
    """The tiny base with every demo adapter registered (loaded lazily, as in production)."""
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), **overrides))
    for name, path in demo_adapter_dirs().items():
        engine.add_adapter(name, path)
    return engine


def make_access() -> Access:
    return Access(TenantsConfig.from_toml(TENANTS_TOML))


def expected_text(model: str) -> str:
    """What greedy decoding answers with: the adapter's marker phrase, or the base phrase."""
    return DEMO_MARKERS.get(model.rpartition(":")[2], BASE_PHRASE)


@dataclass
class Server:
    url: str
    engine: Engine
    app: Any
    session: aiohttp.ClientSession

    @staticmethod
    def auth(tenant: str = "alpha") -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}

    @staticmethod
    def admin() -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    async def post(self, path: str, body: Any, tenant: str | None = "alpha", headers: dict | None = None):
        """POST ``body`` (bytes sent as-is, anything else as JSON); returns (status, parsed JSON, headers)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(self.auth(tenant) if tenant else {}), **(headers or {})}
        async with self.session.post(self.url + path, data=data, headers=hdrs) as resp:
            text = await resp.text()
            return resp.status, _json_or_text(text), resp.headers

    async def request(self, method: str, path: str, headers: dict | None = None, body: Any = None):
        async with self.session.request(method, self.url + path, headers=headers, json=body) as resp:
            return resp.status, _json_or_text(await resp.text()), resp.headers


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def assert_openai_error(body: Any, status: int, param: str | None = None) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, err


@asynccontextmanager
async def running_server(engine: Engine, access: Access | None = None, **app_options: Any) -> AsyncIterator[Server]:
    app = create_app(engine, access or make_access(), **app_options)
    runner, port = await start(app, "127.0.0.1", 0)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    try:
        yield Server(f"http://127.0.0.1:{port}", engine, app, session)
    finally:
        await session.close()
        await runner.cleanup()


async def read_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The JSON payloads of an SSE response, up to ``[DONE]`` (which must come last)."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[Server]:
    """One server per test module (import this fixture into the module to use it)."""
    engine = make_engine()
    async with running_server(engine) as srv:
        yield srv
    await engine.close()
