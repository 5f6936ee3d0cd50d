"""Malformed requests each get the right 4xx in OpenAI's error shape; the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_harness import ADMIN_KEY, BASE, assert_openai_error, make_engine, running_server, server  # noqa: F401 (the module's fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
OK_CHAT = {"model": "acme", "messages": MSGS, "max_tokens": 4}
OK_COMP = {"model": "acme", "prompt": "hi", "max_tokens": 4}


def chat(**fields):
    return {k: v for k, v in {**OK_CHAT, **fields}.items() if v is not ...}


def comp(**fields):
    return {k: v for k, v in {**OK_COMP, **fields}.items() if v is not ...}


# (name, path, body, expected status, expected param: None when the error names no field). `...` removes a field.
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CASES = [
    ("invalid json", CHAT, b"{", 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("json array", CHAT, b"[1, 2]", 400, None),
    ("json string", CHAT, b'"hello"', 400, None),
    ("invalid utf-8", CHAT, b'{"model": "acme", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("missing model", CHAT, chat(model=...), 400, "model"),
    ("missing messages", CHAT, chat(messages=...), 400, "messages"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("message without role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    (
        "tool message without its call id",
        CHAT,
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        "messages[0].tool_call_id",
    ),
    ("made-up role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("content is a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (
        "image content part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages[0].content[0]",
    ),
    (
        "text part with extra key",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]),
        400,
        "messages[0].content[0]",
    ),
    ("null user content", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "messages[0].content"),
    (
        "unknown message field",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]),
        400,
        "messages[0].mood",
    ),
    ("model is a number", CHAT, chat(model=7), 400, "model"),
    ("max_tokens is a string", CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens huge", CHAT, chat(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens beyond int64", CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("max_completion_tokens zero", CHAT, chat(max_tokens=..., max_completion_tokens=0), 400, "max_completion_tokens"),
    ("token limits disagree", CHAT, chat(max_tokens=4, max_completion_tokens=5), 400, "max_completion_tokens"),
    ("negative temperature", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature above 2", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("temperature is a string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top_p above 1", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("negative top_p", CHAT, chat(top_p=-0.1), 400, "top_p"),
    ("negative top_k", CHAT, chat(top_k=-5), 400, "top_k"),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("logprobs is a string", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("n = 65", CHAT, chat(n=65), 400, "n"),
    ("n = 0", CHAT, chat(n=0), 400, "n"),
    ("stream is a string", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (
        "unknown stream option",
        CHAT,
        chat(stream=True, stream_options={"chunk_size": 4}),
        400,
        "stream_options.chunk_size",
    ),
    ("seventeen stop sequences", CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop is a number", CHAT, chat(stop=3), 400, "stop"),
    ("empty stop string", CHAT, chat(stop=[""]), 400, "stop"),
    ("presence_penalty 3", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty -3", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("seed beyond int64", CHAT, chat(seed=2**70), 400, "seed"),
    ("unknown field", CHAT, chat(foo=1), 400, "foo"),
    (
        "tool with a bad name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        400,
        "tools[0].function.name",
    ),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (
        "tool_choice names no tool",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    ("logit_bias key not a token id", CHAT, chat(logit_bias={"x": 5}), 400, "logit_bias"),
    ("logit_bias out of range", CHAT, chat(logit_bias={"12": 500}), 400, "logit_bias"),
    (
        "json_schema without a schema",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
    ),
    ("response_format xml", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    ("two constraints", CHAT, chat(response_format={"type": "json_object"}, guided_regex="a+"), 400, "guided_regex"),
    ("broken regex", CHAT, chat(guided_regex="([a-"), 400, "guided_regex"),
    ("beam search", CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    ("flex service tier", CHAT, chat(service_tier="flex"), 400, "service_tier"),
    ("audio modality", CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    ("prompt missing", COMP, comp(prompt=...), 400, "prompt"),
    ("too many prompts", COMP, comp(prompt=["a"] * 257), 400, "prompt"),
    ("a prompt that is an object", COMP, comp(prompt=["a", {"b": 1}]), 400, "prompt"),
    ("empty prompt list", COMP, comp(prompt=[]), 400, "prompt"),
    ("token id outside vocab", COMP, comp(prompt=[1, 10**6]), 400, "prompt"),
    ("booleans as tokens", COMP, comp(prompt=[True, False]), 400, "prompt"),
    ("prompt is an object", COMP, comp(prompt={"text": "hi"}), 400, "prompt"),
    ("echo while streaming", COMP, comp(echo=True, stream=True), 400, "echo"),
    ("best_of 2", COMP, comp(best_of=2), 400, "best_of"),
    ("suffix", COMP, comp(suffix="end"), 400, "suffix"),
    ("completion logprobs 6", COMP, comp(logprobs=6), 400, "logprobs"),
    ("chat-only field on completions", COMP, comp(messages=MSGS), 400, "messages"),
    ("prompt over the character bound", COMP, comp(prompt="x " * 5000, max_tokens=...), 400, "prompt"),
    ("prompt within it, over the context", COMP, comp(prompt="x " * 3000, max_tokens=...), 400, "prompt"),
    ("token ids beyond the context", COMP, comp(prompt=[104] * 600), 400, "prompt"),
    ("chat over the character bound", CHAT, chat(messages=[{"role": "user", "content": "x" * 8000}]), 400, "messages"),
    ("more messages than tokens", CHAT, chat(messages=MSGS * 513, max_tokens=...), 400, "messages"),
    ("unknown adapter", CHAT, chat(model="no-such-adapter"), 404, "model"),
    ("other base", CHAT, chat(model="llama-70b:acme"), 404, "model"),
    ("empty model", CHAT, chat(model=""), 404, "model"),
    ("other tenant's adapter", CHAT, chat(model="initech"), 404, "model"),
]

# Fields OpenAI defines are fine at their defaults, or (tools, constraints, batches) in use.
DEFAULTS_ACCEPTED = [
    chat(tools=None, tool_choice=None, logit_bias=None, response_format=None, n=None, user=None),
    chat(tools=[], tool_choice="none", parallel_tool_calls=True, logit_bias={}),
    chat(tools=[TOOL], tool_choice="auto", logit_bias={"12": 1.5}, n=2),
    chat(response_format={"type": "json_object"}, max_tokens=8),
    comp(prompt=["a", "b"], echo=True, logprobs=1),
    chat(response_format={"type": "text"}, n=1, store=False, service_tier="auto", modalities=["text"]),
    chat(metadata={"k": "v"}, user="u-1", seed=7, stop="zzz", top_k=-1, top_p=0),
    chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "hi"}]}, *MSGS]),
    comp(echo=False, best_of=1, suffix=None, logit_bias={}, logprobs=None, prompt=["hi"]),
    comp(prompt=[104, 105]),
]


async def test_table_of_malformed_requests(server):
    for name, path, body, status, param in CASES:
        got, payload, _ = await server.post(path, body)
        assert got == status, f"{name}: {got} {payload}"
        assert_openai_error(payload, status)
        assert payload["error"]["param"] == param, f"{name}: {payload}"  # None: the error names no field
    assert (await server.post(CHAT, OK_CHAT))[0] == 200


async def test_defaults_of_unimplemented_fields_are_accepted(server):
    for body in DEFAULTS_ACCEPTED:
        path = CHAT if "messages" in body else COMP
        status, payload, _ = await server.post(path, body)
        assert status == 200, (body, payload)


async def test_auth_and_routing_errors(server):
    cases = [
        ("POST", CHAT, {}, 401),
        ("POST", CHAT, {"Authorization": "Bearer wrong"}, 401),
        ("POST", CHAT, {"Authorization": "Basic abc"}, 401),
        ("POST", CHAT, {"Authorization": f"Bearer {ADMIN_KEY}"}, 401),
        ("GET", "/v1/models", {}, 401),
        ("GET", CHAT, server.auth(), 405),
        ("GET", "/v1/nothing-here", server.auth(), 404),
        ("GET", "/internal/state", server.auth(), 403),
        ("POST", "/v1/adapters", server.auth(), 403),
    ]
    for method, path, headers, status in cases:
        got, payload, _ = await server.request(method, path, headers=headers, body=OK_CHAT)
        assert got == status, (method, path, payload)
        assert_openai_error(payload, status)


async def test_ten_megabyte_body(server):
    big = json.dumps({**OK_CHAT, "messages": [{"role": "user", "content": "x" * (10 * 2**20)}]}).encode()
    status, payload, _ = await server.post(CHAT, big)
    assert status == 413
    assert_openai_error(payload, 413)

    async def chunked():
        for _ in range(10):
            yield b"x" * 2**20

    async with server.session.post(server.url + CHAT, data=chunked(), headers=server.auth()) as resp:
        assert resp.status == 413
        assert_openai_error(await resp.json(), 413)
    assert (await server.post(CHAT, OK_CHAT))[0] == 200


async def test_raw_garbage_never_hangs(server):
    """Broken HTTP gets an answer or a closed connection, never a hang; the server still serves."""
    host, port = server.url.removeprefix("http://").split(":")
    for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{", b"\x00\xff" * 100):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
    assert (await server.post(COMP, OK_COMP))[0] == 200


async def test_overloaded_engine_answers_503_with_retry_after():
    engine = make_engine(max_queue_len=0)  # every request finds the queue full
    try:
        async with running_server(engine) as srv:
            status, payload, headers = await srv.post(COMP, {**OK_COMP, "model": BASE})
            assert status == 503
            assert_openai_error(payload, 503)
            assert int(headers["Retry-After"]) >= 1
    finally:
        await engine.close()


async def test_a_flood_from_one_tenant_is_its_own_429_not_a_503():
    """A tenant without max_concurrency may hold its share of the queue (here one request of the
    one-slot queue, three tenants): past it, 429 with Retry-After; the engine never overflows."""
    engine = make_engine(max_queue_len=1, max_num_seqs=1)
    try:
        async with running_server(engine) as srv:
            body = {**OK_COMP, "max_tokens": 32, "model": BASE}
            results = await asyncio.gather(*(srv.post(COMP, body) for _ in range(12)))
            statuses = [s for s, _, _ in results]
            assert set(statuses) == {200, 429}, statuses
            for status, payload, headers in results:
                if status == 429:
                    assert_openai_error(payload, 429)
                    assert int(headers["Retry-After"]) >= 1
            assert (await srv.post(COMP, OK_COMP))[0] == 200
    finally:
        await engine.close()
