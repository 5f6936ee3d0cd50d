"""Qwen3-Coder's tool calls (vLLM's ``qwen3_coder`` parser): XML-ish blocks, one argument per tag,
its value as plain text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is typed by the tool's schema, as vLLM's parser types it: a ``string`` parameter keeps its
text, ``integer`` / ``number`` / ``boolean`` are read as such, ``object`` / ``array`` as JSON, and
``null`` is null; a parameter the schema does not declare keeps its text. One newline after the
opening tag and one before the closing tag belong to the markup. Text before a call is content;
``<function=...>`` without the ``<tool_call>`` wrapper is a call too (vLLM's fallback).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from lorapage.tools.arguments import json_value, object_arguments as _object, parameters, sequence_rules
from lorapage.tools.formats import ToolCall, ToolFormat, lark_literal, more_calls, new_call_id

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"
    markers = (OPEN, FUNCTION)
    instruction = (
        "To call one, answer <tool_call>\n<function=<name>>\n<parameter=<argument>>\n<value>\n</parameter>\n"
        "</function>\n</tool_call>"
    )

    def parse(self, text: str, cut: bool = False, tools: Sequence[dict] = ()) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        rest = text
        while (start := self.call_start(rest)) >= 0:
            if not calls or rest[:start].strip():  # whitespace between calls is no content
                content.append(rest[:start])
            body, after, closed = self._block(rest, start)
            call = self._call(body, tools, finished=closed or not cut)
            if call is not None:
                calls.append(call)
            elif closed or not cut:  # not a call after all: it stays text (cut: an unfinished one, dropped)
                content.append(rest[start : len(rest) - len(after)])
            rest = after
        if cut:
            rest = self._without_marker_tail(rest)
        if not calls or rest.strip():
            content.append(rest)
        joined = "".join(content)
        return (joined if not calls or joined.strip() else ""), calls

    def _block(self, text: str, start: int) -> tuple[str, str, bool]:
        """``(body, text after it, closed)`` of the call starting at ``start``."""
        if text.startswith(self.OPEN, start):
            end = text.find(self.CLOSE, start)
            if end < 0:
                return text[start + len(self.OPEN) :], "", False
            return text[start + len(self.OPEN) : end], text[end + len(self.CLOSE) :], True
        end = text.find(self.FUNCTION_END, start)
        if end < 0:
            return text[start:], "", False
        end += len(self.FUNCTION_END)
        return text[start:end], text[end:], True

    def _call(self, body: str, tools: Sequence[dict], finished: bool) -> ToolCall | None:
        """The call a block holds; None when it holds none (or, unless ``finished``, an unclosed one)."""
        begin = body.find(self.FUNCTION)
        name_end = body.find(">", begin)
        if begin < 0 or name_end < 0 or body[:begin].strip():
            return None
        name = body[begin + len(self.FUNCTION) : name_end]
        end = body.find(self.FUNCTION_END, name_end)
        if not name or name != name.strip() or "\n" in name or (end < 0 and not finished):
            return None
        region = body[name_end + 1 : end if end >= 0 else len(body)]
        if end >= 0 and body[end + len(self.FUNCTION_END) :].strip():
            return None
        args = self._arguments(region, _schemas(tools, name), finished or end >= 0)
        return None if args is None else ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))

    def _arguments(self, region: str, schemas: dict[str, Any], finished: bool) -> dict[str, Any] | None:
        args: dict[str, Any] = {}
        pos = 0
        while (begin := region.find(self.PARAM, pos)) >= 0:
            if region[pos:begin].strip():
                return None
            name_end = region.find(">", begin)
            if name_end < 0:
                return None
            name = region[begin + len(self.PARAM) : name_end]
            end = region.find(self.PARAM_END, name_end)
            if end < 0:  # vLLM's reading: an unclosed value runs to the next parameter or the end
                if not finished:
                    return None
                following = region.find(self.PARAM, name_end)
                end = following if following >= 0 else len(region)
                pos = end
            else:
                pos = end + len(self.PARAM_END)
            value = region[name_end + 1 : end]
            value = value.removeprefix("\n").removesuffix("\n")
            args[name] = typed_value(value, schemas.get(name))
        return args if not region[pos:].strip() else None

    def write(self, calls: Sequence[dict]) -> str:
        blocks = []
        for call in calls:
            params = "".join(
                f"{self.PARAM}{k}>\n{_text(v)}\n{self.PARAM_END}\n" for k, v in _object(call["arguments"]).items()
            )
            blocks.append(f"{self.OPEN}\n{self.FUNCTION}{call['name']}>\n{params}{self.FUNCTION_END}\n{self.CLOSE}")
        return "\n".join(blocks)

    def grammar(self, tools: list[dict], parallel: bool = True) -> str:
        rules: list[str] = []
        for i, tool in enumerate(tools):
            items = []
            for j, param in enumerate(parameters(tool)):
                value = _value(param.schema, f"T{i}_{j}", rules)
                opening = lark_literal(f"{self.PARAM}{param.name}>\n")
                items.append((f"{opening} {value} {lark_literal(chr(10) + self.PARAM_END + chr(10))}", param.required))
            args, arg_rules = sequence_rules(f"f{i}", items, "")
            rules += arg_rules
            opening = lark_literal(f"{self.OPEN}\n{self.FUNCTION}{tool['function']['name']}>\n")
            rules.append(f"fn_{i}: {opening} {args} {lark_literal(self.FUNCTION_END + chr(10) + self.CLOSE)}")
        choices = " | ".join(f"fn_{i}" for i in range(len(tools)))
        head = f"start: call{more_calls(parallel, chr(10))}\ncall: {choices}\n"
        return head + "\n".join(rules) + "\n"


def _text(value: Any) -> str:
    """A value as the format writes it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _schemas(tools: Sequence[dict], name: str) -> dict[str, Any]:
    """The declared parameters' schemas of the tool ``name`` (none: every value stays text)."""
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _type(schema: Any) -> str:
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def typed_value(value: str, schema: Any) -> Any:
    """A parameter's text as vLLM's ``qwen3_coder`` parser types it by its schema."""
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    kind = _type(schema)
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def _value(schema: dict[str, Any], terminal: str, rules: list[str]) -> str:
    """Lark for one parameter's value as this format writes it (text for a string, else JSON)."""
    if _type(schema) not in _STRING_TYPES:
        return json_value(schema)
    if "const" in schema:
        return lark_literal(str(schema["const"]))
    if "enum" in schema:
        return "(" + " | ".join(lark_literal(str(v)) for v in schema["enum"]) + ")"
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    count = f"{{{least},{most}}}" if most is not None else (f"{{{least},}}" if least else "*")
    rules.append(f"{terminal}: /(?s:.{count})/ & ~/(?s:.*<\\/parameter>.*)/")
    return terminal
