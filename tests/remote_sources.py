"""Real servers on 127.0.0.1 that adapter sources fetch from: an aiohttp file server that can
stall, truncate or refuse, and moto's S3 server; and real PEFT adapters with distinct digests."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from lorapage.adapters.digest import ADAPTER_FILES
from lorapage.tiny import demo_adapter_dirs


def make_adapter(dest: Path, variant: int = 0) -> Path:
    """A real PEFT adapter directory; ``variant`` makes its content (and digest) distinct."""
    dest.mkdir(parents=True)
    src = demo_adapter_dirs()["acme"]
    shutil.copy(src / "adapter_config.json", dest / "adapter_config.json")
    weights = (src / "adapter_model.safetensors").read_bytes()
    (dest / "adapter_model.safetensors").write_bytes(weights + b" " * variant)
    return dest


def cache_listing(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir())


class FileServer:
    """Serves ``files`` (url path -> bytes); counts hits, and can stall, truncate, drop the
    Content-Length or refuse a path."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.hits: Counter[str] = Counter()
        self.truncate: set[str] = set()
        self.chunked: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()
        self.base = ""

    def publish(self, prefix: str, adapter: Path) -> str:
        for name in ADAPTER_FILES:
            self.files[f"{prefix}/{name}"] = (adapter / name).read_bytes()
        return f"{self.base}/{prefix}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        self.hits[path] += 1
        await self.gate.wait()
        if path not in self.files:
            return web.Response(status=404)
        data = self.files[path]
        resp = web.StreamResponse()
        if path in self.chunked:
            resp.enable_chunked_encoding()
        else:
            resp.content_length = len(data)
        await resp.prepare(request)
        if path in self.truncate:
            await resp.write(data[: len(data) // 2])
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write(data)
        await resp.write_eof()
        return resp


async def start_server(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def files() -> AsyncIterator[FileServer]:
    """A :class:`FileServer` on a free 127.0.0.1 port."""
    server = FileServer()
    app = web.Application()
    app.router.add_get("/{path:.*}", server.handle)
    runner, server.base = await start_server(app)
    yield server
    await runner.cleanup()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip(
        "moto.server", reason="the s3 tests need moto[server] (pip install 'moto[server]')"
    )
    pytest.importorskip("boto3", reason="s3 sources need boto3 (pip install 'lorapage[s3]')")
    s3 = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    yield f"http://{host}:{port}"
    s3.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Path], None]:
    import boto3

    for var, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(var, value)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="adapters")

    def upload(prefix: str, adapter: Path) -> None:
        for name in ADAPTER_FILES:
            client.upload_file(str(adapter / name), "adapters", f"{prefix}/{name}")

    return upload
