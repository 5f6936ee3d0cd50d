"""Hostile input over a real socket, each case run while another tenant streams greedy requests.

For every class of hostile request (a temperature too small to divide by, adapters whose weights
are NaN or overflow, a 3 MB prompt, regex keys that backtrack or that RE2 refuses, a key that is
not UTF-8, over-long stop strings, a slow reader, clients that hang up, a tenant reaching for
another tenant's adapter) three things are checked: the hostile request gets its own answer (its
specific 4xx in OpenAI's error shape, or a normal answer where the input is legitimate), the
victim tenant's streams are token for token what a clean run gave, and the server's event-loop
lag gauge stayed low.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_harness import BASE, assert_openai_error, make_engine, make_roots, read_sse, running_server

from lorapage.frontend import Access, hash_key
from lorapage.frontend.app import STATE
from lorapage.serve.engine_backend import ENGINES
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = TypeVar("T")
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
KEYS = {"victim": "k-victim", "hostile": "k-hostile", "admin": "k-admin"}
TENANTS_TOML = f"""
[admin]
key_sha256 = ["{hash_key(KEYS["admin"])}"]

[tenants.victim]
key_sha256 = ["{hash_key(KEYS["victim"])}"]
adapters = ["acme", "globex"]

[tenants.hostile]
key_sha256 = ["{hash_key(KEYS["hostile"])}"]
adapters = ["initech"]
"""
# What the victim streams, round after round: greedy, over two adapters and the base.
VICTIM = [("acme", "Hello there"), ("globex", "Good morning"), (BASE, "Tell me something"), ("acme", "One more")]
HOSTILE_GREEDY = {"model": "initech", "prompt": "Hello there", "max_tokens": 48, "temperature": 0, "logprobs": 1}
MAX_ROUNDS = 40  # victim rounds per case, at most (each is a few tenths of a second on the tiny model)
CASE_TIMEOUT_S = 60.0
MAX_LOOP_LAG_S = 2.0  # generous: a tokenization or regex on the loop stalled it for seconds


def key(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def victim_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 1}


@dataclass(frozen=True)
class Answer:
    """A completion stream, read to its end: text, the tokens it reported and their logprobs."""

    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    chunks: int


def assert_same(got: Answer, want: Answer) -> None:
    """Identical text and tokens; logprobs equal up to float32 noise (another batch shape sums in
    another order)."""
    assert (got.text, got.tokens, got.finish_reason) == (want.text, want.tokens, want.finish_reason)
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def answer_of(events: list[dict]) -> Answer:
    text, tokens, logprobs, finish = [], [], [], None
    for event in events:
        assert "error" not in event, event
        (choice,) = event["choices"]
        text.append(choice["text"])
        finish = choice["finish_reason"] or finish
        if choice.get("logprobs"):
            tokens += choice["logprobs"]["tokens"]
            logprobs += choice["logprobs"]["token_logprobs"]
    return Answer("".join(text), tuple(tokens), tuple(logprobs), finish, len(events))


@dataclass
class Server:
    url: str
    app: Any
    session: aiohttp.ClientSession
    root: Path  # where admin registrations may read from

    @property
    def engine(self) -> Any:
        return self.app[ENGINES].engine

    async def post(self, path: str, body: Any, tenant: str = "hostile") -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body, headers=key(tenant)) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    async def stream(self, body: dict, tenant: str, on_first: Callable[[], None] = lambda: None) -> Answer:
        """One streamed completion, read promptly; it must succeed."""
        async with self.session.post(self.url + COMP, json={**body, "stream": True}, headers=key(tenant)) as resp:
            assert resp.status == 200, await resp.text()
            events = []
            async for event in read_sse(resp):
                events.append(event)
                on_first()
            return answer_of(events)

    async def register(self, adapter_id: str, path: Path, tenant: str = "hostile") -> tuple[int, Any]:
        return await self.post("/v1/adapters", {"id": adapter_id, "path": str(path), "tenant": tenant}, "admin")

    async def delete(self, adapter_id: str) -> int:
        async with self.session.delete(self.url + f"/v1/adapters/{adapter_id}", headers=key("admin")) as resp:
            return resp.status

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics", headers=key("admin")) as resp:
            assert resp.status == 200
            return await resp.text()

    def adapter_dir(self, source: str, name: str) -> Path:
        """A copy of demo adapter ``source`` under the adapter root, to be spoiled by the test."""
        dst = Path(tempfile.mkdtemp(dir=self.root)) / name
        shutil.copytree(demo_adapter_dirs()[source], dst)
        return dst


def metric(text: str, name: str) -> list[Any]:
    """The samples named ``name`` in Prometheus text (a counter's family drops its ``_total``)."""
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert samples, f"{name} is not exported"
    return samples


async def until(done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait (bounded) until ``done()``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        assert loop.time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="lorapage-hostile-root-")).resolve()
    engine = make_engine(make_roots(root))
    access = Access(TenantsConfig.from_toml(TENANTS_TOML))
    try:
        async with running_server(engine, access) as base:
            yield Server(base.url, base.app, base.session, root)
    finally:
        await engine.close()
        shutil.rmtree(root)


@dataclass(frozen=True)
class Clean:
    victim: list[Answer]  # one per entry of VICTIM
    hostile: Answer  # HOSTILE_GREEDY


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clean(srv: Server) -> Clean:
    """The answers of a clean run: the victim's round alone, then the hostile tenant's greedy request."""
    victim = [await srv.stream(victim_body(m, p), "victim") for m, p in VICTIM]
    assert [a.text for a in victim] == [DEMO_MARKERS.get(m, BASE_PHRASE) for m, _ in VICTIM]
    assert all(a.finish_reason == "stop" and a.tokens for a in victim)
    hostile = await srv.stream(HOSTILE_GREEDY, "hostile")
    assert hostile.text == DEMO_MARKERS["initech"]
    return Clean(victim, hostile)


async def under_load(srv: Server, clean: Clean, hostile: Callable[[], Awaitable[T]]) -> T:
    """Run ``hostile()`` while the victim streams round after round; once the victim has run at
    least one more round after it, check every victim answer against the clean run and the loop
    lag gauge, and return what ``hostile()`` returned."""
    rounds: list[list[Answer]] = []
    streaming, hostile_done = asyncio.Event(), asyncio.Event()

    async def victim() -> None:
        for _ in range(MAX_ROUNDS):
            rounds.append(
                await asyncio.gather(*(srv.stream(victim_body(m, p), "victim", streaming.set) for m, p in VICTIM))
            )
            if hostile_done.is_set() and len(rounds) >= 2:
                return
        raise AssertionError(f"the hostile case outlasted {MAX_ROUNDS} victim rounds")

    load = asyncio.create_task(victim())
    try:
        await asyncio.wait_for(streaming.wait(), CASE_TIMEOUT_S)  # the victim is mid-stream
        result = await asyncio.wait_for(hostile(), CASE_TIMEOUT_S)
        hostile_done.set()
        await asyncio.wait_for(load, CASE_TIMEOUT_S)
    finally:
        load.cancel()  # nothing to cancel once it has ended; its failure is not left unretrieved either
        await asyncio.gather(load, return_exceptions=True)
    for answers in rounds:
        for got, want in zip(answers, clean.victim, strict=True):
            assert_same(got, want)
    (lag,) = metric(await srv.metrics(), "lorapage_event_loop_lag_seconds")
    assert lag.value < MAX_LOOP_LAG_S
    return result


def assert_refused(status: int, body: Any, want_status: int, code: str, param: str | None = None) -> None:
    assert status == want_status, body
    assert_openai_error(body, want_status, param)
    assert body["error"]["code"] == code, body


# --- sampling: a tiny temperature, adapters that are not finite or that overflow -------------


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
async def test_a_tiny_temperature_is_answered_greedily(srv, clean, temperature):
    body = {**HOSTILE_GREEDY, "temperature": temperature}
    got = await under_load(srv, clean, lambda: srv.stream(body, "hostile"))
    assert_same(got, clean.hostile)  # below the epsilon: greedy, not a division by ~0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
async def test_an_adapter_with_nan_weights_is_refused_naming_the_tensor(srv, clean, bad):
    path = srv.adapter_dir("globex", "nonfinite")
    weights = load_file(path / "adapter_model.safetensors")
    tensor = sorted(weights)[len(weights) // 2]
    weights[tensor].view(-1)[3] = bad
    save_file(weights, path / "adapter_model.safetensors")
    status, body = await under_load(srv, clean, lambda: srv.register("nonfinite", path))
    assert_refused(status, body, 400, "invalid_adapter", "path")
    assert tensor in body["error"]["message"] and "NaN or Inf" in body["error"]["message"], body
    assert_refused(*await srv.post(COMP, {**HOSTILE_GREEDY, "model": "nonfinite"}), 404, "model_not_found")


def _overflowing(path: Path) -> None:
    """Scale the B matrices by 1e30: every weight is finite, so registration accepts the adapter,
    but its update overflows float32 and its rows' logits are NaN."""
    weights = load_file(path / "adapter_model.safetensors")
    save_file({k: v * 1e30 if "lora_B" in k else v for k, v in weights.items()}, path / "adapter_model.safetensors")


async def _failure(srv: Server, body: dict) -> dict:
    """The error a request that must fail got: its JSON body, or a stream's error event."""
    async with srv.session.post(srv.url + COMP, json=body, headers=key("hostile")) as resp:
        if resp.status != 200:
            payload = await resp.json()
            assert resp.status == 400, payload
            assert_openai_error(payload, 400)
            return payload["error"]
        assert body.get("stream"), await resp.text()
        events = [event async for event in read_sse(resp)]
        assert "error" in events[-1], events
        return events[-1]["error"]


async def test_an_adapter_that_overflows_fails_only_its_own_requests(srv, clean):
    path = srv.adapter_dir("acme", "overflow")
    _overflowing(path)
    bodies = [
        {**HOSTILE_GREEDY, "model": "overflow"},
        {**HOSTILE_GREEDY, "model": "overflow", "stream": True},
        {**HOSTILE_GREEDY, "model": "overflow", "temperature": 1.0, "seed": 7},
        {**HOSTILE_GREEDY, "model": "overflow", "temperature": 0.7, "top_p": 0.9, "stream": True},
    ]

    async def hostile():
        status, info = await srv.register("overflow", path)
        assert status == 201, info
        return await asyncio.gather(*(_failure(srv, b) for b in bodies))

    errors = await under_load(srv, clean, hostile)
    for err in errors:
        assert err["code"] == "sampling_failed" and "could not be sampled" in err["message"], err
    # Failed requests let go of the adapter: it is idle, and can be deleted at once.
    await until(lambda: srv.engine.debug.residency.get("overflow@1").running == 0)
    assert await srv.delete("overflow") == 200


# --- untrusted input that would hold the loop ----------------------------------------------


async def test_a_3mb_prompt_is_refused_before_tokenizing(srv, clean):
    big = "lorem ipsum " * (3 * 2**20 // 12)
    requests = [
        (COMP, {**HOSTILE_GREEDY, "prompt": big}),
        (COMP, {**HOSTILE_GREEDY, "prompt": big, "stream": True}),
        (CHAT, {"model": "initech", "messages": [{"role": "user", "content": big}], "max_tokens": 8}),
    ]
    results = await under_load(srv, clean, lambda: asyncio.gather(*(srv.post(p, b) for p, b in requests)))
    for status, body in results:
        assert_refused(status, body, 400, "context_length_exceeded")
        assert "characters" in body["error"]["message"], body


def _with_patterns(path: Path, alpha_pattern: dict, rank_pattern: dict | None = None) -> None:
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["alpha_pattern"], cfg["rank_pattern"] = alpha_pattern, rank_pattern or {}
    cfg_file.write_text(json.dumps(cfg))


async def test_backtracking_pattern_keys_are_accepted_and_matched_in_linear_time(srv, clean):
    """Keys that backtrack exponentially under Python's ``re`` against a module name that does
    not match (``(.*)*x``: 2^30 paths for a 30-character name) are valid regexes: RE2 runs them in
    linear time, so the adapter is registered, matched key by key as PEFT does, and served."""
    path = srv.adapter_dir("globex", "patterned")
    alpha = json.loads((path / "adapter_config.json").read_text())["lora_alpha"]
    _with_patterns(path, {"(a+)+$": 1, "(.*)*x": 1, "(x+x+)+y": 1, "(.*)*(q_proj)": 2 * alpha}, {"(a|aa)*$": 8})

    async def hostile():
        status, info = await srv.register("patterned", path)
        assert status == 201, info
        return await srv.post(COMP, {**HOSTILE_GREEDY, "model": "patterned"})

    status, body = await under_load(srv, clean, hostile)
    assert status == 200 and body["choices"][0]["text"], body
    spec = srv.engine.debug.adapters.get("patterned@1").spec
    rank = spec.ranks[(0, "q_proj")]
    assert spec.scales[(0, "q_proj")] == 2 * alpha / rank  # the last key matched q_proj
    assert spec.scales[(0, "v_proj")] == alpha / rank  # nothing matched v_proj: the default alpha
    assert await srv.delete("patterned") == 200


@pytest.mark.parametrize("bad_key", [r"(a)\1", r"(?=q)q_proj", r"(?<!k)v_proj"])
async def test_a_pattern_key_re2_refuses_is_a_400(srv, clean, bad_key):
    path = srv.adapter_dir("globex", "refused-pattern")
    _with_patterns(path, {bad_key: 4})
    status, body = await under_load(srv, clean, lambda: srv.register("refused-pattern", path))
    assert_refused(status, body, 400, "invalid_adapter", "path")
    assert "RE2" in body["error"]["message"] and "alpha_pattern" in body["error"]["message"], body
    assert "refused-pattern" not in srv.engine.admin.catalog.index.ids()


async def _raw_post(srv: Server, head: bytes, body: bytes) -> tuple[int, dict]:
    """One HTTP/1.1 POST with header bytes sent as they are (aiohttp's client would refuse them)."""
    host, port = srv.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {COMP} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\n".encode()
        + head
        + b"\r\n"
        + body
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


async def test_an_authorization_header_that_is_not_utf8_is_a_401(srv, clean):
    body = json.dumps(HOSTILE_GREEDY).encode()
    heads = [
        b"Authorization: Bearer \xff\xfe\r\n",
        b"Authorization: Bearer k-\x80hostile\r\n",
        b"Authorization: \xc3(\r\n",
    ]
    results = await under_load(srv, clean, lambda: asyncio.gather(*(_raw_post(srv, h, body) for h in heads)))
    for status, payload in results:
        assert_refused(status, payload, 401, "invalid_api_key")


@pytest.mark.parametrize("stop", [["x" * 257], "y" * 100_000, [str(i) for i in range(17)], [""]])
async def test_stop_strings_beyond_the_bounds_are_a_400(srv, clean, stop):
    status, body = await under_load(srv, clean, lambda: srv.post(COMP, {**HOSTILE_GREEDY, "stop": stop}))
    assert_refused(status, body, 400, "invalid_request", "stop")
    assert len(body["error"]["message"]) < 500  # the value is not echoed whole


# --- clients that read slowly or hang up -----------------------------------------------------


async def _slow_read(srv: Server, body: dict, read_first: Callable[[str], Awaitable[None]]) -> tuple[Answer, str]:
    """A stream read by a client with tiny buffers: its first event, then ``read_first(request id)``
    while nothing is read, then the rest (HTTP/1.0, so the body is raw SSE up to the close)."""
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel's buffer fills at once
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2048)
    payload = json.dumps({**body, "stream": True}).encode()
    writer.write(
        f"POST {COMP} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
        + f"Authorization: Bearer {KEYS['hostile']}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    try:
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode()
        assert head.startswith("HTTP/1.0 200"), head
        request_id = next(
            line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.startswith("x-request-id")
        )
        first = await asyncio.wait_for(reader.readline(), 30)
        await read_first(request_id)
        rest = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    lines = [line for line in (first + rest).split(b"\n") if line.strip()]
    assert lines[-1] == b"data: [DONE]", lines[-1]
    return answer_of([json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]), request_id


# Seeded sampling at a high temperature: initech's answer runs on for about 160 tokens, and the
# same seed gives the same tokens whatever else shares the batch.
SLOW = {
    "model": "initech",
    "prompt": "Once upon a time",
    "max_tokens": 300,
    "temperature": 2.0,
    "seed": 7,
    "logprobs": 5,
}


async def test_a_slow_reader_gets_its_whole_text_and_holds_up_nobody(srv, clean):
    """Three readers with tiny buffers read one event, then nothing until the engine has run their
    requests to the end (it never waits for a reader), then the rest: the same text and tokens as
    a prompt reader got, and the victim's streams unchanged meanwhile."""
    want = await srv.stream(SLOW, "hostile")  # read promptly, before any load
    assert len(want.tokens) > 50  # long enough to outgrow the client's buffers

    async def engine_finishes(request_id: str) -> None:
        # The engine runs the request to its end while its reader reads nothing.
        await until(lambda: request_id not in srv.engine.debug.step_planner.requests)

    async def hostile():
        return await asyncio.gather(*(_slow_read(srv, SLOW, engine_finishes) for _ in range(3)))

    for got, _ in await under_load(srv, clean, hostile):
        assert_same(got, want)


async def test_clients_that_hang_up_mid_stream_free_their_requests(srv, clean):
    state = srv.app[STATE]
    ids: list[str] = []
    cut_while_running = 0

    async def hang_up(i: int) -> None:
        nonlocal cut_while_running
        body = {**SLOW, "seed": i, "stream": True}
        resp = await srv.session.post(srv.url + COMP, json=body, headers=key("hostile"))
        assert resp.status == 200
        ids.append(resp.headers["x-request-id"])
        await resp.content.readline()  # the first event: generation has started
        cut_while_running += ids[-1] in srv.engine.debug.step_planner.requests
        resp.close()  # drop the connection without reading the rest

    async def hostile():
        await asyncio.gather(*(hang_up(i) for i in range(8)))
        # Each hang-up aborts its request: the server and the engine let go of all of them.
        await until(lambda: not set(ids) & (state.request_ids | set(srv.engine.debug.step_planner.requests)))

    await under_load(srv, clean, hostile)
    assert len(ids) == 8 and cut_while_running >= 1


# --- access -----------------------------------------------------------------------------------


async def test_another_tenants_adapter_looks_like_one_that_does_not_exist(srv, clean):
    path = srv.adapter_dir("globex", "victims-own")
    status, info = await srv.register("victims-own", path, tenant="victim")
    assert status == 201, info
    try:
        models = ["acme", f"{BASE}:globex", "victims-own", f"{BASE}:victims-own", "no-such-adapter"]
        results = await under_load(
            srv, clean, lambda: asyncio.gather(*(srv.post(COMP, {**HOSTILE_GREEDY, "model": m}) for m in models))
        )
        for model, (status, body) in zip(models, results):
            assert_refused(status, body, 404, "model_not_found", "model")
            assert body["error"]["message"] == f"The model `{model}` does not exist or you do not have access to it."
        async with srv.session.get(srv.url + "/v1/models", headers=key("hostile")) as resp:
            assert {m["id"] for m in (await resp.json())["data"]} == {BASE, "initech"}
        assert (await srv.post(COMP, {**victim_body("victims-own", "hi"), "max_tokens": 2}, "victim"))[0] == 200
    finally:
        assert await srv.delete("victims-own") == 200


# --- afterwards -------------------------------------------------------------------------------


async def test_afterwards_no_kv_page_is_held_and_no_answer_was_a_5xx(srv, clean):
    state = srv.app[STATE]
    await until(lambda: not state.request_ids and not srv.engine.debug.step_planner.requests)
    async with srv.session.get(srv.url + "/internal/state", headers=key("admin")) as resp:
        engine = (await resp.json())["engine"]
    assert engine["pool_pages_kv"] == 0 and engine["running"] == 0 and engine["queue_depth"] == 0, engine
    assert engine["pool_pages_free"] + engine["pool_pages_adapters"] == engine["pool_pages_total"], engine
    answered = metric(await srv.metrics(), "lorapage_requests_total")
    assert answered and not [s for s in answered if s.labels["status"].startswith("5")], answered
