"""How a model family writes tool calls: parsing them out of its output (whole or streamed), and
the grammar that makes it write valid ones (``tool_choice`` ``required`` or a named function).

The JSON formats, as vLLM's parsers of the same names read them (``qwen3_coder`` and ``pythonic``
have modules of their own; :mod:`lorapage.tools.families` names them all and picks one per model):

- ``hermes`` (Hermes, Qwen 2 / 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, text allowed around them;
- ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), calls separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from lorapage.structured.spec import closed_objects

MAX_PARALLEL_CALLS = 4  # calls a constrained output may hold with parallel_tool_calls (else one)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its OpenAI id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return "call_" + secrets.token_urlsafe(18)


def mistral_call_id() -> str:
    """9 letters and digits: the only call id Mistral's chat template renders back."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _call(obj: object, args_key: str) -> ToolCall | None:
    """A call from a parsed JSON object ``{"name": ..., args_key: {...}}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def call_schema(tools: list[dict], args_key: str) -> dict:
    """JSON schema of one call to any of ``tools`` (OpenAI function tools), as the format writes it."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        # Only the declared arguments, at every depth: a schema that does not say otherwise would let
        # an untrained adapter add keys without end (OpenAI's strict function calling requires the same).
        params = closed_objects({"additionalProperties": False, **params})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def more_calls(parallel: bool, separator: str) -> str:
    """Lark for the calls after the first: up to MAX_PARALLEL_CALLS - 1 more with ``parallel``."""
    if not parallel:
        return ""
    more = f"({lark_literal(separator)} call)" if separator else "call"
    return f" {more}{{0,{MAX_PARALLEL_CALLS - 1}}}"


class ToolFormat(ABC):
    """One family's way of writing tool calls."""

    name: str
    args_key: str = "arguments"
    markers: tuple[str, ...] = ()  # text that starts a call (held back from content when streaming)
    # How to call, in the format's own words: the tools prompt of a template that shows none.
    instruction: str = ""

    @abstractmethod
    def parse(self, text: str, cut: bool = False, tools: Sequence[dict] = ()) -> tuple[str, list[ToolCall]]:
        """A finished output as ``(content, calls)``; text that is no valid call stays content.
        ``cut``: the output was stopped by its length (max_tokens), so a call it was writing is
        unfinished: the calls finished before it are kept, the unfinished one is dropped (no
        markup is left in the content), as is a marker begun at the very end. ``tools``: the
        request's OpenAI tools, for a format whose arguments are typed by their schemas."""

    @abstractmethod
    def write(self, calls: Sequence[dict]) -> str:
        """Earlier calls (``{"name", "arguments"}``, arguments as an object) as the model writes
        them: an assistant turn's text for a template that renders no ``tool_calls`` itself."""

    @abstractmethod
    def grammar(self, tools: list[dict], parallel: bool = True) -> str:
        """A Lark grammar (llguidance's, with ``%json``) of calls to ``tools`` and nothing else: one,
        or with ``parallel`` one to :data:`MAX_PARALLEL_CALLS`."""

    def call_start(self, text: str) -> int:
        """Where the first call starts in ``text`` (-1: none yet)."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else -1

    def held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may be the start of a marker."""
        return max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)

    def _without_marker_tail(self, text: str) -> str:
        """``text`` less a marker's beginning at its end (a cut output's call that never started)."""
        return text[: len(text) - self.held_back(text)]


class HermesFormat(ToolFormat):
    name = "hermes"
    markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    instruction = 'To call one, answer <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>'

    def parse(self, text: str, cut: bool = False, tools: Sequence[dict] = ()) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        rest = text
        while (start := rest.find(self.OPEN)) >= 0:
            if not calls or rest[:start].strip():  # whitespace between calls is no content
                content.append(rest[:start])
            end = rest.find(self.CLOSE, start)
            if end < 0:  # the last block, never closed: a call if its JSON is whole (its closing tag cut)
                body = _less_suffix_prefix(rest[start + len(self.OPEN) :], self.CLOSE)
                call = _parse_json_call(body, self.args_key)
                if call is not None:
                    calls.append(call)
                elif not cut:  # not a call after all: it stays text (cut: a call unfinished, dropped)
                    content.append(rest[start:])
                rest = ""
                break
            call = _parse_json_call(rest[start + len(self.OPEN) : end], self.args_key)
            if call is None:  # not a call after all: it stays text
                content.append(rest[start : end + len(self.CLOSE)])
            else:
                calls.append(call)
            rest = rest[end + len(self.CLOSE) :]
        if cut:
            rest = self._without_marker_tail(rest)
        if not calls or rest.strip():
            content.append(rest)
        return _content("".join(content), calls), calls

    def write(self, calls: Sequence[dict]) -> str:
        return "".join(f"{self.OPEN}\n{_json_call(c, self.args_key)}\n{self.CLOSE}\n" for c in calls)

    def grammar(self, tools: list[dict], parallel: bool = True) -> str:
        schema = json.dumps(call_schema(tools, self.args_key), ensure_ascii=False)
        opening, closing = lark_literal(self.OPEN + "\n"), lark_literal("\n" + self.CLOSE + "\n")
        return f"start: call{more_calls(parallel, '')}\ncall: {opening} %json {schema} {closing}\n"


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    args_key = "parameters"
    TAG = "<|python_tag|>"
    markers = (TAG,)
    instruction = 'To call one, answer only {"name": <name>, "parameters": <object>}'

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(("{", self.TAG)):
            return len(text) - len(stripped)
        return super().call_start(text)

    def parse(self, text: str, cut: bool = False, tools: Sequence[dict] = ()) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        body = body[len(self.TAG) :].strip() if tagged else body
        if not body.startswith("{"):
            if cut:
                return ("", []) if tagged and not body else (self._without_marker_tail(text), [])
            return text, []
        calls: list[ToolCall] = []
        parts = _split_top_level(body, ";")
        for i, part in enumerate(parts):
            call = _parse_json_call(part, self.args_key)
            if call is None:
                if cut and i == len(parts) - 1 and (calls or tagged or _begins_call(part)):
                    break  # the call the cut stopped in: dropped
                return text, []
            calls.append(call)
        return "", calls

    def write(self, calls: Sequence[dict]) -> str:
        return "; ".join(_json_call(c, self.args_key) for c in calls)

    def grammar(self, tools: list[dict], parallel: bool = True) -> str:
        schema = json.dumps(call_schema(tools, self.args_key), ensure_ascii=False)
        return f"start: call{more_calls(parallel, '; ')}\ncall: %json {schema}\n"


class MistralFormat(ToolFormat):
    name = "mistral"
    TAG = "[TOOL_CALLS]"
    markers = (TAG,)
    instruction = 'To call functions, answer [TOOL_CALLS][{"name": <name>, "arguments": <object>}, ...]'

    def parse(self, text: str, cut: bool = False, tools: Sequence[dict] = ()) -> tuple[str, list[ToolCall]]:
        start = text.find(self.TAG)
        if start < 0:
            return (self._without_marker_tail(text) if cut else text), []
        payload = text[start + len(self.TAG) :].strip()
        try:
            items = json.loads(payload)
        except ValueError:
            if not cut:
                return text, []
            items = _whole_items(payload)  # the calls finished before the cut
        items = items if isinstance(items, list) else [items]
        found = [_call(item, self.args_key) for item in items]
        # Mistral's template takes back only 9-character alphanumeric call ids (as vLLM's parser makes them).
        calls = [dataclasses.replace(c, id=mistral_call_id()) for c in found if c is not None]
        if len(calls) < len(found) or (not calls and not cut):
            return text, []
        return _content(text[:start], calls), calls

    def write(self, calls: Sequence[dict]) -> str:
        return self.TAG + "[" + ", ".join(_json_call(c, self.args_key) for c in calls) + "]"

    def grammar(self, tools: list[dict], parallel: bool = True) -> str:
        schema = json.dumps(call_schema(tools, self.args_key), ensure_ascii=False)
        return f'start: {lark_literal(self.TAG + "[")} call{more_calls(parallel, ", ")} "]"\ncall: %json {schema}\n'


def _json_call(call: dict, args_key: str) -> str:
    return json.dumps({"name": call["name"], args_key: call["arguments"]}, ensure_ascii=False)


def _parse_json_call(text: str, args_key: str) -> ToolCall | None:
    try:
        return _call(json.loads(text.strip()), args_key)
    except ValueError:
        return None


def _less_suffix_prefix(text: str, closing: str) -> str:
    """``text`` less trailing whitespace and the start of ``closing`` it ends with (a cut closing tag)."""
    text = text.rstrip()
    for k in range(len(closing), 0, -1):
        if text.endswith(closing[:k]):
            return text[:-k]
    return text


def _begins_call(text: str) -> bool:
    """``text`` is the start of a JSON call object (``{"name"...``), however short."""
    compact = "".join(text.split())
    return compact.startswith('{"name"') or '{"name"'.startswith(compact)


def _whole_items(payload: str) -> list[object]:
    """The whole values at the start of a JSON list cut short (``[{...}, {...}, {"na``)."""
    if not payload.startswith("["):
        return []
    decoder, i = json.JSONDecoder(), 1
    items: list[object] = []
    while True:
        while i < len(payload) and payload[i].isspace():
            i += 1
        try:
            item, i = decoder.raw_decode(payload, i)
        except ValueError:
            return items
        items.append(item)
        while i < len(payload) and payload[i].isspace():
            i += 1
        if payload[i : i + 1] != ",":
            return items
        i += 1


def _content(text: str, calls: list[ToolCall]) -> str:
    """What is left as content beside calls: nothing when it is only whitespace."""
    return text if not calls or text.strip() else ""


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            escaped, in_str = (False, in_str) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]
