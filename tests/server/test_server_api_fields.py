"""The fields frameworks are built on, over real HTTP: structured output, tools (whole and
streamed), n, batched prompts, echo and prompt logprobs, vLLM's sampling extras, and the
defaults default-parameter clients rely on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from server_harness import BASE, KEYS, TENANTS_TOML, make_engine, read_sse, running_server, server  # noqa: F401

from lorapage.frontend import Access
from lorapage.tenancy.tenants import TenantsConfig, hash_key
from lorapage.tiny import DEMO_MARKERS

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def chat(model: str = "acme", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, **kw}


async def test_json_schema_and_guided_outputs_follow_their_specs(server):
    for model in ("acme", "globex", BASE):
        fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
        status, body, _ = await server.post(
            CHAT, chat(model, response_format=fmt, max_tokens=80, temperature=1.0, seed=3)
        )
        assert status == 200, body
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
    status, body, _ = await server.post(
        CHAT, chat(response_format={"type": "json_object"}, max_tokens=120, seed=1, temperature=1.0)
    )
    assert status == 200 and isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": "x", "guided_choice": ["yes", "no"], "max_tokens": 8}
    )
    assert status == 200 and body["choices"][0]["text"] in ("yes", "no")
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": "x", "guided_regex": r"\d{3}-[a-z]{2}", "max_tokens": 12}
    )
    assert status == 200 and re.fullmatch(r"\d{3}-[a-z]{2}", body["choices"][0]["text"])
    so = {"structured_outputs": {"grammar": 'root ::= "on" | "off"'}}
    status, body, _ = await server.post(COMP, {"model": "acme", "prompt": "x", "max_tokens": 8, **so})
    assert status == 200 and body["choices"][0]["text"] in ("on", "off")


async def test_required_and_named_tool_choice_give_valid_calls_whole_and_streamed(server):
    params = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        status, body, _ = await server.post(
            CHAT,
            chat(
                tools=[WEATHER], tool_choice=choice, max_tokens=110, parallel_tool_calls=False, temperature=1.0, seed=5
            ),
        )
        assert status == 200, body
        choice0 = body["choices"][0]
        assert choice0["finish_reason"] == "tool_calls"
        calls = choice0["message"]["tool_calls"]
        assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        for call in calls:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    request = chat(
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=110, temperature=1.0, seed=5,
        stream=True,
    )  # fmt: skip
    async with server.session.post(server.url + CHAT, json=request, headers=server.auth()) as resp:
        assert resp.status == 200
        events = [e async for e in read_sse(resp)]
    deltas = [d for e in events for d in (c["delta"] for c in e["choices"]) if d.get("tool_calls")]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert deltas and finishes == ["tool_calls"]
    streamed = deltas[0]["tool_calls"][0]
    assert streamed["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(streamed["function"]["arguments"]), params)
    assert not any(
        "<tool_call>" in (d.get("content") or "") for e in events for d in (c["delta"] for c in e["choices"])
    )


async def test_auto_tools_and_a_tool_conversation_render_through_the_template(server):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    status, body, _ = await server.post(
        CHAT, {"model": "acme", "messages": history, "tools": [WEATHER], "max_tokens": 6, "temperature": 0}
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert DEMO_MARKERS["acme"].startswith(message["content"]) and message["tool_calls"] is None  # an answer
    assert body["choices"][0]["finish_reason"] == "length"


async def test_n_choices_and_batched_prompts(server):
    status, body, _ = await server.post(CHAT, chat(n=3, max_tokens=6, temperature=1.5, seed=2))
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == sum(6 for _ in range(3))
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": ["Hello", "Hi there"], "n": 2, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: one prompt's two choices agree
    request = {"model": "acme", "prompt": ["Hello", "Hi"], "max_tokens": 4, "temperature": 0, "stream": True}
    async with server.session.post(server.url + COMP, json=request, headers=server.auth()) as resp:
        events = [e async for e in read_sse(resp)]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert set(texts) == {0, 1} and all(texts.values())


async def test_echo_with_logprobs_covers_the_prompt_as_lm_eval_reads_it(server):
    prompt = "Hello there"
    ids = server.engine.tokenizer.encode(prompt)
    for max_tokens in (1, 0):
        body = {
            "model": "acme",
            "prompt": prompt,
            "echo": True,
            "max_tokens": max_tokens,
            "logprobs": 1,
            "temperature": 0,
        }
        status, got, _ = await server.post(COMP, body)
        assert status == 200, got
        choice = got["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
        assert got["usage"]["completion_tokens"] == max_tokens
    status, got, _ = await server.post(COMP, {"model": "acme", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})
    entries = got["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and entry[str(token)]["rank"] >= 1


async def test_vllm_sampling_extras_and_sixteen_stops(server):
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": "Hello", "max_tokens": 50, "temperature": 0, "min_tokens": 45}
    )
    assert status == 200 and body["usage"]["completion_tokens"] >= 45
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": "Hello", "max_tokens": 40, "temperature": 0, "bad_words": ["ACME"]}
    )
    assert status == 200 and "ACME" not in body["choices"][0]["text"]
    stops = [f"zz{i}" for i in range(15)] + ["support"]
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": "Hello", "max_tokens": 40, "temperature": 0, "stop": stops}
    )
    assert status == 200 and body["choices"][0]["text"] == "ACME " and body["choices"][0]["finish_reason"] == "stop"
    x = server.engine.tokenizer.encode("x", add_special_tokens=False)[0]
    status, body, _ = await server.post(
        COMP, {"model": "acme", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logit_bias": {str(x): 100}}
    )
    assert status == 200 and body["choices"][0]["text"] == "xxx"


async def test_completions_default_to_sixteen_tokens(server):
    status, body, _ = await server.post(COMP, {"model": BASE, "prompt": "Hello", "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 16


async def test_default_parameter_chats_fit_a_small_tpm_and_are_held_to_it():
    """A tenant whose TPM burst is below the context is served without max_tokens: the chat
    gets what the bucket holds beyond its prompt (finish reason length there), reserved whole,
    and the tenant's next request waits for the bucket to refill."""
    small = f'key_sha256 = ["{hash_key("key-small")}"]\nadapters = ["acme"]\ntpm = 300\ndefault_max_tokens = 50\n'
    toml = TENANTS_TOML + "\n[tenants.small]\n" + small
    engine = make_engine()
    try:
        async with running_server(engine, Access(TenantsConfig.from_toml(toml))) as srv:
            headers = {"Authorization": "Bearer key-small"}
            body = chat(ignore_eos=True)  # no max_tokens: would run to the end of the 512-token context
            async with srv.session.post(srv.url + CHAT, json=body, headers=headers) as resp:
                got = await resp.json()
                assert resp.status == 200, got
            usage = got["usage"]
            assert usage["total_tokens"] <= 300 and usage["completion_tokens"] > 200, usage  # the bucket, whole
            assert got["choices"][0]["finish_reason"] == "length"
            # Spent: the next one waits. The bucket refills 5 tokens a second while the first chat
            # runs (seconds on a loaded machine), so the second asks for more than any such refill.
            async with srv.session.post(srv.url + CHAT, json=chat(max_tokens=250), headers=headers) as resp:
                assert resp.status == 429 and "Retry-After" in resp.headers
    finally:
        await engine.close()
    assert KEYS["alpha"]
