"""A real lorapage server on an ephemeral 127.0.0.1 port, over the tiny model and demo adapters.

Tenants: ``alpha`` may use the ``acme`` and ``globex`` demo adapters (and have adapters registered
from the s3 tests' bucket), ``beta`` ``initech``, ``gamma`` the base model only, at two requests
per minute. ``METRICS_KEY`` opens ``/metrics`` only.
The module fixture's server may register adapters over HTTP from under ``Server.adapter_root``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio

from lorapage import Engine, EngineConfig
from lorapage.frontend import Access, hash_key
from lorapage.frontend.run import start
from lorapage.serve import create_app
from lorapage.sources import AdapterRoots
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "gamma": "key-gamma"}
ADMIN_KEY = "key-admin"
METRICS_KEY = "key-metrics"
TENANTS_TOML = f"""
[admin]
key_sha256 = ["{hash_key(ADMIN_KEY)}"]

[metrics]
key_sha256 = ["{hash_key(METRICS_KEY)}"]

[tenants.alpha]
key_sha256 = ["{hash_key(KEYS["alpha"])}"]
adapters = ["acme", "globex"]
s3_buckets = ["adapters"]  # the s3 tests' bucket (remote_sources.s3_bucket)

[tenants.beta]
key_sha256 = ["{hash_key(KEYS["beta"])}"]
adapters = ["initech"]

[tenants.gamma]  # base model only, two requests per minute
key_sha256 = ["{hash_key(KEYS["gamma"])}"]
adapters = []
rpm = 2
"""
BASE = TINY_BASE_DIR.name


def make_roots(*values: str | Path) -> AdapterRoots:
    """``--adapter-root`` values (``DIR`` or ``TENANT=DIR``), the demo adapters being the operator's."""
    return AdapterRoots.parse(map(str, values), operator=demo_adapter_dirs().values())


def make_engine(adapter_roots: AdapterRoots | None = None, **overrides: Any) -> Engine:
    """The tiny base with every demo adapter registered (loaded lazily, as in production).
    ``adapter_roots`` (:func:`make_roots`): where HTTP registration may read directories; without
    it none (the engine's embedded callers may name any)."""
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), **overrides), adapter_roots=adapter_roots)
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
    adapter_root: Path | None = None  # where POST /v1/adapters may read from

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


# OpenAI's error "type" for each status lorapage answers with.
OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}


def assert_openai_error(body: Any, status: int, param: str | None = None) -> None:
    """``body`` is OpenAI's error JSON for ``status`` (and names ``param``, when one is given)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == OPENAI_ERROR_TYPES[status], err
    assert isinstance(err["code"], str) and err["code"], err
    if param is not None:
        assert err["param"] == param, err


@asynccontextmanager
async def running_server(engine: Engine, access: Access | None = None, **app_options: Any) -> AsyncIterator[Server]:
    """A server over ``engine``; ``app_options`` go to :func:`create_app` (``max_body_bytes``...)."""
    app = create_app(engine, access or make_access(), **app_options)
    runner, port = await start(app, ("127.0.0.1", 0))
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    shared = engine.debug.adapter_roots.shared
    try:
        yield Server(f"http://127.0.0.1:{port}", engine, app, session, shared[0] if shared else None)
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
    root = Path(tempfile.mkdtemp(prefix="lorapage-adapter-root-")).resolve()
    engine = make_engine(make_roots(root))
    try:
        async with running_server(engine) as srv:
            yield srv
    finally:
        await engine.close()
        shutil.rmtree(root)
