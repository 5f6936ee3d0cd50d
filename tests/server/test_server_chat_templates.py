"""Chat templates and tool parsers per family over real HTTP: the tiny model given Qwen3's and
Qwen3-Coder's published templates (tests/tools/chat_templates). ``chat_template_kwargs`` reach
the template (Qwen3's ``enable_thinking``) on the chat route and /tokenize, and keys the server
owns are refused, as is a request's own template; with ``--reasoning-parser qwen3`` the
``<think>`` block goes to ``reasoning_content``; ``tool_choice`` auto parses the family's calls
(Hermes for Qwen3, the XML-ish form with typed arguments for Qwen3-Coder), whole and streamed.
The tiny model writes no calls of itself, so a one-choice ``guided_choice`` makes it write one."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from server_harness import KEYS, read_sse, running_server

from lorapage import Engine, EngineConfig
from lorapage.engine.flags import add_engine_arguments, engine_config
from lorapage.frontend.prompts import PromptBuilder
from lorapage.model.tokenizer import Tokenizer
from lorapage.tiny import TINY_BASE_DIR

pytestmark = pytest.mark.asyncio(loop_scope="module")
TEMPLATES = Path(__file__).parents[1] / "tools" / "chat_templates"
CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
THOUGHT = "<think>\nCheck the weather.\n</think>\n\n"
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "</function>\n</tool_call>"
)


def family_model(root: Path, template: str) -> Path:
    """The tiny model with ``template`` as its chat_template.jinja (its own template removed)."""
    path = root / "base"
    shutil.copytree(TINY_BASE_DIR, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TEMPLATES / template, path / "chat_template.jinja")
    return path


async def family_server(template: str, **config) -> AsyncIterator:
    root = Path(tempfile.mkdtemp(prefix="lorapage-family-"))
    # The published templates' tool prompts take ~700 byte-level tokens: past the tiny model's 512.
    engine = Engine(
        EngineConfig(
            model=str(family_model(root, template)), max_model_len=2048, allow_long_max_model_len=True, **config
        )
    )
    try:
        async with running_server(engine) as srv:
            yield srv
    finally:
        await engine.close()
        shutil.rmtree(root)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3():
    async for srv in family_server("qwen3.jinja", reasoning_parser="qwen3"):
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def coder():
    async for srv in family_server("qwen3_coder.jinja"):
        yield srv


def chat(**kw) -> dict:
    return {"model": "base", "messages": [{"role": "user", "content": "Weather?"}], "temperature": 0, **kw}


def forced(text: str, **kw) -> dict:
    """A chat whose answer is ``text`` (a one-choice guided_choice), with the weather tool offered."""
    return chat(tools=[WEATHER], tool_choice="auto", guided_choice=[text], max_tokens=len(text) + 8, **kw)


async def test_chat_template_kwargs_reach_the_template_on_chat_and_tokenize(qwen3):
    msgs = [{"role": "user", "content": "hi"}]
    status, on, _ = await qwen3.post("/tokenize", {"messages": msgs})
    assert status == 200, on
    off_body = {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    status, off, _ = await qwen3.post("/tokenize", off_body)
    assert status == 200, off
    status, tail, _ = await qwen3.post("/detokenize", {"tokens": off["tokens"][on["count"] :]})
    assert tail["prompt"] == "<think>\n\n</think>\n\n"
    status, body, _ = await qwen3.post(
        CHAT, chat(messages=msgs, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == off["count"], body
    status, body, _ = await qwen3.post(
        CHAT, chat(messages=msgs, max_tokens=2, chat_template_kwargs={"unused": [1, {"a": 2}]})
    )
    assert (
        status == 200 and body["usage"]["prompt_tokens"] == on["count"]
    )  # a key the template does not read: no change


@pytest.mark.parametrize("route", [CHAT, "/tokenize"])
async def test_template_keys_the_server_owns_and_request_templates_are_refused(qwen3, route):
    base = chat(max_tokens=2) if route == CHAT else {"messages": [{"role": "user", "content": "hi"}]}
    for key in ("messages", "tools", "add_generation_prompt", "bos_token", "raise_exception"):
        status, body, _ = await qwen3.post(route, {**base, "chat_template_kwargs": {key: 1, "enable_thinking": False}})
        assert status == 400 and body["error"]["param"] == f"chat_template_kwargs.{key}", body
        assert key in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    status, body, _ = await qwen3.post(route, {**base, "chat_template_kwargs": ["enable_thinking"]})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs" and "object" in body["error"]["message"]
    status, body, _ = await qwen3.post(route, {**base, "chat_template": "{{ messages }}"})
    assert status == 400 and body["error"]["param"] == "chat_template", body
    assert "--trust-request-chat-template" in body["error"]["message"]


async def test_qwen3_thinking_goes_to_reasoning_content_and_auto_tools_parse_hermes_calls(qwen3):
    status, body, _ = await qwen3.post(CHAT, forced(THOUGHT + HERMES_CALL))
    assert status == 200, body
    choice = body["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "\nCheck the weather.\n" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert choice["finish_reason"] == "tool_calls"
    status, body, _ = await qwen3.post(CHAT, forced(THOUGHT + "It is sunny."))
    assert body["choices"][0]["message"]["content"] == "\n\nIt is sunny."
    assert body["choices"][0]["message"]["tool_calls"] is None and body["choices"][0]["finish_reason"] == "stop"


async def test_qwen3_thinking_and_calls_stream_apart(qwen3):
    hdrs = {"Authorization": f"Bearer {KEYS['alpha']}"}
    async with qwen3.session.post(
        qwen3.url + CHAT, json=forced(THOUGHT + HERMES_CALL, stream=True), headers=hdrs
    ) as resp:
        assert resp.status == 200
        deltas = [c["delta"] for e in [e async for e in read_sse(resp)] for c in e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert reasoning == "\nCheck the weather.\n" and content.strip() == ""
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


async def test_qwen3_coder_calls_parse_with_typed_arguments_whole_and_streamed(coder):
    status, body, _ = await coder.post(CHAT, forced("Let me look.\n" + CODER_CALL))
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] == "Let me look.\n" and "reasoning_content" not in message  # no reasoning parser
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    hdrs = {"Authorization": f"Bearer {KEYS['alpha']}"}
    async with coder.session.post(coder.url + CHAT, json=forced(CODER_CALL, stream=True), headers=hdrs) as resp:
        deltas = [c["delta"] for e in [e async for e in read_sse(resp)] for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert [json.loads(t["function"]["arguments"]) for t in calls] == [{"city": "Paris", "days": 3}]


async def test_tool_call_parser_flag_overrides_the_template(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    model = family_model(tmp_path, "qwen3_coder.jinja")
    config = engine_config(parser.parse_args(["--model", str(model), "--tool-call-parser", "pythonic"]), "test")
    assert config.tool_call_parser == "pythonic" and config.reasoning_parser == "none"
    tokenizer = Tokenizer.from_dir(model)
    assert PromptBuilder(tokenizer, 512).tool_format.name == "qwen3_coder"
    assert PromptBuilder(tokenizer, 512, tool_call_parser=config.tool_call_parser).tool_format.name == "pythonic"
    with pytest.raises(SystemExit):
        engine_config(parser.parse_args(["--model", str(model), "--tool-call-parser", "nope"]), "test")
