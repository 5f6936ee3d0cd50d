"""Tenant isolation on the server side, over a real socket: keys that are not UTF-8, who may read
/metrics, where admin registration may read from, access that fails closed, and prompts too big
to tokenize that are refused without stalling anyone else."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (  # noqa: F401 (server: the module's fixture)
    BASE,
    METRICS_KEY,
    assert_openai_error,
    running_server,
    server,
)

from lorapage.frontend import Access, hash_key
from lorapage.frontend.loop_lag import LoopLagMonitor
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMP, CHAT = "/v1/completions", "/v1/chat/completions"


def _body(model: str, **extra) -> dict:
    return {"model": model, "prompt": "hi", "max_tokens": 2, **extra}


async def _raw(srv, method: str, path: str, headers: bytes, body: bytes = b"") -> tuple[int, dict]:
    """One HTTP/1.1 request with header bytes sent as they are (aiohttp's client would refuse them)."""
    host, port = srv.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + headers + b"\r\n" + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload)


# --- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [b"\xff\xfe", b"key-\x80alpha", b"\xc3("])
async def test_an_api_key_that_is_not_utf8_is_a_401(server, key):
    header = b"Authorization: Bearer " + key + b"\r\nContent-Type: application/json\r\n"
    body = json.dumps(_body("acme")).encode()
    for method, path in (("POST", COMP), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/adapters")):
        status, payload = await _raw(server, method, path, header, body if method == "POST" else b"")
        assert status == 401, (path, payload)
        assert_openai_error(payload, 401)
        assert "not valid UTF-8" in payload["error"]["message"], payload
    assert (await server.post(COMP, _body("acme")))[0] == 200


# --- /metrics --------------------------------------------------------------------------------


async def test_metrics_take_the_admin_key_or_a_metrics_key(server):
    async def scrape(headers):
        return await server.request("GET", "/metrics", headers=headers)

    status, payload, _ = await scrape({})
    assert status == 401
    assert_openai_error(payload, 401)
    assert (await scrape({"Authorization": "Bearer not-a-key"}))[0] == 401
    assert (await scrape(server.auth("alpha")))[0] == 403  # a tenant may not read the others' names
    status, text, _ = await scrape(server.admin())
    assert status == 200 and "lorapage_requests_total" in text
    assert (await scrape({"Authorization": f"Bearer {METRICS_KEY}"}))[0] == 200
    # The metrics key opens /metrics and nothing else.
    metrics_key = {"Authorization": f"Bearer {METRICS_KEY}"}
    assert (await server.request("GET", "/internal/state", headers=metrics_key))[0] == 403
    assert (await server.request("GET", "/v1/models", headers=metrics_key))[0] == 401


async def test_metrics_public_serves_metrics_without_a_key(server):
    async with running_server(server.engine, metrics_public=True) as srv:
        status, text, _ = await srv.request("GET", "/metrics")
        assert status == 200 and "lorapage_event_loop_lag_seconds" in text


# --- admin registration reads only under --adapter-root ---------------------------------------


def _register(srv, path, adapter_id: str, tenant: str = "beta"):
    return srv.post(
        "/v1/adapters", {"id": adapter_id, "path": str(path), "tenant": tenant}, tenant=None, headers=srv.admin()
    )


@pytest.fixture
def outside(tmp_path) -> Path:
    """A valid adapter directory that is not under the server's adapter root."""
    dst = tmp_path / "outside-adapter"
    shutil.copytree(demo_adapter_dirs()["globex"], dst)
    return dst


async def test_registration_outside_the_root_is_refused(server, outside):
    sub = Path(tempfile.mkdtemp(dir=server.adapter_root))
    (sub / "escape").symlink_to(outside, target_is_directory=True)
    dotdot = Path(f"{sub}/{'../' * 16}") / outside.relative_to("/")  # climbs out of the root, then down
    for n, path in enumerate([outside, outside.as_uri(), sub / "escape", dotdot, (sub / "escape").as_uri()]):
        status, payload, _ = await _register(server, path, f"escape-{n}")
        assert status == 403, (path, payload)
        assert_openai_error(payload, 403, "path")
        assert "outside the adapter roots" in payload["error"]["message"], payload
    assert not any(i.name.startswith("escape-") for i in server.engine.admin.served())


async def test_a_link_inside_an_adapter_directory_cannot_escape_the_root(server, outside):
    inside = Path(tempfile.mkdtemp(dir=server.adapter_root)) / "adapter"
    shutil.copytree(demo_adapter_dirs()["globex"], inside)
    (inside / "adapter_model.safetensors").unlink()
    (inside / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    status, payload, _ = await _register(server, inside, "linked")
    assert status == 403 and "links outside the adapter root" in payload["error"]["message"], payload
    # The same directory with its own file is fine: the refusal was the link, not the adapter.
    (inside / "adapter_model.safetensors").unlink()
    shutil.copy(outside / "adapter_model.safetensors", inside)
    assert (await _register(server, inside, "linked"))[0] == 201
    assert (await server.request("DELETE", "/v1/adapters/linked", headers=server.admin()))[0] == 200


async def test_without_an_adapter_root_path_registration_is_refused(server, outside):
    async with running_server(server.engine) as srv:
        status, payload, _ = await _register(srv, outside, "no-root")
        assert status == 403
        assert_openai_error(payload, 403, "path")
        assert "--adapter-root" in payload["error"]["message"]


# --- access fails closed ---------------------------------------------------------------------

ISOLATION_TOML = f"""
[admin]
key_sha256 = ["{hash_key("adm")}"]

[tenants.closed]  # no adapters: the base and what the admin registers for it
key_sha256 = ["{hash_key("k-closed")}"]

[tenants.open]
key_sha256 = ["{hash_key("k-open")}"]
adapters = ["*"]

[tenants.lister]
key_sha256 = ["{hash_key("k-lister")}"]
adapters = ["acme", "owned"]
"""


async def test_access_fails_closed_and_the_admins_owner_wins(server):
    def key(tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer k-{tenant}"}

    async def status(tenant: str, model: str) -> int:
        return (await srv.post(COMP, _body(model), tenant=None, headers=key(tenant)))[0]

    async def models(tenant: str) -> set[str]:
        _, listed, _ = await srv.request("GET", "/v1/models", headers=key(tenant))
        return {m["id"] for m in listed["data"]}

    access = Access(TenantsConfig.from_toml(ISOLATION_TOML))
    async with running_server(server.engine, access) as srv:
        assert [await status("closed", m) for m in (BASE, "acme", "globex")] == [200, 404, 404]
        assert [await status("open", m) for m in ("acme", "globex", "initech")] == [200, 200, 200]
        assert [await status("lister", m) for m in ("acme", "globex")] == [200, 404]
        path = Path(tempfile.mkdtemp(dir=server.adapter_root)) / "owned"
        shutil.copytree(demo_adapter_dirs()["globex"], path)
        body = {"id": "owned", "path": str(path), "tenant": "closed"}
        assert (await srv.post("/v1/adapters", body, tenant=None, headers={"Authorization": "Bearer adm"}))[0] == 201
        try:
            assert await status("closed", "owned") == 200
            assert await status("open", "owned") == 404  # "*" opens adapters without an owner only
            assert await status("lister", "owned") == 404  # the admin gave it to `closed`: the list loses
            assert await models("closed") == {BASE, "owned"}
            assert await models("open") == {BASE, *DEMO_MARKERS}
            assert await models("lister") == {BASE, "acme"}
        finally:
            await srv.request("DELETE", "/v1/adapters/owned", headers={"Authorization": "Bearer adm"})


# --- prompts: bounded before tokenizing, tokenized off the loop ------------------------------


class _TokenizerSpy:
    """Counts the tokenizer's encode and chat-template calls and the threads they ran on."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.threads = tokenizer, []
        self._encode, self._render = tokenizer.encode, tokenizer.apply_chat_template

    def __enter__(self):
        def spy(real):
            def call(*args, **kwargs):
                self.threads.append(threading.current_thread().name)
                return real(*args, **kwargs)

            return call

        self.tokenizer.encode = spy(self._encode)
        self.tokenizer.apply_chat_template = spy(self._render)
        return self

    def __exit__(self, *exc) -> None:
        del self.tokenizer.encode, self.tokenizer.apply_chat_template  # the class's methods again


def _lag(text: str) -> float:
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "lorapage_event_loop_lag_seconds")
    return fam.samples[0].value


async def test_a_3mb_prompt_is_refused_untokenized_while_health_stays_responsive(server):
    big = "lorem ipsum " * (3 * 2**20 // 12)
    requests = [
        (COMP, _body("acme", prompt=big)),
        (CHAT, {"model": "acme", "messages": [{"role": "user", "content": big}], "max_tokens": 2}),
        (CHAT, {"model": "acme", "messages": [{"role": "user", "content": big[:40_000]}] * 60, "max_tokens": 2}),
    ]
    stop, answered, worst = asyncio.Event(), asyncio.Event(), 0.0

    async def poll_health() -> None:
        """The longest gap between two /health answers (the client shares the server's loop, so a
        stall shows up as a gap whether it hits a request or the pause between two)."""
        nonlocal worst
        last = time.perf_counter()
        while not stop.is_set():
            assert (await server.request("GET", "/health"))[0] == 200
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            answered.set()
            await asyncio.sleep(0.01)

    with _TokenizerSpy(server.engine.tokenizer) as spy:
        poller = asyncio.create_task(poll_health())
        await answered.wait()
        results = await asyncio.gather(*(server.post(path, body) for path, body in requests * 3))
        stop.set()
        await poller
    assert spy.threads == []  # refused on the character bound: never rendered nor tokenized
    for status, payload, _ in results:
        assert status == 400
        assert_openai_error(payload, 400)
        assert payload["error"]["code"] == "context_length_exceeded", payload
    assert worst < 1.0  # generous: a 3 MB tokenization on the loop stalled /health for seconds
    _, text, _ = await server.request("GET", "/metrics", headers=server.admin())
    assert _lag(text) < 1.0


async def test_prompts_are_rendered_and_tokenized_off_the_loop(server):
    with _TokenizerSpy(server.engine.tokenizer) as spy:
        assert (await server.post(COMP, _body("acme")))[0] == 200
        chat = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await server.post(CHAT, chat))[0] == 200
    assert len(spy.threads) == 3  # the completion's encode; the chat's template and encode
    assert all(name.startswith("lorapage-prompt") for name in spy.threads), spy.threads


# --- the loop-lag gauge ----------------------------------------------------------------------


async def test_the_lag_gauge_sees_a_blocked_loop(server):
    await asyncio.sleep(0.1)  # let the monitor take a sample first
    time.sleep(0.4)  # the test shares the server's loop: this holds it
    await asyncio.sleep(0.1)
    _, text, _ = await server.request("GET", "/metrics", headers=server.admin())
    assert _lag(text) >= 0.25
    last = next(f for f in text_string_to_metric_families(text) if f.name == "lorapage_event_loop_lag_last_seconds")
    assert 0 <= last.samples[0].value < _lag(text)  # samples after the block are on time again


async def test_lag_monitor_keeps_only_its_window():
    monitor = LoopLagMonitor(interval_s=0.05, window_s=10.0)
    monitor.record(100.0, 0.8)
    for i in range(1, 101):  # 5 s of on-time samples
        monitor.record(100.0 + i * 0.05, 0.001)
    assert monitor.worst(105.0) == 0.8 and monitor.last == 0.001
    for i in range(101, 401):  # 15 s more: the late sample leaves the window
        monitor.record(100.0 + i * 0.05, 0.001)
    assert monitor.worst(120.0) == 0.001
    assert len(monitor._samples) <= 201  # the window's worth, however long it runs
    assert monitor.worst(200.0) == 0.0  # nothing sampled in the last 10 s
