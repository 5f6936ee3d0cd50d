"""OpenAI's Responses API (``POST /v1/responses``), the subset agent frameworks use: its request.

Supported: ``input`` as text or a list of items (messages with text parts, ``function_call`` and
``function_call_output`` items, so a conversation with tools can be sent back whole, as the
OpenAI Agents SDK does), ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``,
``stream``, function ``tools`` with ``tool_choice`` (``auto``, ``none``, ``required``, a named
function: the last two constrained by the tool format's grammar, so even an untrained adapter
returns valid calls) and ``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``,
``json_schema``), and ``metadata`` (echoed). Hints that change nothing here (``user``,
``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``) are accepted. lorapage
stores no responses, so what needs storage (``store: true``, ``previous_response_id``,
``conversation``, ``background``, item references) is a 400, as is every other field away from
its default (built-in tools, ``reasoning``, ``include``, ``truncation: auto``...): a client
never silently gets behaviour it did not ask for.

The items become chat messages for the model's template through :mod:`lorapage.tools` (the
same rendering as chat completions with tools); the answer is built by
:mod:`lorapage.frontend.responses_output`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from lorapage.errors import InvalidRequestError, PromptTooLongError
from lorapage.frontend import protocol
from lorapage.frontend.protocol import INT64_MAX, MAX_CONTENT_PARTS, MAX_MESSAGES, Parsed
from lorapage.sampling_params import SamplingParams
from lorapage.structured import StructuredSpec
from lorapage.tools import FORMATS, ToolFormat, conversation

MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_TEXT_PARTS = ("input_text", "output_text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /v1/responses``; fields lorapage does not implement decode as ``Any`` and
    are refused unless at their default (see :data:`_DEFAULTS`)."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: dict[str, bool] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: Any = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    store: Any = None
    include: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    reasoning: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    service_tier: Any = None
    context_management: Any = None


def _none_or(*allowed: Any) -> Any:
    return lambda v: v is None or any(type(v) is type(a) and v == a for a in allowed)


# Field -> (test that its value is the default, what to send instead).
_DEFAULTS = {
    "store": (_none_or(False), "lorapage stores no responses: omit store or send false"),
    "previous_response_id": (
        _none_or(),
        "lorapage stores no responses: send the whole conversation as input items instead",
    ),
    "conversation": (_none_or(), "lorapage stores no conversations: send the whole conversation as input items"),
    "background": (_none_or(False), "lorapage answers in the foreground only: omit background"),
    "include": (_none_or([]), "lorapage includes nothing extra in a response: omit include or send []"),
    "reasoning": (
        lambda v: v is None or (isinstance(v, dict) and all(x is None for x in v.values())),
        "lorapage's models return no reasoning items: omit reasoning",
    ),
    "truncation": (_none_or("disabled"), "lorapage never drops input items: omit truncation or send disabled"),
    "top_logprobs": (_none_or(0), "logprobs are not supported on /v1/responses: use /v1/chat/completions"),
    "max_tool_calls": (_none_or(), "omit max_tool_calls (at most 4 calls per response, 1 without parallel)"),
    "prompt": (_none_or(), "lorapage has no stored prompts: send instructions and input"),
    "service_tier": (_none_or("auto", "default"), "omit service_tier or send auto"),
    "context_management": (_none_or(), "omit context_management"),
}


@dataclass(frozen=True)
class ResponsesPlan:
    """A checked request: the chat messages and template variables to render, the tools (chat
    completions' shape, for the template and the grammar), the format their calls are parsed
    in (None: calls are not parsed, ``tool_choice`` none), and the constraint on the output."""

    req: ResponsesRequest
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_format: ToolFormat | None
    structured: StructuredSpec | None
    response_id: str
    created_at: int

    def sampling(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The engine's parameters; the output budget must fit the context with the prompt
        (without ``max_output_tokens`` it is the rest of the context)."""
        req = self.req
        room = max_model_len - prompt_len
        max_tokens = req.max_output_tokens if req.max_output_tokens is not None else room
        if room < 1 or max_tokens > room:
            asked = f"{max_tokens} in the output" if req.max_output_tokens is not None else "at least 1 to complete"
            raise PromptTooLongError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the input, {asked}). Reduce the "
                "length of the input or max_output_tokens.",
                param="max_output_tokens" if room >= 1 else "input",
            )
        top_p = 1.0 if req.top_p is None else req.top_p
        top_k = 1 if top_p == 0.0 else 0  # top_p 0 is the limit of nucleus sampling: the most likely token
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if top_p == 0.0 else top_p,
            top_k=top_k,
            structured=self.structured,
        )


def parse_responses(
    body: bytes, chat_template: str | None, tool_format: ToolFormat, system_role: bool = True
) -> Parsed:
    """A ``/v1/responses`` body, decoded and checked (work bounded by the body's size and
    :data:`MAX_MESSAGES`): its request is the :class:`ResponsesPlan`, its prompt the messages."""
    req = protocol.decode(body, ResponsesRequest)
    _check_fields(req)
    tools = _tools(req.tools)
    choice = _tool_choice(req.tool_choice, tools)
    messages = _messages(req)
    offered = tools if choice != "none" else None
    rendered, kwargs = conversation(messages, offered, tool_format, chat_template, system_role=system_role)
    structured = _structured(req, tools, choice, tool_format)
    plan = ResponsesPlan(
        req=req,
        messages=rendered,
        template_kwargs=kwargs,
        tools=tools,
        tool_format=tool_format if tools and choice != "none" else None,
        structured=structured,
        response_id=f"resp_{uuid.uuid4().hex}",
        created_at=int(time.time()),
    )
    return Parsed(plan, None, [rendered])


def _check_fields(req: ResponsesRequest) -> None:
    for name, (at_default, instead) in _DEFAULTS.items():
        if not at_default(getattr(req, name)):
            raise InvalidRequestError(f"{name} is not supported by lorapage; {instead}", param=name)
    if req.stream_options is not None:
        if not req.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if set(req.stream_options) - {"include_obfuscation"}:
            raise InvalidRequestError("stream_options takes include_obfuscation only", param="stream_options")
    if req.max_output_tokens is not None and not 1 <= req.max_output_tokens <= INT64_MAX:
        raise InvalidRequestError(
            f"max_output_tokens must be an integer >= 1; got {req.max_output_tokens}", param="max_output_tokens"
        )
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequestError(f"temperature must be between 0 and 2; got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0.0 <= req.top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be between 0 and 1; got {req.top_p}", param="top_p")


def _tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Function tools in chat completions' shape (what templates and the tool grammars take)."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted; got {len(tools)}", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise InvalidRequestError(
                f"{where}: only function tools are supported by lorapage; got {kind!r}", param=f"{where}.type"
            )
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise InvalidRequestError(f"{where}: unknown field(s) {sorted(unknown)}", param=where)
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.name must be 1-64 letters, digits, '_' or '-'; got {str(name)[:100]!r}", param=f"{where}.name"
            )
        if any(t["function"]["name"] == name for t in out):
            raise InvalidRequestError(f"{where}.name {name!r} is given twice", param=f"{where}.name")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise InvalidRequestError(
                f"{where}.parameters must be a JSON schema of an object", param=f"{where}.parameters"
            )
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.description must be text", param=f"{where}.description")
        function: dict[str, Any] = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
        if description:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str:
    """``auto``, ``none``, ``required``, or the name of the one function to call."""
    if choice is None or choice in ("auto", "none", "required"):
        mode = choice or "auto"
        if mode == "required" and not tools:
            raise InvalidRequestError("tool_choice required needs tools", param="tool_choice")
        return mode
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        if not any(t["function"]["name"] == choice["name"] for t in tools):
            raise InvalidRequestError(
                f"tool_choice names {str(choice['name'])[:100]!r}, not one of the tools", param="tool_choice"
            )
        return f"function:{choice['name']}"
    raise InvalidRequestError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', param="tool_choice"
    )


def _structured(
    req: ResponsesRequest, tools: list[dict[str, Any]], choice: str, fmt: ToolFormat
) -> StructuredSpec | None:
    """The output's constraint: calls only (``required`` or a named function), or the text format."""
    text_format = _text_format(req.text)
    if choice == "required" or choice.startswith("function:"):
        if text_format is not None:
            raise InvalidRequestError(
                "text.format and a required tool_choice cannot both constrain the output; send one", param="text"
            )
        chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice.removeprefix("function:")]
        parallel = choice == "required" and req.parallel_tool_calls is not False
        return StructuredSpec("grammar", FORMATS[fmt.name].grammar(chosen, parallel), param="tool_choice")
    return text_format


def _text_format(text: Any) -> StructuredSpec | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidRequestError('text must be {"format": {...}} (and an optional verbosity)', param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequestError("text.verbosity is not supported by lorapage; omit it", param="text.verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", param="text.format")
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict) and isinstance(fmt.get("name"), str):
        return StructuredSpec("json", json.dumps(fmt["schema"], ensure_ascii=False), param="text.format")
    raise InvalidRequestError(
        'text.format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}}',
        param="text.format",
    )


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (assistant ``tool_calls``, ``tool`` results)."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    if not req.input:
        raise InvalidRequestError("input must hold at least one item", param="input")
    if len(req.input) > MAX_MESSAGES:
        raise InvalidRequestError(f"input holds {len(req.input)} items; at most {MAX_MESSAGES}", param="input")
    parts = sum(
        len(value)
        for item in req.input
        if isinstance(item, dict)
        for value in (item.get("content"), item.get("output"))
        if isinstance(value, list)
    )
    if parts > MAX_CONTENT_PARTS:
        raise InvalidRequestError(
            f"the input holds {parts} content parts together; at most {MAX_CONTENT_PARTS} are accepted", param="input"
        )
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object (a message or a function call item)", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "name": _text(item, "name", where)}
            call["arguments"] = _text(item, "arguments", where)
            if out and out[-1]["role"] == "assistant":  # calls after the text of one turn belong to it
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": content})
        else:
            raise InvalidRequestError(
                f"{where}: items of type {str(kind)[:100]!r} are not supported by lorapage; send messages, "
                "function_call and function_call_output items",
                param=f"{where}.type",
            )
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(_ROLES)}; got {str(role)[:100]!r}", param=f"{where}.role"
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": _ROLES[role], "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise InvalidRequestError(f"{where} must be text or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"{where}[{j}]: only input_text and output_text parts are supported; got {str(kind)[:100]!r}",
                param=f"{where}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be text", param=f"{where}.{key}")
    return value
