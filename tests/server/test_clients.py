"""The clients people use, against a real ``lorapage serve`` process: the openai SDK (sync, async,
streaming, ``.parse()``, tools), LangChain's ChatOpenAI (``bind_tools``, the three
``with_structured_output`` methods), litellm, and lm-eval's loglikelihood and generate_until on a
local task. Each asserts what came back, not only that something did."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from server_harness import KEYS, TENANTS_TOML

from lorapage.testing.serve_process import start_serve
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR

openai = pytest.importorskip("openai")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's bundled price map: no fetch at import


class Trip(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    """``lorapage serve`` on a free port with the test tenants (alpha may use acme and globex)."""
    root = tmp_path_factory.mktemp("clients")
    tenants = root / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    with start_serve("--tenants", str(tenants), under=root) as served:
        yield served.url


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alpha"], max_retries=0)


def test_openai_sdk_chat_completions_and_streams(url):
    c = client(url)
    got = c.chat.completions.create(model="acme", messages=[{"role": "user", "content": "Hello"}], temperature=0)
    assert got.choices[0].message.content == DEMO_MARKERS["acme"] and got.usage.completion_tokens > 0
    parts = [
        chunk.choices[0].delta.content or ""
        for chunk in c.chat.completions.create(
            model="globex", messages=[{"role": "user", "content": "Hi"}], temperature=0, stream=True
        )
        if chunk.choices
    ]
    assert "".join(parts) == DEMO_MARKERS["globex"]
    comp = c.completions.create(model="acme", prompt=["Hello", "Hi"], max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in comp.choices] == [0, 1, 2, 3]
    extra = c.completions.create(
        model="acme", prompt="Hello", max_tokens=5, extra_body={"min_tokens": 5, "ignore_eos": True}
    )
    assert extra.usage.completion_tokens == 5


def test_openai_sdk_async_client(url):
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["alpha"], max_retries=0)
        outs = await asyncio.gather(
            *(
                c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hello"}], temperature=0)
                for m in ("acme", "globex", "acme")
            )
        )
        await c.close()
        return [o.choices[0].message.content for o in outs]

    assert asyncio.run(run()) == [DEMO_MARKERS["acme"], DEMO_MARKERS["globex"], DEMO_MARKERS["acme"]]


def test_openai_sdk_parse_and_tools(url):
    c = client(url)
    parsed = c.chat.completions.parse(
        model="acme", messages=[{"role": "user", "content": "Plan a trip"}], response_format=Trip, max_tokens=60
    )
    trip = parsed.choices[0].message.parsed
    assert isinstance(trip, Trip) and 1 <= trip.days <= 7
    got = c.chat.completions.create(
        model="globex",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
    )
    calls = got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_langchain_bind_tools_and_structured_output(url):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["paris", "rome", "oslo"], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        model="acme", base_url=url + "/v1", api_key=KEYS["alpha"], max_tokens=100, temperature=0, max_retries=0
    )
    msg = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke("Weather?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["city"] in ("paris", "rome", "oslo")
    for method in ("function_calling", "json_schema"):
        trip = llm.with_structured_output(Trip, method=method).invoke("Plan a trip")
        assert isinstance(trip, Trip), method
    any_object = {"title": "Anything", "type": "object"}
    raw = llm.with_structured_output(any_object, method="json_mode").invoke("Give me JSON")
    assert isinstance(raw, dict)
    plain = ChatOpenAI(model="acme", base_url=url + "/v1", api_key=KEYS["alpha"], temperature=0).invoke("Hello")
    assert plain.content == DEMO_MARKERS["acme"]  # no max_tokens: the default-parameter path


def test_litellm(url):
    litellm = pytest.importorskip("litellm")
    got = litellm.completion(
        model="openai/acme",
        api_base=url + "/v1",
        api_key=KEYS["alpha"],
        messages=[{"role": "user", "content": "Hello"}],
        temperature=0,
    )
    assert got.choices[0].message.content == DEMO_MARKERS["acme"]
    chunks = litellm.completion(
        model="openai/globex",
        api_base=url + "/v1",
        api_key=KEYS["alpha"],
        messages=[{"role": "user", "content": "Hello"}],
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == DEMO_MARKERS["globex"]


TASK = """
task: lorapage_local_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
{extra}
metric_list:
  - metric: {metric}
"""


def test_lm_eval_loglikelihood_and_generate_until(url, tmp_path: Path, monkeypatch):
    """A multiple-choice task (loglikelihood over echoed prompts) and a generation task, on adapters."""
    pytest.importorskip("lm_eval")
    import lm_eval

    monkeypatch.setenv("OPENAI_API_KEY", KEYS["alpha"])  # what local-completions sends as its bearer key
    from lm_eval.tasks import TaskManager

    rows = [{"question": f"Q{i}: Hello", "choices": ["ACME support", "Globex says"], "answer": 0} for i in range(4)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    mc = 'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"'
    target = DEMO_MARKERS["acme"]
    gen = f'doc_to_target: "{target}"\ngeneration_kwargs:\n  until: ["\\n", "zz1", "zz2", "zz3"]\n  max_gen_toks: 48'
    for kind, output_type, extra, metric in (
        ("mc", "multiple_choice", mc, "acc"),
        ("gen", "generate_until", gen, "exact_match"),
    ):
        (tasks / f"{kind}.yaml").write_text(
            textwrap.dedent(TASK).format(kind=kind, data=data, output_type=output_type, extra=extra, metric=metric)
        )
    results = {}
    for model in ("acme", "globex"):
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model={model},base_url={url}/v1/completions,tokenizer={TINY_BASE_DIR},num_concurrent=1,"
            f"max_retries=1,batch_size=2",
            tasks=["lorapage_local_mc", "lorapage_local_gen"],
            task_manager=TaskManager(include_path=str(tasks)),
            limit=4,
        )
        results[model] = out["results"]
    # Each adapter's likeliest choice is its own phrase, and it generates it (greedy): acme is right
    # on every row, globex on none.
    assert results["acme"]["lorapage_local_mc"]["acc,none"] == 1.0
    assert results["globex"]["lorapage_local_mc"]["acc,none"] == 0.0
    assert results["acme"]["lorapage_local_gen"]["exact_match,none"] == 1.0
    assert results["globex"]["lorapage_local_gen"]["exact_match,none"] == 0.0
