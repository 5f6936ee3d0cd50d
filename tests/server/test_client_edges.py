"""The API's rough edges that real clients found (issue 38, findings 11-13 and 15), each with the
client that found it, against a real ``lorapage serve`` process on 127.0.0.1:

- 11: the openai SDK (chat, whole and streamed; the Responses API) when max_tokens cuts an
  output of ``tool_choice: "required"``: the calls finished before the cut are kept, the one
  being written is dropped, finish_reason is ``length`` and no markup is left in the content;
- 12: a JSON schema without ``"additionalProperties": false`` (pydantic's, through the openai
  SDK's ``guided_json``, LangChain's dict schema and instructor's JSON_SCHEMA mode) gets no keys
  it does not name;
- 13: ``guided_regex``'s ``\\d``, ``\\w`` and ``\\s`` are ASCII classes;
- 15: lm-eval's local-completions model, given no ``auth_token``, finds the remote tokenizer
  (its probe is answered without a key) and runs offline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, Field
from server_harness import KEYS, TENANTS_TOML

from lorapage.testing.serve_process import start_serve
from lorapage.tiny import DEMO_MARKERS

openai = pytest.importorskip("openai")

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "Weather?"}]
MARKUP = re.compile(r"<tool|tool_call|</|\{")


class Trip(BaseModel):  # pydantic's schema names no additionalProperties
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("edges")
    tenants = root / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    with start_serve("--tenants", str(tenants), under=root) as served:
        yield served.url


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alpha"], max_retries=0)


# -- 11: a tool call cut by max_tokens --------------------------------------------------------------


def _required(c, max_tokens: int, stream: bool = False):
    return c.chat.completions.create(
        model="globex", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens,
        temperature=0, stream=stream,
    )  # fmt: skip


def _streamed(c, max_tokens: int) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, calls as (name, arguments), finish_reason) of a streamed chat."""
    content, calls, finish = "", [], None
    for chunk in _required(c, max_tokens, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [(t.function.name, t.function.arguments) for t in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    return content, calls, finish


def _first_block_tokens(name: str, arguments: str) -> int:
    """Tokens (the tiny model's are bytes) of the Hermes block the constrained output writes first."""
    body = json.dumps({"name": name, "arguments": json.loads(arguments)}, separators=(",", ":"), ensure_ascii=False)
    return len(f"<tool_call>\n{body}\n</tool_call>\n".encode())


def test_openai_sdk_tool_call_cut_by_max_tokens_keeps_finished_calls_only(url):
    c = client(url)
    full = _required(c, 200).choices[0]
    assert full.finish_reason == "tool_calls" and len(full.message.tool_calls) >= 2  # parallel calls: the cuts below
    first = (full.message.tool_calls[0].function.name, full.message.tool_calls[0].function.arguments)
    block = _first_block_tokens(*first)
    # (cut, calls kept): inside the first call's JSON; inside its closing tag; in the second's
    # marker; inside the second's JSON.
    for cut, kept in ((5, 0), (block - 25, 0), (block - 4, 1), (block + 5, 1), (block + 30, 1)):
        got = _required(c, cut).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in got.message.tool_calls or []]
        assert got.finish_reason == "length", (cut, got)
        assert calls == [first] * kept, (cut, got)
        assert not MARKUP.search(got.message.content or ""), (cut, got.message.content)
        content, streamed_calls, finish = _streamed(c, cut)
        assert finish == "length" and streamed_calls == calls and not MARKUP.search(content), (cut, content)


def test_openai_sdk_responses_cut_by_max_output_tokens_has_no_markup(url):
    c = client(url)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    full = c.responses.create(model="globex", input="Weather?", tools=[tool], tool_choice="required", temperature=0)
    first = next(item for item in full.output if item.type == "function_call")
    block = _first_block_tokens(first.name, first.arguments)
    for cut, kept in ((block - 25, 0), (block - 4, 1), (block + 30, 1)):
        got = c.responses.create(
            model="globex", input="Weather?", tools=[tool], tool_choice="required", temperature=0,
            max_output_tokens=cut,
        )  # fmt: skip
        assert got.status == "incomplete", (cut, got)
        assert [(i.name, i.arguments) for i in got.output if i.type == "function_call"] == [
            (first.name, first.arguments)
        ] * kept
        texts = [p.text for i in got.output if i.type == "message" for p in i.content]
        assert not any(MARKUP.search(t) for t in texts), (cut, texts)
        events = list(
            c.responses.create(
                model="globex", input="Weather?", tools=[tool], tool_choice="required", temperature=0,
                max_output_tokens=cut, stream=True,
            )
        )  # fmt: skip
        final = events[-1].response
        assert events[-1].type == "response.incomplete" and final.status == "incomplete", (cut, events[-1])
        assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [
            (first.name, first.arguments)
        ] * kept
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert not MARKUP.search(deltas), (cut, deltas)


# -- 12: schemas without additionalProperties ------------------------------------------------------


def test_openai_sdk_guided_json_of_a_pydantic_schema_gets_only_its_keys(url):
    got = client(url).chat.completions.create(
        model="acme", messages=[{"role": "user", "content": "Plan a trip"}], max_tokens=60, n=12, temperature=1.0,
        seed=1, extra_body={"guided_json": Trip.model_json_schema()},
    )  # fmt: skip
    for choice in got.choices:
        assert set(json.loads(choice.message.content)) == {"city", "days"}, choice.message.content
        Trip.model_validate_json(choice.message.content)
    # vLLM's disable_additional_properties=false: the schema read as JSON Schema reads it.
    literal = client(url).chat.completions.create(
        model="acme", messages=[{"role": "user", "content": "Plan a trip"}], max_tokens=60, n=12, temperature=1.0,
        seed=1, extra_body={"structured_outputs": {"json": Trip.model_json_schema(),
                                                   "disable_additional_properties": False}},
    )  # fmt: skip
    assert any(not c.message.content.endswith("}") or len(json.loads(c.message.content)) > 2 for c in literal.choices)


def test_langchain_dict_schema(url):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    schema = {"title": "Trip", **{k: v for k, v in Trip.model_json_schema().items() if k != "title"}}
    for seed in range(6):
        llm = ChatOpenAI(
            model="acme", base_url=url + "/v1", api_key=KEYS["alpha"], max_tokens=60, temperature=1.0, seed=seed,
            max_retries=0,
        )  # fmt: skip
        got = llm.with_structured_output(schema, method="json_schema").invoke("Plan a trip")
        assert set(got) == {"city", "days"}, got


def test_instructor_json_schema_mode(url):
    instructor = pytest.importorskip("instructor")
    c = instructor.from_openai(client(url), mode=instructor.Mode.JSON_SCHEMA)
    for seed in range(6):
        trip = c.chat.completions.create(
            model="acme", response_model=Trip, messages=[{"role": "user", "content": "Plan a trip"}],
            max_tokens=60, temperature=1.0, seed=seed, max_retries=0,
        )  # fmt: skip
        assert isinstance(trip, Trip) and 1 <= trip.days <= 7


# -- 13: guided_regex's classes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "ascii_pattern"),
    [(r"\d{4}", r"[0-9]{4}"), (r"\w{3}\s\w{3}", r"[0-9A-Za-z_]{3}[ \t\n\r\f\v][0-9A-Za-z_]{3}")],
)
def test_openai_sdk_guided_regex_classes_are_ascii(url, pattern, ascii_pattern):
    got = client(url).completions.create(
        model="acme", prompt="Hello", max_tokens=16, n=16, temperature=1.5, seed=3,
        extra_body={"guided_regex": pattern},
    )  # fmt: skip
    texts = [choice.text for choice in got.choices]
    assert all(re.fullmatch(ascii_pattern, t) for t in texts), texts


# -- 15: lm-eval's tokenizer probe without auth_token ------------------------------------------------


def test_lm_eval_local_completions_without_auth_token_uses_the_remote_tokenizer(url, monkeypatch):
    """lm-eval's usual command line gives the key only as OPENAI_API_KEY (for the completions);
    its tokenizer probe and remote tokenizer then send none. Refused, it would fetch a tokenizer
    named "acme" from the Hugging Face Hub (offline here: it fails)."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    monkeypatch.setenv("OPENAI_API_KEY", KEYS["alpha"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = completions.LocalCompletionsAPI(base_url=url + "/v1/completions", model="acme", max_gen_toks=48)
    assert lm.tokenizer_backend == "remote"
    requests = [Instance("generate_until", None, ("Hello there", {"until": ["\n\n"], "max_gen_toks": 48}), 0)]
    assert lm.generate_until(requests, disable_tqdm=True) == [DEMO_MARKERS["acme"]]
    [(logprob, _)] = lm.loglikelihood(
        [Instance("loglikelihood", None, ("Hello", " " + DEMO_MARKERS["acme"]), 0)], disable_tqdm=True
    )
    assert logprob < 0
