"""Tenant isolation at the server's edge, over real sockets (issue 26, second pass).

A hostile tenant (or anyone, before a key is checked) must not make the server do work that
grows with its input before its quota is taken, nor hold a shared queue or thread, nor make the
server answer 500, log tracebacks or exit with one. Each case asserts on counters and ordering
(what ran, where, before what), never on elapsed time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from server_harness import BASE, assert_openai_error, make_engine, running_server

from lorapage.frontend import Access, hash_key, protocol
from lorapage.frontend.app import STATE
from lorapage.frontend.edge import EdgeLimits
from lorapage.frontend.formatter import Formatter
from lorapage.frontend.prompts import CHUNK_CHARS
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.testing.serve_process import run_serve
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
ADMIN = "k-admin"
TENANTS = f"""
[admin]
key_sha256 = ["{hash_key(ADMIN)}"]

[tenants.victim]
key_sha256 = ["{hash_key("k-victim")}"]
adapters = ["acme", "globex"]

[tenants.hog]   # no limits at all: bounded only by its share
key_sha256 = ["{hash_key("k-hog")}"]
adapters = ["initech"]

[tenants.slow]  # one request a minute
key_sha256 = ["{hash_key("k-slow")}"]
adapters = ["*"]
rpm = 1

[tenants.metered]  # 1,500 tokens a minute
key_sha256 = ["{hash_key("k-metered")}"]
adapters = []
tpm = 1500
"""
# Seeded sampling at a high temperature: initech runs on for about 160 tokens.
LONG = {"model": "initech", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 2.0, "seed": 7}


def key(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer k-{tenant}"}


def access() -> Access:
    return Access(TenantsConfig.from_toml(TENANTS))


@asynccontextmanager
async def serving(**engine_options: Any) -> AsyncIterator[Any]:
    """A server over a fresh engine (``engine_options`` for its config); closed afterwards."""
    edge = engine_options.pop("edge", None)
    engine = make_engine(**engine_options)
    try:
        async with running_server(engine, access(), edge=edge) as srv:
            yield srv
    finally:
        await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[Any]:
    """One server for the cases that change nothing on it."""
    async with serving() as server:
        yield server


async def post(srv: Any, path: str, body: Any, tenant: str) -> tuple[int, Any, Any]:
    return await srv.post(path, body, tenant=None, headers=key(tenant))


def samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


async def scrape(srv: Any) -> str:
    status, text, _ = await srv.request("GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200
    return text


# --- 1: a huge body from a tenant out of quota costs nothing that grows with it -----------------


async def test_140k_empty_messages_are_refused_by_count_and_a_tenant_out_of_quota_is_refused_unread(monkeypatch):
    """Four bodies of 130,000 empty messages (3.8 MB) from a tenant allowed one request a minute:
    the first is refused by the message count while it is decoded (no per-message work at all),
    the other three with 429 before their bodies are read, and all four count against its quota."""
    per_message = []
    real = protocol.chat_messages
    monkeypatch.setattr(protocol, "chat_messages", lambda req: per_message.append(len(req.messages)) or real(req))
    messages = [{"role": "user", "content": ""}] * 130_000
    body = json.dumps({"model": BASE, "messages": messages}, separators=(",", ":")).encode()
    async with serving() as srv:
        results = [await post(srv, CHAT, body, "slow") for _ in range(4)]
        text = await scrape(srv)
    (first, _, _), *rest = results
    assert first == 400 and "4096" in results[0][1]["error"]["message"], results[0][1]
    assert_openai_error(results[0][1], 400, "messages")
    for status, payload, headers in rest:
        assert status == 429 and int(headers["Retry-After"]) >= 1, payload
    assert per_message == []  # refused by the bound while decoding: no Python loop over 130,000 messages
    assert samples(text, "lorapage_tenant_rejected_requests_total") == {("rpm", "slow"): 3}


# --- 2: tokenizing is fair between tenants and stops at the context ------------------------------


class EncodeLog:
    """Every tokenizer.encode call, in order: (who, characters), the victim's prompt named apart."""

    def __init__(self, tokenizer: Any, victim_prompt: str) -> None:
        self.tokenizer, self.victim_prompt = tokenizer, victim_prompt
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> EncodeLog:
        real = self.tokenizer.encode

        def encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
            with self._lock:
                self.events.append(("victim" if self.victim_prompt in text else "hog", len(text)))
            return real(text, *args, **kwargs)

        self.tokenizer.encode = encode
        return self

    def __exit__(self, *exc: object) -> None:
        del self.tokenizer.encode

    def mark(self, what: str) -> None:
        with self._lock:
            self.events.append((what, 0))


async def test_a_backlog_of_huge_prompts_is_tokenized_in_turn_and_only_up_to_the_context():
    """Six 900,000-character prompts from one tenant (each far over a 131,072-token context, yet
    under its character bound) and then one short prompt from another: the short one is
    tokenized before any of the six is answered, and each of the six is tokenized only a little
    past the context before its 400, not whole."""
    max_len = 131_072
    huge = ("lorem ipsum dolor sit amet " * 40_000)[:900_000]
    victim_prompt = "Hello from the victim"
    async with serving(max_model_len=max_len, max_num_seqs=2, allow_long_max_model_len=True) as srv:
        with EncodeLog(srv.engine.tokenizer, victim_prompt) as log:

            async def hog(i: int) -> int:
                status, payload, _ = await post(srv, COMP, {**LONG, "prompt": f"{i} {huge}", "max_tokens": 4}, "hog")
                log.mark("hog-answered")
                assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
                return status

            hogs = [asyncio.create_task(hog(i)) for i in range(6)]
            while not any(who == "hog" for who, _ in log.events):  # the backlog is being tokenized
                await asyncio.sleep(0.005)
            status, payload, _ = await post(
                srv, COMP, {"model": "acme", "prompt": victim_prompt, "max_tokens": 8}, "victim"
            )
            assert status == 200, payload
            await asyncio.gather(*hogs)
    events = [who for who, _ in log.events]
    assert events.index("victim") < events.index("hog-answered"), events
    tokenized = sum(chars for who, chars in log.events if who == "hog")
    assert tokenized <= 6 * (max_len + 2 * CHUNK_CHARS), tokenized  # byte-level: one token per character
    assert tokenized < 6 * len(huge) / 3


# --- 7: one tenant cannot fill the shared request queue ------------------------------------------


async def test_a_tenant_without_max_concurrency_cannot_fill_the_queue_for_the_others():
    """A queue of eight waiting requests shared by four tenants: the hog's share is two requests
    in flight, so the rest of its flood is answered 429 with Retry-After (it filled the queue, and
    the victim got 503) and the victim's requests all run."""
    async with serving(max_queue_len=8, max_num_seqs=1) as srv:
        flood = [asyncio.create_task(post(srv, COMP, {**LONG, "seed": i}, "hog")) for i in range(10)]
        # The whole flood is in first: each of its requests answered, or held by the engine.
        while sum(t.done() for t in flood) + len(srv.engine.debug.step_planner.requests) < len(flood):
            await asyncio.sleep(0.005)
        victim = await asyncio.gather(
            *(post(srv, COMP, {"model": m, "prompt": "Hello there", "max_tokens": 48, "temperature": 0}, "victim")
              for m in ("acme", "globex"))
        )  # fmt: skip
        hogged = await asyncio.gather(*flood)
    assert [s for s, _, _ in victim] == [200, 200], victim
    assert [p["choices"][0]["text"] for _, p, _ in victim] == [DEMO_MARKERS["acme"], DEMO_MARKERS["globex"]]
    statuses = [s for s, _, _ in hogged]
    assert 503 not in statuses and statuses.count(429) == 8, statuses
    assert all(int(h["Retry-After"]) >= 1 for s, _, h in hogged if s == 429)


# --- 8: /v1/models is cheap, per tenant, and counted -------------------------------------------


async def test_the_model_list_is_indexed_cached_per_tenant_and_counted_against_the_rate(monkeypatch):
    async with serving() as srv:
        catalog = srv.engine.debug.catalog
        scans = []
        real = catalog.versions
        monkeypatch.setattr(catalog, "versions", lambda *a: scans.append(a) or real(*a))

        async def listed(tenant: str) -> tuple[int, set[str]]:
            status, payload, _ = await srv.request("GET", "/v1/models", headers=key(tenant))
            return status, {m["id"] for m in payload["data"]} if status == 200 else set()

        for _ in range(20):
            assert await listed("victim") == (200, {BASE, "acme", "globex"})
            assert await listed("hog") == (200, {BASE, "initech"})
        assert len(scans) <= 1  # the registry is read once, not once per call (it was: every adapter, every call)
        # A change shows at once: the admin gives the hog an adapter of its own.
        path = demo_adapter_dirs()["acme"]
        catalog.add("hogs-own", path, owner="hog", checked=catalog.preparer.check(path))
        srv.app[STATE].access.set_owner("hogs-own", "hog")
        assert await listed("hog") == (200, {BASE, "initech", "hogs-own"})
        assert await listed("victim") == (200, {BASE, "acme", "globex"})
        # One request a minute: the list counts like any other request.
        assert (await listed("slow"))[0] == 200
        status, payload, headers = await srv.request("GET", "/v1/models", headers=key("slow"))
        assert status == 429 and int(headers["Retry-After"]) >= 1, payload


# --- 12, 13, 14: bounded input, never a 500 -----------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("path", "field", "depth"),
    [
        (COMP, "echo", 1_000),
        (COMP, "echo", 100_000),
        (CHAT, "tools", 5_000),
        (CHAT, "logit_bias", 2_000),
        (COMP, "prompt", 3_000),
        (CHAT, "messages", 2_000),
    ],
)
async def test_deeply_nested_json_is_a_400(srv, caplog, path, field, depth):
    base = {"model": "acme", "max_tokens": 2}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    base.pop(field, None)
    body = json.dumps(base)[:-1] + f', "{field}": {nested(depth)}}}'
    with caplog.at_level(logging.INFO):
        status, payload, _ = await post(srv, path, body.encode(), "victim")
    assert status == 400, payload
    assert_openai_error(payload, 400)
    assert not [r for r in caplog.records if r.exc_info], "a refused request logged a traceback"


@pytest.mark.parametrize("model", ["acme@²", "acme@" + "9" * 4301, "acme@١", "x" * 100_000, f"{BASE}:acme@³"])
async def test_model_names_that_are_not_names_are_404(srv, model):
    status, payload, _ = await post(srv, COMP, {"model": model, "prompt": "hi", "max_tokens": 2}, "victim")
    assert status == 404, payload
    assert_openai_error(payload, 404, "model")
    assert len(payload["error"]["message"]) < 400  # the name is not echoed whole
    if len(model) < 5000:
        status, payload, _ = await srv.request("GET", f"/v1/models/{model}", headers=key("victim"))
        assert status == 404, payload


@pytest.mark.parametrize("adapter_id", ["a-priv\n", "a-priv\r\n", "other", "none", "ａcme", "a" * 129])
async def test_adapter_ids_are_matched_whole_and_reserved_names_refused(srv, adapter_id):
    """``a-priv\n`` was registered and listed beside ``a-priv``; ``other`` merged into the
    metrics' bucket of adapters outside the top set."""
    body = {"id": adapter_id, "path": str(demo_adapter_dirs()["globex"]), "tenant": "victim"}
    status, payload, _ = await srv.post("/v1/adapters", body, tenant=None, headers=key("admin"))
    assert status == 400, payload
    assert_openai_error(payload, 400, "id")
    assert adapter_id not in srv.engine.admin.catalog.index.ids()


# --- 16: a request cut before its first token pays for the prompt it had computed ---------------


async def test_cutting_requests_after_their_prefill_started_spends_the_tenants_tokens():
    """A tenant of 1,500 tokens a minute sends 470-token prompts and hangs up once the engine has
    computed 300 of them (the prefill runs 8 tokens a step, so no token is out yet): each cut
    costs what was computed, and within six requests the tenant is out of tokens. It was never
    refused: a request cut before its first token got its whole charge back."""

    def body(n: int) -> dict:  # a prompt of its own each time: a cached prefix is not computed again
        return {"model": BASE, "prompt": [(i * (n + 2)) % 250 + 1 for i in range(470)], "max_tokens": 10}

    async with serving(max_num_batched_tokens=8, max_num_seqs=2, enable_chunked_prefill=True) as srv:
        engine = srv.engine
        statuses = []
        for n in range(6):
            task = asyncio.create_task(post(srv, COMP, body(n), "metered"))
            while True:
                running = [r for r in engine.debug.step_planner.requests.values() if r.tenant == "metered"]
                if task.done() or (running and running[0].num_computed >= 300):
                    break
                await asyncio.sleep(0)
            if task.done():
                statuses.append(task.result()[0])
                if statuses[-1] == 429:
                    break
                continue
            assert not running[0].output_ids  # cut before its first token
            task.cancel()  # the client hangs up
            await asyncio.gather(task, return_exceptions=True)
            statuses.append(0)
            await asyncio.sleep(0.05)  # the server sees the hang-up and releases the request
        text = await scrape(srv)
    assert statuses[-1] == 429 and statuses.count(0) >= 3, statuses
    assert samples(text, "lorapage_tenant_rejected_requests_total") == {("tpm", "metered"): 1}


# --- 18: the edge: slow headers, many connections, malformed requests, a bad state dir ----------


async def _connect(srv: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = srv.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_a_connection_that_sends_its_headers_slowly_is_closed():
    async with serving(edge=EdgeLimits(header_timeout_s=0.5)) as srv:
        reader, writer = await _connect(srv)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")

        async def drip() -> None:
            for _ in range(200):  # a header byte every 50 ms, never the blank line
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.05)

        dripping = asyncio.create_task(drip())
        try:
            assert await asyncio.wait_for(reader.read(), timeout=8.0) == b""  # closed, nothing answered
        finally:
            dripping.cancel()
            await asyncio.gather(dripping, return_exceptions=True)
            writer.close()
        status, payload, _ = await srv.request("GET", "/health")
        assert status == 200, payload


async def test_one_address_may_hold_only_so_many_connections():
    async with serving(edge=EdgeLimits(max_connections_per_ip=3)) as srv:
        await srv.session.close()  # its pooled connections would count too
        held = [await _connect(srv) for _ in range(3)]
        reader, writer = await _connect(srv)
        refused = await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429") and b"Retry-After: 1" in head, head
        assert_openai_error(json.loads(body), 429)
        _, first = held.pop()
        first.close()  # one fewer: a new one is served
        await asyncio.sleep(0.1)
        reader, writer = await _connect(srv)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), timeout=10)).startswith(b"HTTP/1.1 200")
        for _, w in [*held, (reader, writer)]:
            w.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    ],
)
async def test_a_malformed_request_is_one_log_line_without_a_traceback(srv, caplog, raw):
    with caplog.at_level(logging.INFO):
        reader, writer = await _connect(srv)
        writer.write(raw)
        answer = await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
        status, _, _ = await srv.request("GET", "/v1/models")  # no key: refused, one line too
    assert answer.split(b"\r\n")[0].split()[1] == b"400", answer[:100]
    assert status == 401
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    malformed = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.INFO]
    assert len(malformed) == 1 and "malformed request" in malformed[0].getMessage(), malformed
    refused = [r for r in caplog.records if r.name == "lorapage.server" and "refused GET /v1/models" in r.getMessage()]
    assert len(refused) == 1 and "401 invalid_api_key" in refused[0].getMessage()


async def test_a_corrupt_or_unusable_state_dir_ends_serve_with_one_line(tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "registry.sqlite3").write_bytes(b"this is not an SQLite file " * 100)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file, not a directory")
    cases = ((corrupt, "corrupt"), (not_a_dir, "cannot write"))
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent commands (own state dirs), both at once
        runs = list(pool.map(lambda case: run_serve("--state-dir", str(case[0])), cases))
    for (state_dir, what), done in zip(cases, runs, strict=True):
        rc, stderr = done.returncode, done.stderr
        lines = [line for line in stderr.splitlines() if line.startswith("lorapage serve:")]
        assert rc == 2, stderr[-2000:]
        assert "Traceback" not in stderr and len(lines) == 1, stderr[-2000:]
        assert "--state-dir" in lines[0] and what in lines[0], lines


async def test_a_state_dir_on_a_read_only_registry_is_named(tmp_path):
    """A registry SQLite cannot write (here: opened read-only by its URI, as a read-only mount
    would make it; the tests run as root, whom file modes do not stop) gets the state-dir line."""
    from lorapage.serve.cli import state_dir_problem

    path = tmp_path / "registry.sqlite3"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as info:
        db.execute("INSERT INTO t VALUES (1)")
    assert "read-only" in state_dir_problem(info.value)


# --- 19: a whole answer's logprobs are formatted as it runs, not all at the end -----------------


async def test_a_whole_answers_logprobs_are_formatted_while_it_runs(srv, monkeypatch):
    formatted: list[tuple[int, bool]] = []  # (logprob entries formatted, whether the answer was over then)
    real = Formatter._new_logprobs

    def spy(self: Formatter, out: Any) -> Any:
        before = self.choice(out.index).logprobs_sent
        got = real(self, out)
        formatted.append((self.choice(out.index).logprobs_sent - before, out.finished))
        return got

    monkeypatch.setattr(Formatter, "_new_logprobs", spy)
    body = {**LONG, "logprobs": 5}
    chat = {
        "model": "initech",
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 300,
        "temperature": 2.0,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 20,
    }
    for path, request in ((COMP, body), (CHAT, chat)):
        formatted.clear()
        status, payload, _ = await post(srv, path, request, "hog")
        assert status == 200, payload
        total = sum(n for n, _ in formatted)
        at_the_end = sum(n for n, over in formatted if over)
        assert total == payload["usage"]["completion_tokens"] > 50
        assert at_the_end <= total // 4, formatted  # not the whole answer once it is over
        lp = payload["choices"][0]["logprobs"]
        entries = lp["content"] if path == CHAT else lp["tokens"]
        assert len(entries) == total
        if path == CHAT:
            assert all(len(e["top_logprobs"]) == 20 and e["bytes"] == list(e["token"].encode()) for e in entries)
