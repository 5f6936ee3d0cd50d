"""Tool calls: each family's format parsed whole and streamed, the constrained grammar making any
model write valid calls, and tools / tool messages rendered through a chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engine_util import collect, tiny_engine

from lorapage import SamplingParams
from lorapage.structured import StructuredSpec
from lorapage.tools import FORMATS, ToolStream, conversation, detect_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
CALL = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
OUTPUTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "parameters": {"zone": 1}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"zone": 1}}]',
    "qwen3_coder": "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
    "<parameter=zone>\n1\n</parameter>\n</function>\n</tool_call>",
    "pythonic": '[get_weather(city="Paris", unit="celsius"), get_time(zone=1)]',
}
WITH_TEXT = ("hermes", "qwen3_coder")  # formats whose OUTPUTS hold text before the calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_parses_its_calls_whole_and_streamed(fmt):
    text = OUTPUTS[fmt]
    content, calls = FORMATS[fmt].parse(text, tools=[WEATHER, TIME])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": 1}),
    ]
    assert content == ("Let me check.\n" if fmt in WITH_TEXT else "")
    assert len({c.id for c in calls}) == 2
    # Mistral's template takes back 9-character ids only (vLLM's mistral parser makes them so).
    assert all(c.id.startswith("call_") or (fmt == "mistral" and len(c.id) == 9 and c.id.isalnum()) for c in calls)
    stream = ToolStream(FORMATS[fmt], [WEATHER, TIME])
    streamed = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, again = stream.finish()
    assert streamed + rest == content and [c.name for c in again] == ["get_weather", "get_time"]
    assert "<tool" not in streamed and "[TOOL" not in streamed  # no marker leaked as content


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_text_that_is_no_call_stays_content(fmt):
    for text in ("Just an answer.", "<tool_call>\n{not json}\n</tool_call>", "[TOOL_CALLS] nope", "{broken"):
        stream = ToolStream(FORMATS[fmt])
        streamed = stream.feed(text)
        rest, calls = stream.finish()
        if not FORMATS[fmt].parse(text)[1]:
            assert calls == [] and streamed + rest == text


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_output_cut_short_keeps_the_calls_it_finished(fmt):
    """Cut by max_tokens at every length: the calls finished before the cut (and one whose
    closing tag alone was cut) are kept, the one being written dropped; the content never holds
    call markup. Streamed alike."""
    text, parse = OUTPUTS[fmt], FORMATS[fmt].parse
    whole = [(c.name, c.arguments) for c in parse(text)[1]]
    seen = set()
    for cut in range(len(text)):
        content, calls = parse(text[:cut], cut=True)
        got = [(c.name, c.arguments) for c in calls]
        assert got == whole[: len(got)], (cut, got)
        seen.add(len(got))
        assert not any(m in content for m in ("<tool", "[TOOL", "{")), (cut, content)
        stream = ToolStream(FORMATS[fmt])
        released = "".join(stream.feed(text[i : min(i + 3, cut)]) for i in range(0, cut, 3))
        left, streamed = stream.finish(cut=True)
        assert [(c.name, c.arguments) for c in streamed] == got and released + left == content, cut
    assert {0, 1} <= seen  # cuts before the first call ends, and between the two
    # One whose closing tag alone was cut is a call (Hermes: the JSON is whole).
    if fmt == "hermes":
        assert len(parse(text[: text.rfind("</tool_call>") + 5], cut=True)[1]) == 2


def test_the_format_follows_the_chat_template():
    assert detect_format("{{ '<tool_call>' }}").name == "hermes"
    assert detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_format("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert detect_format(None).name == "hermes"


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one_call"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_required_tool_choice_makes_even_an_untrained_adapter_write_valid_calls(fmt, parallel):
    """The tiny model knows nothing of tools; under the grammar every output is one or more valid
    calls to the given tools, their arguments valid against the tools' schemas."""
    engine = tiny_engine()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    try:
        for adapter, seed in [("acme", 1), ("globex", 2), (None, 3), ("initech", 4)]:
            spec = StructuredSpec("grammar", FORMATS[fmt].grammar([WEATHER, TIME], parallel), param="tool_choice")
            params = SamplingParams(max_tokens=450, temperature=1.0, seed=seed, structured=spec)
            out, _ = await collect(engine, "What is the weather?", adapter, params)
            # Qwen3-Coder's markup is the longest: four of its calls take more of the tiny model's
            # byte-level tokens than its 512-token context holds, so there a cut keeps those finished.
            long_markup = fmt == "qwen3_coder" and parallel
            assert out.finish_reason == "stop" or long_markup, out.text
            content, calls = FORMATS[fmt].parse(out.text, out.finish_reason == "length", [WEATHER, TIME])
            assert calls and content == "" and (parallel or len(calls) == 1), out.text
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    finally:
        await engine.close()


def test_tools_reach_a_template_that_knows_them_as_transformers_passes_them():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    out, kwargs = conversation(messages, [WEATHER], FORMATS["hermes"], "{% for t in tools %}{% endfor %}")
    assert kwargs == {"tools": [WEATHER]} and out[2] == messages[2]
    assert out[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}


async def test_tools_reach_the_tiny_template_through_the_roles_it_has():
    """The tiny model's template takes system, user and assistant only (it raises on others)."""
    engine = tiny_engine()
    try:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        ]
        rendered, kwargs = conversation(messages, [WEATHER], FORMATS["hermes"], engine.tokenizer.chat_template)
        text = engine.tokenizer.apply_chat_template(rendered, **kwargs)
        assert "Be brief." in text and '"get_weather"' in text and "<tools>" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<tool_response>\n18C\n</tool_response>" in text
    finally:
        await engine.close()
