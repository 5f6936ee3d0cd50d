"""The tool-call parsers users pick in vLLM, read as vLLM reads them: qwen3_coder's XML-ish blocks
and pythonic lists, whole and streamed (split at every character), typed by the tools' schemas,
cut by max_tokens; every format's written calls parse back to themselves; Qwen3's thinking split
into reasoning and content alike whole and streamed; the format each family's template shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorapage.tools import FORMATS, ToolStream, detect_format, tool_format
from lorapage.tools.reasoning import ReasoningStream, opens_thinking, split_reasoning

TEMPLATES = Path(__file__).parent / "chat_templates"
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "score": {"type": "number"},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "filter": {"type": "object"},
            },
            "required": ["query"],
        },
    },
}
CODER = (
    'I will search.\n<tool_call>\n<function=search>\n<parameter=query>\nfn main() {\n  println!("<hi>");\n}\n'
    "</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n<parameter=exact>\n"
    'true\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=filter>\n{"lang": "rust"}\n'
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nnull\n</parameter>\n"
    "</function>\n</tool_call>"
)
CODER_ARGS = [
    {
        "query": 'fn main() {\n  println!("<hi>");\n}',
        "limit": 5,
        "score": 0.5,
        "exact": True,
        "tags": ["a", "b"],
        "filter": {"lang": "rust"},
    },
    {"query": None},
]
PYTHONIC = '[search(query="it\'s, [x]", limit=5, exact=True, tags=["a", "b"], filter={"k": None}), search(query=\'q\')]'
PYTHONIC_ARGS = [
    {"query": "it's, [x]", "limit": 5, "exact": True, "tags": ["a", "b"], "filter": {"k": None}},
    {"query": "q"},
]


def streamed(fmt: str, text: str, cut: bool = False) -> tuple[str, list]:
    """``text`` fed one character at a time: the content released and the calls at the end."""
    stream = ToolStream(FORMATS[fmt], [SEARCH])
    released = "".join(stream.feed(ch) for ch in text)
    rest, calls = stream.finish(cut)
    return released + rest, calls


@pytest.mark.parametrize(
    ("fmt", "text", "content", "args"),
    [("qwen3_coder", CODER, "I will search.\n", CODER_ARGS), ("pythonic", PYTHONIC, "", PYTHONIC_ARGS)],
)
def test_calls_parse_whole_and_streamed_with_their_arguments_typed(fmt, text, content, args):
    got_content, calls = FORMATS[fmt].parse(text, tools=[SEARCH])
    assert got_content == content and [c.name for c in calls] == ["search", "search"]
    assert [json.loads(c.arguments) for c in calls] == args
    streamed_content, again = streamed(fmt, text)
    assert streamed_content == content and [json.loads(c.arguments) for c in again] == args
    for split in range(len(text) + 1):  # two deltas, split at every character
        stream = ToolStream(FORMATS[fmt], [SEARCH])
        released = stream.feed(text[:split]) + stream.feed(text[split:])
        rest, calls = stream.finish()
        assert released + rest == content and [json.loads(c.arguments) for c in calls] == args, split


def test_qwen3_coder_values_keep_their_text_without_a_schema_and_the_unwrapped_form_is_a_call():
    fmt = FORMATS["qwen3_coder"]
    _, calls = fmt.parse("<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"n": "5"}  # no schema: the text (vLLM's reading)
    content, calls = fmt.parse(
        "Sure.\n<function=search>\n<parameter=limit>\n7\n</parameter>\n</function>", tools=[SEARCH]
    )
    assert content == "Sure.\n" and json.loads(calls[0].arguments) == {"limit": 7}
    _, calls = fmt.parse(
        "<tool_call>\n<function=search>\n<parameter=limit>\nmany\n</parameter>\n</function>", tools=[SEARCH]
    )
    assert json.loads(calls[0].arguments) == {"limit": "many"}  # not an integer: kept as text, as vLLM keeps it


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer.",
        "Use <tool_call> tags to call.",
        '<tool_call>\n{"name": "x"}\n</tool_call>',
        "[1, 2, 3]",
        "[search('positional')]",
        "[search(query=undefined_name)]",
        "[search(**kw)]",
        "see [search(query='x')] below",
        "[]",
    ],
)
def test_text_that_is_no_call_stays_content_whole_and_streamed(text):
    for fmt in ("qwen3_coder", "pythonic"):
        assert FORMATS[fmt].parse(text, tools=[SEARCH]) == (text, []), fmt
        assert streamed(fmt, text) == (text, []), fmt


@pytest.mark.parametrize(("fmt", "text"), [("qwen3_coder", CODER), ("pythonic", PYTHONIC)])
def test_an_output_cut_short_keeps_the_calls_it_finished_and_no_markup(fmt, text):
    whole = [c.arguments for c in FORMATS[fmt].parse(text, tools=[SEARCH])[1]]
    seen = set()
    for cut in range(len(text)):
        content, calls = FORMATS[fmt].parse(text[:cut], cut=True, tools=[SEARCH])
        got = [c.arguments for c in calls]
        assert got == whole[: len(got)], (cut, got)
        seen.add(len(got))
        assert not any(m in content for m in ("<tool", "<function", "<param", "[search", "search(")), (cut, content)
        again_content, again = streamed(fmt, text[:cut], cut=True)
        assert again_content == content and [c.arguments for c in again] == got, cut
    assert {0, 1} <= seen


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_reads_back_the_calls_it_writes(fmt):
    """What a template without tools shows of earlier calls is what the format parses."""
    calls = [
        {"name": "search", "arguments": {"query": "a, b", "limit": 3, "tags": ["x"], "filter": {"k": 1}}},
        {"name": "search", "arguments": {"query": "c"}},
    ]
    if fmt == "llama3_json":
        calls = calls[:2]
    content, parsed = FORMATS[fmt].parse(FORMATS[fmt].write(calls), tools=[SEARCH])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert FORMATS[fmt].instruction


def test_llama4_python_tags_around_a_pythonic_list_are_dropped():
    content, calls = FORMATS["pythonic"].parse("<|python_start|>[search(query='x')]<|python_end|>")
    assert content == "" and json.loads(calls[0].arguments) == {"query": "x"}


def test_pythonic_grammar_refuses_a_tool_name_python_cannot_call():
    tool = {"type": "function", "function": {"name": "get-weather", "parameters": {"type": "object"}}}
    with pytest.raises(Exception, match="cannot be written as a pythonic call"):
        FORMATS["pythonic"].grammar([tool])


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("qwen3.jinja", "hermes"),
        ("qwen3_coder.jinja", "qwen3_coder"),
        ("llama3_1.jinja", "llama3_json"),
        ("llama3_2_pythonic.jinja", "pythonic"),
        ("mistral_v0_3.jinja", "mistral"),
        ("gemma2.jinja", "pythonic"),
        ("gemma3.jinja", "pythonic"),
    ],
)
def test_each_family_template_shows_the_parser_vllm_recommends_for_it(template, parser):
    text = (TEMPLATES / template).read_text()
    assert detect_format(text).name == parser
    assert tool_format("auto", text).name == parser
    assert tool_format("hermes", text).name == "hermes"  # --tool-call-parser wins over the template


THINKING = [
    (
        "<think>\nThe user wants weather.\n</think>\n\nIt is sunny.",
        False,
        ("\nThe user wants weather.\n", "\n\nIt is sunny."),
    ),
    ("<think>\nstill thinking when cut", False, ("\nstill thinking when cut", "")),
    ("It is sunny.", False, (None, "It is sunny.")),
    ("\n<think>x</think><tool_call>\n{}\n</tool_call>", False, ("x", "<tool_call>\n{}\n</tool_call>")),
    ("plan</think>answer", True, ("plan", "answer")),
    ("<thin", False, (None, "<thin")),
]


@pytest.mark.parametrize(("text", "opened", "expected"), THINKING)
def test_qwen3_thinking_splits_alike_whole_and_streamed_at_every_character(text, opened, expected):
    assert split_reasoning(text, opened) == expected
    for split in range(len(text) + 1):
        stream = ReasoningStream(opened)
        parts = [stream.feed(text[:split]), stream.feed(text[split:]), stream.finish()]
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (reasoning, content) == (expected[0] or "", expected[1]), split


def test_a_prompt_opens_thinking_when_its_template_leaves_a_think_block_open():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not opens_thinking("<|im_start|>assistant\n")
