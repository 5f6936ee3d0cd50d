"""The official openai client against a real server; streaming equals non-streaming; adapters interleave."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from openai import AsyncOpenAI, NotFoundError
from server_harness import BASE, KEYS, expected_text, read_sse, server  # noqa: F401 (the module's fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODELS = [BASE, "acme", f"{BASE}:globex"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}]


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], max_retries=0) as c:
        yield c


@pytest.mark.parametrize("model", MODELS)
async def test_chat_whole_and_streamed(client, model):
    want = expected_text(model)
    whole = await client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=48)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = await client.chat.completions.create(
        model=model,
        messages=CHAT,
        temperature=0,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
    assert usage == whole.usage


@pytest.mark.parametrize("model", MODELS)
async def test_completions_whole_and_streamed(client, model):
    whole = await client.completions.create(model=model, prompt="Hello there", temperature=0, max_tokens=48)
    assert whole.choices[0].text == expected_text(model) and whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens >= 1 and whole.usage.completion_tokens >= 1

    stream = await client.completions.create(
        model=model,
        prompt="Hello there",
        temperature=0,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        texts.extend(c.text for c in chunk.choices)
    assert "".join(texts) == whole.choices[0].text
    assert usage == whole.usage


async def test_length_finish_and_logprobs(client):
    out = await client.chat.completions.create(
        model="acme", messages=CHAT, temperature=0, max_completion_tokens=3, logprobs=True, top_logprobs=2
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 3
    assert len(choice.logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    text = await client.completions.create(model="globex", prompt="Hi", temperature=0, max_tokens=2, logprobs=1)
    assert len(text.choices[0].logprobs.tokens) == 2


async def test_models_list_adapters_with_parent(client):
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {BASE, "acme", "globex"}  # initech belongs to beta
    assert models["acme"].parent == BASE and models[BASE].parent is None
    assert (await client.models.retrieve("globex")).id == "globex"
    with pytest.raises(NotFoundError):
        await client.models.retrieve("initech")


async def test_adapter_headers(server):
    body = {"model": "acme", "prompt": "x", "max_tokens": 2}
    status, _, headers = await server.post("/v1/completions", body)
    assert status == 200
    assert headers["x-adapter-id"] == "acme" and headers["x-adapter-tier"] in ("gpu", "ram", "disk")
    status, _, headers = await server.post("/v1/completions", {**body, "model": BASE})
    assert headers["x-adapter-id"] == "none" and headers["x-adapter-tier"] == "none"


async def test_sixteen_streams_interleave_and_stay_separate(server):
    """16 concurrent greedy streams over three adapters and the base: each gets only its own phrase,
    and chunks of different adapters arrive interleaved (one batch, not one request after another)."""
    models = [["acme", "globex", f"{BASE}:acme", BASE][i % 4] for i in range(16)]
    arrivals: list[int] = []

    async def one(i: int, model: str) -> str:
        messages = [{"role": "user", "content": f"request {i}"}]
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 48, "stream": True}
        async with server.session.post(server.url + "/v1/chat/completions", json=body, headers=server.auth()) as resp:
            assert resp.status == 200
            text = ""
            async for chunk in read_sse(resp):
                piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if piece:
                    arrivals.append(i)
                    text += piece
            return text

    texts = await asyncio.wait_for(asyncio.gather(*(one(i, m) for i, m in enumerate(models))), timeout=60)
    for model, text in zip(models, texts):
        assert text == expected_text(model)
    adapter_of = [m.rpartition(":")[2] for m in models]
    switches = sum(1 for a, b in zip(arrivals, arrivals[1:]) if adapter_of[a] != adapter_of[b])
    assert switches >= 16, f"streams did not interleave: {arrivals}"
