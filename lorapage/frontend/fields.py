"""What a request's extra fields ask of the engine: structured output, tools, vLLM's sampling
extras; their wire structs and their checks.

- ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` /
  ``guided_choice`` / ``guided_grammar`` and their newer ``structured_outputs`` form: at most one
  constraint per request, compiled by the engine (a bad one is a 400 naming its field).
- ``tools``, ``tool_choice``, ``parallel_tool_calls``: rendered through the chat template; ``required``
  and a named function constrain the output with the tool-call format's grammar, so any adapter
  writes valid calls (:mod:`lorapage.tools`).
- vLLM's sampling extras, accepted as top-level fields as vLLM's server takes them (the openai SDK
  sends them through ``extra_body``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from lorapage.errors import InvalidRequestError
from lorapage.structured.spec import StructuredSpec
from lorapage.tools.formats import ToolFormat

MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}", re.ASCII)


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: NamedFunction


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    """An assistant message's earlier tool call (what the client sends back in the history)."""

    id: str
    function: FunctionCallIn
    type: str = "function"


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: one of these."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class Extras(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's fields of both routes (their meanings: :class:`~lorapage.sampling_params.SamplingParams`)."""

    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # RL rollouts (docs/rl.md): the policy version the request must run on (``model`` names the
    # id), and whose distribution its logprobs describe (SamplingParams.logprobs_mode).
    adapter_version: int | None = None
    logprobs_mode: str | None = None


def _json_text(value: dict[str, Any] | bool | str, param: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{param}: not a JSON schema ({exc})", param=param) from None


def structured_spec(req: Any) -> StructuredSpec | None:
    """The one output constraint a request asks for (``None``: none); two at once is a 400."""
    found: list[StructuredSpec] = []
    fmt: ResponseFormat | None = getattr(req, "response_format", None)
    if fmt is not None:
        if fmt.type == "json_object":
            found.append(StructuredSpec("json_object", "", "response_format"))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema", param="response_format"
                )
            found.append(
                StructuredSpec("json", _json_text(fmt.json_schema.schema, "response_format"), "response_format")
            )
        elif fmt.type != "text":
            raise InvalidRequestError(
                f"response_format.type must be text, json_object or json_schema; got {fmt.type!r}",
                param="response_format.type",
            )
    if req.guided_json is not None:
        found.append(StructuredSpec("json", _json_text(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredSpec("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(StructuredSpec.of_choices(req.guided_choice))
    if req.guided_grammar is not None:
        found.append(StructuredSpec("grammar", req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        asked = [
            (k, v)
            for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
            if v is not None
        ]
        if so.json_object:
            asked.append(("json_object", ""))
        for kind, value in asked:
            if kind == "choice":
                found.append(StructuredSpec.of_choices(value, param))
            elif kind == "json":
                closed = so.disable_additional_properties is not False  # vLLM's default engine's reading
                found.append(StructuredSpec("json", _json_text(value, param), param, closed))
            else:
                found.append(StructuredSpec(kind, value, param))
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(s.param for s in found))
        raise InvalidRequestError(f"ask for one output constraint at a time; got {names}", param=found[1].param)
    return found[0] if found else None


def check_extras(req: Any) -> None:
    """What the engine does not do is refused by name, as vLLM's V1 refuses it."""
    if req.use_beam_search:
        raise InvalidRequestError("use_beam_search is not supported (as in vLLM's V1 engine)", param="use_beam_search")
    if req.length_penalty is not None and req.length_penalty != 1.0:
        raise InvalidRequestError(
            "length_penalty applies to beam search, which is not supported", param="length_penalty"
        )
    if req.adapter_version is not None:
        req.model = pinned_model(req.model, req.adapter_version)
    if req.spaces_between_special_tokens is False:
        raise InvalidRequestError(
            "spaces_between_special_tokens=false is not supported (the tokenizer decides)",
            param="spaces_between_special_tokens",
        )


def pinned_model(model: str, version: int) -> str:
    """``model`` (``id`` or ``base:id``) pinned to ``adapter_version``: ``id@version``; 400 for a
    version that is not a positive integer or that ``model``'s own ``@N`` contradicts."""
    if not 1 <= version < 2**31:
        raise InvalidRequestError(
            f"adapter_version must be a version number >= 1; got {version}", param="adapter_version"
        )
    name, sep, named = model.rpartition("@")
    if not sep:
        return f"{model}@{version}"
    if named != str(version):
        raise InvalidRequestError(
            f"model {model[:200]!r} names another version than adapter_version {version}; name the id alone",
            param="adapter_version",
        )
    return model


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, as the engine will see them: the OpenAI tool list (for the chat
    template), the format the model writes calls in, whether calls are parsed from the output,
    and the constraint ``tool_choice`` asks for."""

    tools: list[dict[str, Any]]
    fmt: ToolFormat
    parse: bool
    constraint: StructuredSpec | None


def tool_use(req: Any, fmt: ToolFormat) -> ToolUse | None:
    """The request's tools and choice (``None``: no tools, or ``tool_choice`` none)."""
    tools: list[ToolDef] | None = req.tools
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted; got {len(tools)}", param="tools")
    defs = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequestError(f"tools[{i}].type must be function; got {tool.type!r}", param=f"tools[{i}].type")
        if not _TOOL_NAME.fullmatch(tool.function.name):
            raise InvalidRequestError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'",
                param=f"tools[{i}].function.name",
            )
        defs.append(msgspec.to_builtins(tool, builtin_types=None))
    for d in defs:  # omit_defaults is not set: drop the Nones the template does not expect
        d["function"] = {k: v for k, v in d["function"].items() if v is not None}
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolUse(defs, fmt, True, None)
    if choice == "none":
        return None
    if choice == "required":
        return ToolUse(defs, fmt, True, StructuredSpec("grammar", fmt.grammar(defs, parallel), "tool_choice"))
    if isinstance(choice, NamedToolChoice):
        named = [d for d in defs if d["function"]["name"] == choice.function.name]
        if not named:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
            )
        return ToolUse(defs, fmt, True, StructuredSpec("grammar", fmt.grammar(named, False), "tool_choice"))
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )
