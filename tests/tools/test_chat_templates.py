"""Chat templates as model repositories ship them: found where transformers finds them (the
``chat_template.jinja`` file, ``additional_chat_templates/``, tokenizer_config.json's string or
list of named templates, ``tool_use`` picked when tools are given), and each family's published
template (tests/tools/chat_templates, SOURCES.md) rendering a tool conversation exactly as
transformers renders it, with Qwen3's ``enable_thinking`` and Gemma 2's missing system role."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lorapage.errors import InvalidRequestError
from lorapage.model.tokenizer import Tokenizer
from lorapage.tiny import TINY_BASE_DIR
from lorapage.tools import FORMATS, conversation, detect_format

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CALL_ID = "a1B2c3D4e"  # 9 letters and digits: Mistral's template takes no other
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": CALL_ID, "name": "get_weather", "arguments": '{"city": "Paris"}'}],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18C"},
]


def model_dir(tmp: Path, name: str, config: dict | None = None, files: dict[str, str] | None = None) -> Path:
    """The tiny model's tokenizer in ``tmp/name``, with ``config`` in tokenizer_config.json and ``files`` beside it."""
    path = tmp / name
    path.mkdir()
    shutil.copy(TINY_BASE_DIR / "tokenizer.json", path / "tokenizer.json")
    base = json.loads((TINY_BASE_DIR / "tokenizer_config.json").read_text())
    base.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    for rel, text in (files or {}).items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


def render_both(path: Path, messages: list[dict], **kwargs) -> tuple[str, str]:
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return ours, theirs


def test_templates_are_found_where_transformers_finds_them(tmp_path):
    user = [{"role": "user", "content": "hi"}]
    tools = [WEATHER]
    # A string in tokenizer_config.json, then a chat_template.jinja beside it, which wins.
    path = model_dir(tmp_path, "string", {"chat_template": "cfg:{{ messages[0].content }}"})
    assert render_both(path, user) == ("cfg:hi", "cfg:hi")
    path = model_dir(
        tmp_path, "file", {"chat_template": "cfg"}, {"chat_template.jinja": "file:{{ messages[0].content }}"}
    )
    assert render_both(path, user) == ("file:hi", "file:hi")
    # Named templates: tool_use when tools are given, the default otherwise.
    named = [
        {"name": "default", "template": "default:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    path = model_dir(tmp_path, "named", {"chat_template": named})
    assert render_both(path, user) == ("default:hi", "default:hi")
    assert render_both(path, user, tools=tools) == ("tools:1", "tools:1")
    ours = Tokenizer.from_dir(path)
    assert (
        ours.chat_template == "default:{{ messages[0].content }}" and ours.tool_template == "tools:{{ tools | length }}"
    )
    # The newer layout: additional_chat_templates/tool_use.jinja beside chat_template.jinja.
    files = {"chat_template.jinja": "default", "additional_chat_templates/tool_use.jinja": "tool_use"}
    path = model_dir(tmp_path, "dir", None, files)
    assert render_both(path, user, tools=tools) == ("tool_use", "tool_use")
    assert render_both(path, user) == ("default", "default")


def test_named_templates_without_a_default_answer_tools_only(tmp_path):
    path = model_dir(tmp_path, "nodefault", {"chat_template": [{"name": "tool_use", "template": "t"}]})
    tok = Tokenizer.from_dir(path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER]) == "t"
    with pytest.raises(InvalidRequestError, match=r"named \['tool_use'\] and no default"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


FAMILIES = [
    (
        "qwen3.jinja",
        ["<tools>", '"name": "get_weather"', '<tool_call>\n{"name": "get_weather"', "<tool_response>\n18C"],
    ),
    ("qwen3_coder.jinja", ["<function>\n<name>get_weather</name>", "<function=get_weather>\n<parameter=city>\nParis"]),
    ("llama3_1.jinja", ["Environment: ipython", '{"name": "get_weather", "parameters": {"city": "Paris"}}']),
    ("mistral_v0_3.jinja", ["[AVAILABLE_TOOLS]", "[TOOL_CALLS]", f'"call_id": "{CALL_ID}"']),
    ("llama3_2_pythonic.jinja", ["python list of the calls", "[get_weather(city=Paris)]"]),
]


@pytest.mark.parametrize(("template", "shown"), FAMILIES)
def test_a_family_template_renders_a_tool_conversation_as_transformers_does(tmp_path, template, shown):
    text = (TEMPLATES / template).read_text()
    path = model_dir(tmp_path, "m", None, {"chat_template.jinja": text})
    messages, kwargs = conversation(HISTORY, [WEATHER], detect_format(text), text)
    assert kwargs == {"tools": [WEATHER]}  # the template knows tools: it gets them as transformers passes them
    ours, theirs = render_both(path, messages, **kwargs)
    assert ours == theirs
    for piece in shown:
        assert piece in ours, piece


@pytest.mark.parametrize("template", ["gemma2.jinja", "gemma3.jinja"])
def test_gemma_templates_without_tools_get_them_described_in_the_pythonic_format(tmp_path, template):
    """Gemma's templates show no tools (vLLM pairs Gemma 3 with a pythonic tool template), and
    Gemma 2's refuses a system message: the description goes into the first user turn."""
    text = (TEMPLATES / template).read_text()
    path = model_dir(tmp_path, "g", None, {"chat_template.jinja": text})
    tok = Tokenizer.from_dir(path)
    assert tok.takes_system_role is (template == "gemma3.jinja")
    fmt = detect_format(text)
    messages, kwargs = conversation(HISTORY, [WEATHER], fmt, text, system_role=tok.takes_system_role)
    ours, theirs = render_both(path, messages, **kwargs)
    assert ours == theirs and kwargs == {}
    assert "python list of the calls" in ours and '"name":"get_weather"' in ours
    assert '[get_weather(city="Paris")]' in ours and "<tool_response>\n18C\n</tool_response>" in ours
    assert ours.count("<start_of_turn>user") == 2  # the description, the question, then the tool's result


def test_qwen3_enable_thinking_false_closes_the_think_block_in_the_prompt(tmp_path):
    text = (TEMPLATES / "qwen3.jinja").read_text()
    path = model_dir(tmp_path, "q", None, {"chat_template.jinja": text})
    user = [{"role": "user", "content": "hi"}]
    ours, theirs = render_both(path, user, enable_thinking=False)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ours, theirs = render_both(path, user)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_each_formats_own_instruction():
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    for name, fmt in FORMATS.items():
        messages, kwargs = conversation(HISTORY, [WEATHER], fmt, plain)
        assert kwargs == {} and fmt.instruction in messages[0]["content"], name
        assert messages[2]["content"] == fmt.write([{"name": "get_weather", "arguments": {"city": "Paris"}}]), name
