"""Structured output per row of a mixed batch: every constrained output parses and validates.

On a random-weight model (nothing in it knows JSON) and on the tiny model with its adapters,
constrained rows (JSON schemas, any JSON object, regex, choices, Lark and GBNF grammars) share
steps with free rows of other adapters; each constrained output must follow its spec, and the
free rows must be exactly what they are without the constrained ones beside them. A hostile or
broken spec is a 400-class error before the request queues.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from engine_util import collect, tiny_engine
from hf_reference import make_peft_adapter, make_random_llama

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import InvalidRequestError
from lorapage.structured import StructuredSpec

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "mid", "high"]},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "child": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["id"],
                "additionalProperties": False,
            },
        },
        "required": ["ok", "level", "child"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
]
REGEX = r"[A-Z][a-z]{2,5}-\d{3}"
CHOICES = ["red", "green", "blue", "dark blue"]
LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,2}/'
GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'


def constrained_rows() -> list[tuple[SamplingParams, object]]:
    """(sampling, check) pairs: each check raises if the text does not follow the spec."""

    def schema_check(schema):
        return lambda text: jsonschema.validate(json.loads(text), schema)

    rows = []
    for i, schema in enumerate(SCHEMAS):
        for seed in (1, 2):
            spec = StructuredSpec("json", json.dumps(schema))
            rows.append(
                (
                    SamplingParams(max_tokens=160, temperature=1.0, seed=seed + 10 * i, structured=spec),
                    schema_check(schema),
                )
            )
    rows.append(
        (
            SamplingParams(max_tokens=160, temperature=1.0, seed=5, structured=StructuredSpec("json_object")),
            lambda text: isinstance(json.loads(text), dict) or pytest.fail(text),
        )
    )
    rows.append(
        (
            SamplingParams(max_tokens=40, temperature=1.0, seed=6, structured=StructuredSpec("regex", REGEX)),
            lambda text: re.fullmatch(REGEX, text) or pytest.fail(text),
        )
    )
    rows.append(
        (
            SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredSpec.of_choices(CHOICES)),
            lambda text: text in CHOICES or pytest.fail(text),
        )
    )
    rows.append(
        (
            SamplingParams(max_tokens=40, temperature=1.0, seed=8, structured=StructuredSpec("grammar", LARK)),
            lambda text: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})?\)", text) or pytest.fail(text),
        )
    )
    rows.append(
        (
            SamplingParams(max_tokens=40, temperature=1.0, seed=9, structured=StructuredSpec("grammar", GBNF)),
            lambda text: re.fullmatch(r"yes|no|maybe \d", text) or pytest.fail(text),
        )
    )
    return rows


async def run_mixed(engine: Engine, adapters: list[str | None]) -> None:
    """Constrained rows on every adapter, beside free greedy rows whose output must not change."""
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [await collect(engine, f"free {i}", a, free) for i, a in enumerate(adapters)]
    cases = constrained_rows()
    jobs = [collect(engine, f"prompt {i}", adapters[i % len(adapters)], s) for i, (s, _) in enumerate(cases)]
    jobs += [collect(engine, f"free {i}", a, free) for i, a in enumerate(adapters)]
    results = await asyncio.gather(*jobs)
    for (out, _), (_, check) in zip(results, cases):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)  # the grammar completed
        check(out.text)
    mixed = results[len(cases) :]
    assert [o.token_ids for o, _ in mixed] == [o.token_ids for o, _ in alone]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("random")
    base = make_random_llama(root / "base", seed=3)
    adapters = {
        f"r{i}": make_peft_adapter(base, root / f"r{i}", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=i)
        for i in range(2)
    }
    return base, adapters


async def test_constrained_rows_of_a_random_model_follow_their_specs(random_model):
    base, adapters = random_model
    engine = Engine(EngineConfig(model=str(base), max_loras=4, max_lora_rank=16, block_size=4))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    try:
        await run_mixed(engine, [None, *adapters])
    finally:
        await engine.close()


async def test_constrained_rows_beside_free_rows_of_the_demo_adapters():
    engine = tiny_engine()
    try:
        await run_mixed(engine, [None, "acme", "globex", "initech"])
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredSpec("json", "{not json"), "json"),
        (StructuredSpec("json", '"a string is no schema"'), "schema"),
        (StructuredSpec("regex", "([a-z]"), "regex"),
        (StructuredSpec("grammar", "start: undefined_rule"), "grammar"),
        (StructuredSpec("grammar", "root ::= ( "), "grammar"),
    ],
)
async def test_a_broken_spec_is_refused_before_the_request_queues(spec, words):
    engine = tiny_engine()
    try:
        with pytest.raises(InvalidRequestError, match=words) as err:
            await collect(engine, "hi", "acme", SamplingParams(max_tokens=8, structured=spec))
        assert err.value.param == "response_format"
        assert engine.stats().queue_depth == 0 and not engine.debug.step_planner.requests
        out, _ = await collect(engine, "Hello", "acme", SamplingParams(max_tokens=40, temperature=0))
        assert out.text.startswith("ACME")  # the engine serves on
    finally:
        await engine.close()


def test_specs_are_bounded_before_they_compile():
    with pytest.raises(InvalidRequestError, match="at most 65536 characters"):
        StructuredSpec("regex", "a" * 70_000)
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        StructuredSpec.of_choices([])
    with pytest.raises(InvalidRequestError, match="at most 256 choices"):
        StructuredSpec.of_choices([str(i) for i in range(300)])
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        StructuredSpec("xml", "<a/>")


async def test_a_hostile_schema_is_refused_or_bounded_and_others_are_served():
    """A schema whose grammar explodes (deeply nested, huge alternations) is refused by the
    grammar engine's limits, or compiles within them; either way the loop and other requests go on."""
    nested: dict = {"type": "integer"}
    for _ in range(200):
        nested = {"type": "array", "items": nested, "maxItems": 3}
    wide = {"anyOf": [{"type": "string", "pattern": f"^{'a?' * 40}{'a' * 40}{i}$"} for i in range(60)]}
    engine = tiny_engine()
    try:
        for schema in (nested, wide):
            spec = StructuredSpec("json", json.dumps(schema))
            job = asyncio.ensure_future(collect(engine, "x", None, SamplingParams(max_tokens=4, structured=spec)))
            out, _ = await collect(engine, "Hello", "acme", SamplingParams(max_tokens=40, temperature=0))
            assert out.text.startswith("ACME")
            try:
                await job
            except InvalidRequestError as err:
                assert err.param == "response_format"
    finally:
        await engine.close()


async def test_a_compiled_spec_is_cached_and_each_request_has_its_own_state():
    engine = tiny_engine()
    try:
        spec = StructuredSpec.of_choices(["alpha", "beta"])
        first = await engine.debug.grammars.constraint(spec)
        second = await engine.debug.grammars.constraint(spec)
        compiler = engine.debug.grammars
        assert first.matcher is not second.matcher and len(compiler._grammars) == len(compiler._matchers) == 1
        first.consume(first_token := engine.tokenizer.encode("a", add_special_tokens=False)[0])
        assert second.error is None and first.error is None and first_token >= 0
        second.consume(engine.tokenizer.encode("z", add_special_tokens=False)[0])  # starts neither choice
        assert second.error is not None and first.error is None
    finally:
        await engine.close()


async def test_a_failed_constraint_names_its_reason_not_the_engine_state():
    """llguidance's error carries its parser state and the whole grammar (here a schema of 10 KB);
    what reaches an answer is the reason, bounded."""
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(300)}}
    engine = tiny_engine()
    try:
        constraint = await engine.debug.grammars.constraint(StructuredSpec("json", json.dumps(schema)))
        constraint.consume(engine.tokenizer.encode("z", add_special_tokens=False)[0])  # no JSON starts so
        error = constraint.error
        assert error is not None and "doesn't satisfy the grammar" in error, error
        assert len(error) <= 400 and "<state>" not in error and "k299" not in error, error[:600]
    finally:
        await engine.close()
