"""OpenAI's Responses API on a real server: the openai SDK's ``responses.create`` whole and
streamed, function tools (forced by the tool grammar, so the untrained tiny adapters return valid
calls), a conversation with tool results sent back, structured text, clear 400s for what lorapage
does not do, and the OpenAI Agents SDK's default path pointed at the server.

The context is 2048 tokens here: the tools' system prompt alone is longer than the tiny model's
512 when every byte is a token.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
import pytest_asyncio
from openai import AsyncOpenAI, BadRequestError, NotFoundError
from server_harness import (
    BASE,
    KEYS,
    Server,
    assert_openai_error,
    expected_text,
    make_engine,
    make_roots,
    running_server,
)

from lorapage.tools import FORMATS, conversation

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODELS = [BASE, "acme", f"{BASE}:globex"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="lorapage-adapter-root-")).resolve()
    engine = make_engine(make_roots(root), max_model_len=2048, allow_long_max_model_len=True)
    try:
        async with running_server(engine) as srv:
            yield srv
    finally:
        await engine.close()
        shutil.rmtree(root)


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], max_retries=0) as c:
        yield c


@pytest.mark.parametrize("model", MODELS)
async def test_text_whole_and_streamed(client, model):
    whole = await client.responses.create(model=model, input="Who are you?", temperature=0, max_output_tokens=64)
    assert whole.output_text == expected_text(model)
    assert whole.status == "completed" and whole.id.startswith("resp_")
    assert whole.model == model.rpartition(":")[2]  # the id as /v1/models lists it, as chat completions echo it
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].status == "completed"
    usage = whole.usage
    assert usage.input_tokens >= 1 and usage.output_tokens >= 1
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    stream = await client.responses.create(
        model=model, input="Who are you?", temperature=0, max_output_tokens=64, stream=True
    )
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.usage == whole.usage and final.id == events[0].response.id


async def test_cut_by_max_output_tokens_is_incomplete(client):
    whole = await client.responses.create(model="acme", input="Who are you?", temperature=0, max_output_tokens=3)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and whole.output[0].status == "incomplete"
    stream = await client.responses.create(
        model="acme", input="Who are you?", temperature=0, max_output_tokens=3, stream=True
    )
    events = [event async for event in stream]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text


def _rendered_tokens(server, messages, tools=None) -> int:
    """Tokens of ``messages`` (chat shape) as the model's template renders them with ``tools``."""
    tokenizer = server.engine.tokenizer
    chat_tools = [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
        for t in tools or []
    ]
    rendered, kwargs = conversation(messages, chat_tools or None, FORMATS["hermes"], tokenizer.chat_template)
    return len(tokenizer.encode(tokenizer.apply_chat_template(rendered, **kwargs), add_special_tokens=False))


async def test_instructions_and_input_items_become_the_conversation(server, client):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi."}, {"type": "input_text", "text": "Who?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Bonjour.", "annotations": []}],
        },
        {"role": "user", "content": "Again?"},
    ]
    got = await client.responses.create(
        model="acme", instructions="Be brief.", input=items, temperature=0, max_output_tokens=64, metadata={"k": "v"}
    )
    assert got.output_text == expected_text("acme") and got.metadata == {"k": "v"}
    assert got.instructions == "Be brief."
    want = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi.\nWho?"},
        {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "Again?"},
    ]
    assert got.usage.input_tokens == _rendered_tokens(server, want)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_required_tool_choice_returns_valid_calls(client, stream):
    kwargs = dict(
        model="acme",
        input="What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=400,
    )
    if not stream:
        got = await client.responses.create(**kwargs)
    else:
        events = [event async for event in await client.responses.create(**kwargs, stream=True)]
        got = events[-1].response
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds  # a call never leaks as text
        assert kinds[2:6] == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert events[3].delta == got.output[0].arguments
    assert got.status == "completed"
    assert [item.type for item in got.output] == ["function_call"]
    call = got.output[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


async def test_a_named_function_is_the_one_called(client):
    got = await client.responses.create(
        model=BASE,
        input="What time is it?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        temperature=1.0,
        max_output_tokens=400,
    )
    assert [(item.type, item.name) for item in got.output] == [("function_call", "get_time")]
    jsonschema.validate(json.loads(got.output[0].arguments), SCHEMAS["get_time"])


async def test_tool_results_sent_back_are_rendered_through_the_template(server, client):
    """The Agents SDK's second turn: the call the model made and its output, sent back as items."""
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
    ]
    got = await client.responses.create(model="acme", input=items, tools=[WEATHER], temperature=0, max_output_tokens=64)
    assert got.status in ("completed", "incomplete")
    want = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    assert got.usage.input_tokens == _rendered_tokens(server, want, [WEATHER])
    # tool_choice none: the tools are not offered (and no call is parsed), the history still renders.
    plain = await client.responses.create(
        model="acme", input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=8
    )
    assert plain.usage.input_tokens == _rendered_tokens(server, want)


async def test_text_format_json_schema_is_followed(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    got = await client.responses.create(
        model="globex",
        input="Is it raining?",
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
        temperature=1.0,
        max_output_tokens=200,
    )
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 4000}, "max_output_tokens"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
    ],
)
async def test_what_lorapage_does_not_do_is_a_clear_400(server, extra, param):
    body = {"model": "acme", "input": "hi", **extra}
    status, got, _ = await server.post("/v1/responses", body)
    assert status == 400, got
    assert_openai_error(got, 400, param)


async def test_visibility_and_keys_as_everywhere(server, client):
    with pytest.raises(NotFoundError):
        await client.responses.create(model="initech", input="hi")  # beta's adapter
    status, got, _ = await server.post("/v1/responses", {"model": "acme", "input": "hi"}, tenant=None)
    assert status == 401
    assert_openai_error(got, 401)
    with pytest.raises(BadRequestError):
        await client.responses.create(model="acme", input="x" * 9000)  # past the context


async def test_openai_agents_sdk_default_path(server):
    """The Agents SDK's default model path is the Responses API: a run, a streamed run, and a run
    whose tool the model must call (the call executed, its output sent back, a final answer)."""
    agents = pytest.importorskip("agents", reason="openai-agents is in the dev extra")
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    try:
        settings = agents.ModelSettings(temperature=0, max_tokens=300)
        agent = agents.Agent(name="support", instructions="Be brief.", model="acme", model_settings=settings)
        assert (await agents.Runner.run(agent, "Who are you?")).final_output == expected_text("acme")
        streamed = agents.Runner.run_streamed(agent, "Who are you?")
        kinds = {event.type async for event in streamed.stream_events()}
        assert "raw_response_event" in kinds and streamed.final_output == expected_text("acme")

        forced = agents.ModelSettings(temperature=0, max_tokens=300, tool_choice="required", parallel_tool_calls=False)
        tooled = agents.Agent(name="weather", model="acme", tools=[get_weather], model_settings=forced)
        result = await agents.Runner.run(tooled, "Weather in Paris?")
        assert calls and calls[0] in ("Paris", "Tokyo")
        assert isinstance(result.final_output, str)
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    finally:
        await client.close()
