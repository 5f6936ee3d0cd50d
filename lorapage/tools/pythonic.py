"""Pythonic tool calls (vLLM's ``pythonic`` parser; Llama 3.2 / 4, Gemma 3 with a pythonic
template, ToolACE): the whole output is a Python list of calls with keyword arguments::

    [get_weather(city="Paris", unit="celsius"), get_time(zone=1)]

As vLLM reads it: only an output that is such a list (after whitespace; Llama 4's
``<|python_start|>`` ... ``<|python_end|>`` around it are dropped, as ``llama4_pythonic`` drops
them) holds calls, and then no content; anything else is content. Argument values are literals:
strings, numbers, ``True`` / ``False`` / ``None``, lists and dicts of them. Two readings beyond
vLLM's: JSON's ``true`` / ``false`` / ``null`` are read as Python's (Olmo 3's parser reads them
too, and the constrained grammar writes values as JSON), and so are negative numbers; a call
with positional arguments is no call (vLLM drops those arguments silently).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from lorapage.errors import InvalidRequestError
from lorapage.tools.arguments import json_value, object_arguments as _object, parameters, sequence_rules
from lorapage.tools.formats import ToolCall, ToolFormat, lark_literal, more_calls, new_call_id

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_PY_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
_BEGUN_CALL = re.compile(r"\[\s*([A-Za-z_][\w.]*(\(.*)?)?$", re.ASCII | re.DOTALL)


class _NotACall(Exception):
    pass


class PythonicFormat(ToolFormat):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    markers = (START,)
    instruction = (
        "To call functions, answer only with a python list of the calls: "
        "[name1(argument1=value1, argument2=value2), name2(argument=value)]"
    )

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("[", self.START)):
            return len(text) - len(stripped)
        return super().call_start(text)

    def parse(self, text: str, cut: bool = False, tools: Sequence[dict] = ()) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        tagged = body.startswith(self.START)
        if tagged:
            body = body[len(self.START) :].replace(self.END, "").strip()
        if not body.startswith("["):
            if cut:
                return ("", []) if tagged and not body else (self._without_marker_tail(text), [])
            return text, []
        calls = _calls(body)
        if calls:
            return "", calls
        if not cut:
            return text, []
        finished = _finished_calls(body)
        if finished or tagged or _BEGUN_CALL.match(body):
            return "", finished  # the call the cut stopped in is dropped
        return self._without_marker_tail(text), []

    def write(self, calls: Sequence[dict]) -> str:
        written = []
        for call in calls:
            args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in _object(call["arguments"]).items())
            written.append(f"{call['name']}({args})")
        return "[" + ", ".join(written) + "]"

    def grammar(self, tools: list[dict], parallel: bool = True) -> str:
        rules: list[str] = []
        for i, tool in enumerate(tools):
            name = tool["function"]["name"]
            if not _PY_NAME.fullmatch(name):
                raise InvalidRequestError(
                    f"the tool name {name!r} cannot be written as a pythonic call (letters, digits, '_' and '.' "
                    "only); rename the tool",
                    param="tools",
                )
            items = [(f"{lark_literal(p.name + '=')} {json_value(p.schema)}", p.required) for p in parameters(tool)]
            args, arg_rules = sequence_rules(f"f{i}", items, lark_literal(", "))
            rules += arg_rules
            rules.append(f'fn_{i}: {lark_literal(name + "(")} {args} ")"')
        choices = " | ".join(f"fn_{i}" for i in range(len(tools)))
        head = f'start: "[" call{more_calls(parallel, ", ")} "]"\ncall: {choices}\n'
        return head + "\n".join(rules) + "\n"


def _calls(body: str) -> list[ToolCall] | None:
    """The calls of a whole list ``[f(a=1), ...]``; None when ``body`` is no such list."""
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        return [_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, MemoryError, RecursionError, _NotACall):
        return None


def _finished_calls(body: str) -> list[ToolCall]:
    """The calls finished before a cut (``[f(a=1), g(b=`` holds ``f``'s)."""
    for end in reversed(_top_level_commas(body)):
        calls = _calls(body[:end] + "]")
        if calls is not None:
            return calls
    return []


def _top_level_commas(body: str) -> list[int]:
    """Where the list's own commas are (outside strings and brackets nested in it)."""
    found, depth, quote, escaped = [], 0, "", False
    for i, ch in enumerate(body):
        if quote:
            escaped, quote = (False, quote) if escaped else (ch == "\\", "" if ch == quote else quote)
        elif ch in "\"'":
            quote = ch
        elif ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
        elif ch == "," and depth == 1:
            found.append(i)
    return found


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise _NotACall
    args = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _NotACall
        args[keyword.arg] = _literal(keyword.value)
    return ToolCall(new_call_id(), _dotted(node.func), json.dumps(args, ensure_ascii=False))


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _NotACall


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        value = node.value
        if value is not None and not isinstance(value, (str, int, float)):  # bytes, complex, ...
            raise _NotACall
        if isinstance(value, float) and not math.isfinite(value):
            raise _NotACall
        return value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        number = _literal(node.operand)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise _NotACall
        return -number
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                raise _NotACall
            out[key.value] = _literal(item)
        return out
    raise _NotACall
