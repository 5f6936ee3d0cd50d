"""OpenAI request bodies as msgspec structs, and their checks.

Decoding is strict: a wrong type or a field OpenAI does not define is a 400 naming the field.
Fields OpenAI defines but lorapage does not implement (``tools``, ``logit_bias``, ...) decode as
``Any`` and are accepted only at their default (absent, null, or the documented default value);
anything else is a 400 naming the field, so a client never silently gets behaviour it did not ask
for. Ranges follow OpenAI's documentation; :class:`~lorapage.sampling_params.SamplingParams` re-checks
the sampling values.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from lorapage.errors import AdapterNotFoundError, InvalidRequestError, PromptTooLongError
from lorapage.frontend.fields import (
    Extras,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDef,
    check_extras,
    structured_spec,
)
from lorapage.frontend.template_kwargs import template_kwargs
from lorapage.sampling_params import MAX_N, SamplingParams
from lorapage.structured.spec import StructuredSpec

INT64_MAX = 2**63 - 1
# Bounds on what a body may hold, checked while it is decoded (msgspec) or right after, before
# any per-item Python work: 140,000 empty messages once cost the loop a second before any check.
MAX_MESSAGES = 4096  # a chat's messages
MAX_CONTENT_PARTS = 4096  # content parts of all its messages together
MAX_MODEL_CHARS = 512  # a model name longer than this names nothing (ids are at most 128 characters)
MAX_PROMPTS = 256  # prompts in one completions request
DEFAULT_COMPLETION_TOKENS = 16  # a completion without max_tokens (OpenAI's and vLLM's default)
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `(?P<field>[^`]*)`")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]*)`")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels; not needed here


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None


class _Common(Extras, forbid_unknown_fields=True, kw_only=True):
    """Fields chat and completions share (vLLM's extras included: :class:`~lorapage.frontend.fields.Extras`)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's name); 0 or -1 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None  # stored-completions tags: nothing to store, so ignored
    prompt_cache_key: str | None = None  # a caching hint; harmless to ignore
    safety_identifier: str | None = None  # like `user`, an opaque end-user id
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: Any = None  # vLLM's request template: refused (lorapage.frontend.template_kwargs)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    verbosity: Any = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: Any = None


class AdapterCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Admin registration of a new version of an adapter id: where its files are (``source``: a
    directory under an adapter root, ``file://``, ``https://``, ``s3://`` or ``hf://``; ``path``
    is the older name for a directory), its owner tenant, the sha256 content digest it must have
    (required for https), the base digest it was trained on, and whether the id's alias moves to
    it now (``activate``; False registers it for a later deploy)."""

    id: str
    tenant: str
    source: str | None = None
    path: str | None = None
    sha256: str | None = None
    expected_base_digest: str | None = None  # None: its base_model_name_or_path decides (lorapage.adapters.binding)
    activate: bool = True
    # Prompts its base-upgrade drift check runs (bounded: lorapage.registry.drift_state), stored
    # with the id; and whether the server may sample more from the adapter's traffic.
    check_prompts: list[str] | None = None
    sample_check_prompts: bool | None = None


class CheckPromptsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /v1/adapters/{id}/check_prompts``: what is given replaces what is stored; what is
    left out stays."""

    prompts: list[str] | None = None
    sample: bool | None = None
    opt_out: bool | None = None


class ValidateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/bases/{digest}/validate``: the candidate base's directory (None: the server
    runs that base beside its own, ``--base``, and that engine is used), and which adapter ids to
    check (None: every id whose current version this server serves)."""

    model: str | None = None
    adapters: list[str] | None = None


class MigrateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/bases/{digest}/migrate``: the adapter ids to move (None: every one that passed)."""

    adapters: list[str] | None = None


class AdapterAliasRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Deploy or roll back: the version an adapter id serves from now on."""

    version: int


class RollbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A rollback: to ``version``, or (None) to the version before the last deploy; of the id's
    own alias, or of its named ``channel``."""

    version: int | None = None
    channel: str | None = None


def _is(value: Any, *defaults: Any) -> bool:
    """``value`` is one of ``defaults``, with types compared too (so ``1`` is not ``True``)."""
    return any(type(value) is type(d) and value == d for d in defaults)


# Field -> test that its value is the default (behaviour lorapage already has).
_NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: _is(v, None, []),  # the legacy form of tools: send tools
    "function_call": lambda v: _is(v, None, "none", "auto"),
    "audio": lambda v: v is None,
    "modalities": lambda v: _is(v, None, ["text"]),
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": lambda v: _is(v, None, False),
    "service_tier": lambda v: _is(v, None, "auto", "default"),
    "verbosity": lambda v: _is(v, None, "medium"),
    "suffix": lambda v: _is(v, None, ""),
}
_SHOWN = {"modalities": '["text"]'}


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into ``kind``; any failure is a 400 naming the field when known.

    Nesting is bounded by the decoder's recursion guard (about a thousand levels): deeper JSON
    is a 400, not a ``RecursionError``."""
    if not body.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"the body is not valid JSON ({e}); send a UTF-8 encoded JSON object") from None
    except RecursionError:
        raise InvalidRequestError(
            "the body nests JSON arrays or objects too deeply; no field lorapage accepts needs more than a few levels"
        ) from None


def _validation_error(text: str) -> InvalidRequestError:
    m = _PATH.search(text)
    where = m.group("path") if m else ""
    if u := _UNKNOWN.search(text):
        field = f"{where}.{u.group('field')}" if where else u.group("field")
        return InvalidRequestError(
            f"Unrecognized request argument supplied: {field} (not a field of this endpoint in OpenAI's API)",
            param=field,
        )
    if miss := _MISSING.search(text):
        field = f"{where}.{miss.group('field')}" if where else miss.group("field")
        return InvalidRequestError(f"missing required field: {field}", param=field)
    message = _PATH.sub("", text)
    if not where:
        return InvalidRequestError(f"{message}: the body must be a JSON object")
    return InvalidRequestError(f"{message} for field {where}", param=where)


def check_not_implemented(req: msgspec.Struct) -> None:
    """Refuse OpenAI fields lorapage does not implement unless they are at their default."""
    for name, at_default in _NOT_IMPLEMENTED.items():
        if hasattr(req, name) and not at_default(getattr(req, name)):
            default = _SHOWN.get(name, "null")
            raise InvalidRequestError(f"{name} is not supported by lorapage; omit it or send {default}", param=name)


def check_common(req: _Common) -> None:
    """Ranges and combinations that hold for chat and completions alike."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}; got {req.n}", param="n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != 1 and best_of != req.n:
        raise InvalidRequestError(
            "best_of is not supported (as in vLLM's V1 engine): use n for several answers", param="best_of"
        )
    check_extras(req)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    if req.seed is not None and not -INT64_MAX - 1 <= req.seed <= INT64_MAX:
        raise InvalidRequestError("seed must fit in a signed 64-bit integer", param="seed")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidRequestError(f"top_k must be >= 0 (0 or -1 disables); got {req.top_k}", param="top_k")
    if req.top_p is not None and not 0.0 <= req.top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be between 0 and 1; got {req.top_p}", param="top_p")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequestError(f"temperature must be between 0 and 2; got {req.temperature}", param="temperature")
    check_not_implemented(req)


def requested_max_tokens(req: _Common, allow_zero: bool = False) -> tuple[int | None, str]:
    """The completion budget the client asked for (``None``: the default) and its field."""
    value, param = req.max_tokens, "max_tokens"
    newer = getattr(req, "max_completion_tokens", None)
    if newer is not None:
        if value is not None and value != newer:
            raise InvalidRequestError(
                "max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
                param="max_completion_tokens",
            )
        value, param = newer, "max_completion_tokens"
    if value is not None and value < (0 if allow_zero else 1):
        least = "0 (with echo)" if allow_zero else "1"
        raise InvalidRequestError(f"{param} must be an integer >= {least}; got {value}", param=param)
    return value, param


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Top-alternative count for the engine (``None``: no logprobs)."""
    top = req.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise InvalidRequestError(f"top_logprobs must be between 0 and 20; got {top}", param="top_logprobs")
    if top and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if req.logprobs else None


def completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise InvalidRequestError(f"logprobs must be between 0 and 5; got {req.logprobs}", param="logprobs")
    return req.logprobs


_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as ``{"role", "content"}`` messages for the chat template; an assistant's
    earlier tool calls as ``tool_calls`` (``{"id", "name", "arguments"}``) and a tool's result with
    its ``tool_call_id``."""
    if not req.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    parts = sum(len(m.content) for m in req.messages if isinstance(m.content, list))
    if parts > MAX_CONTENT_PARTS:
        raise InvalidRequestError(
            f"the messages hold {parts} content parts together; at most {MAX_CONTENT_PARTS} are accepted",
            param="messages",
        )
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role not in _ROLES:
            raise InvalidRequestError(
                f"{where}.role {msg.role!r} is not supported; use one of {', '.join(_ROLES)}", param=f"{where}.role"
            )
        for name in ("function_call", "audio"):
            if not _is(getattr(msg, name), None, []):
                raise InvalidRequestError(f"{where}.{name} is not supported by lorapage", param=f"{where}.{name}")
        if msg.tool_calls and msg.role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls belong to assistant messages", param=f"{where}.tool_calls")
        if msg.role == "tool" and not msg.tool_call_id:
            raise InvalidRequestError(f"{where}: a tool message needs tool_call_id", param=f"{where}.tool_call_id")
        role = "system" if msg.role == "developer" else msg.role
        calls = msg.tool_calls or []
        content = "" if msg.content is None and (calls or role == "assistant") else _message_text(msg.content, where)
        message: dict[str, Any] = {"role": role, "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls
            ]
        if msg.tool_call_id is not None:
            message["tool_call_id"] = msg.tool_call_id
        out.append(message)
    return out


def _message_text(content: str | list[Any] | None, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise InvalidRequestError(f"{where}.content is required", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        p = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{p}: only text parts are supported; got {kind!r}", param=p)
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise InvalidRequestError(f'{p} must be {{"type": "text", "text": <string>}}', param=p)
        texts.append(part["text"])
    return "\n".join(texts)


def completion_prompts(req: CompletionRequest, vocab_size: int, max_model_len: int) -> list[str | list[int]]:
    """The prompts of a completion request: one text, one list of token ids, or a list of either
    (batched prompts, as LangChain's ``batch`` and lm-eval send them). Token ids are checked
    against the vocabulary after their count, so a list too long for the context is refused
    without a scan."""
    prompt = req.prompt
    if prompt is None:
        raise InvalidRequestError("missing required field: prompt", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if type(prompt[0]) is int:
        return [_token_prompt(prompt, vocab_size, max_model_len, "prompt")]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request; got {len(prompt)}", param="prompt")
    out: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        where = f"prompt[{i}]"
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item:
            out.append(_token_prompt(item, vocab_size, max_model_len, where))
        else:
            raise InvalidRequestError(
                f"{where}: each prompt must be a string or a non-empty list of token ids", param="prompt"
            )
    return out


def _token_prompt(prompt: list[Any], vocab_size: int, max_model_len: int, where: str) -> list[int]:
    if len(prompt) > max_model_len:
        raise PromptTooLongError(
            f"The prompt is {len(prompt)} tokens; this model's maximum context length is {max_model_len} "
            "tokens. Shorten the prompt.",
            param="prompt",
        )
    if not all(type(t) is int for t in prompt):
        raise InvalidRequestError(f"{where} must be a string or a list of token ids", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    return list(prompt)


@dataclass(frozen=True)
class Parsed:
    """A body decoded and checked, up to what needs the server's state (model, quota, tokens):
    the request, its logprobs count, its prompts (chat messages, or completion texts / token
    ids) and the output constraint it asks for."""

    req: Any
    logprobs: int | None
    prompts: list[Any]  # chat: one list of messages; completions: each prompt
    structured: StructuredSpec | None = None

    @property
    def prompt(self) -> Any:
        return self.prompts[0]


def parse_chat(body: bytes) -> Parsed:
    """A chat completion body, decoded and checked (its work is bounded by the body's size and
    :data:`MAX_MESSAGES`; the caller runs it off the event loop when the body is big)."""
    req = decode(body, ChatCompletionRequest)
    check_common(req)
    template_kwargs(req.chat_template_kwargs, req.chat_template)
    logprobs = chat_logprobs(req)
    return Parsed(req, logprobs, [chat_messages(req)], structured_spec(req))


def parse_completion(body: bytes, vocab_size: int, max_model_len: int) -> Parsed:
    """A completion body, decoded and checked, as :func:`parse_chat`."""
    req = decode(body, CompletionRequest)
    check_common(req)
    logprobs = completion_logprobs(req)
    if req.echo and req.stream:
        raise InvalidRequestError("echo is not supported with stream; send a whole request", param="echo")
    return Parsed(req, logprobs, completion_prompts(req, vocab_size, max_model_len), structured_spec(req))


def sampling_params(
    req: _Common,
    prompt_len: int,
    max_model_len: int,
    logprobs: int | None,
    kind: str,
    structured: StructuredSpec | None = None,
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """The engine's sampling parameters; the completion budget must fit the context with the prompt.

    Without a budget a completion gets 16 tokens (OpenAI's and vLLM's default) and a chat the
    rest of the context. ``top_p == 0`` (allowed by OpenAI) is the limit of nucleus sampling: only
    the most likely token, i.e. ``top_k = 1``. ``echo`` with ``max_tokens`` 0 asks for the prompt's
    logprobs alone: one token is generated and dropped.
    """
    max_tokens, param = requested_max_tokens(req, allow_zero=kind == "completion" and bool(getattr(req, "echo", False)))
    if max_tokens is None and kind == "completion":
        max_tokens = DEFAULT_COMPLETION_TOKENS
    room = max_model_len - prompt_len
    if max_tokens is None and room >= 1:
        max_tokens = room
    if max_tokens is None or max(max_tokens, 1) > room:
        where = "messages" if kind == "chat" else "prompt"
        asked = f"{max_tokens} in the completion" if max_tokens is not None else "at least 1 to complete"
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + (max_tokens or 1)} tokens ({prompt_len} in the {where}, {asked}). "
            f"Reduce the length of the {where} or {param}.",
            param=param if room >= 1 else where,
        )
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = max(req.top_k or 0, 0)
    if top_p == 0.0:
        top_p, top_k = 1.0, 1
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    echo = kind == "completion" and bool(getattr(req, "echo", False))
    prompt_logprobs = req.prompt_logprobs
    if echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    return SamplingParams(
        max_tokens=max(max_tokens, 1),
        n=req.n or 1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=top_p,
        top_k=top_k,
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        logprobs_mode=req.logprobs_mode,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        min_tokens=min(req.min_tokens or 0, max(max_tokens, 1)),
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
        bad_words=tuple(req.bad_words or ()),
        skip_special_tokens=req.skip_special_tokens
        if req.skip_special_tokens is not None
        else (skip_special_tokens is not False),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
    )


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (raw or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 9:
            raise InvalidRequestError(f"logit_bias keys are token ids; got {key[:20]!r}", param="logit_bias")
        out.append((int(key), bias))
    return tuple(out)


def route_model(model: str, base: str, version_of: Callable[[str], str | None]) -> tuple[str, str | None]:
    """``(id to echo, adapter version or None)`` for ``base``, ``base:adapter`` or ``adapter``,
    where ``version_of(adapter)`` is what the caller may run for that name (None: unknown or
    forbidden, both 404 alike). Without versions, it returns the name itself."""
    if model == base:
        return base, None
    if len(model) > MAX_MODEL_CHARS:
        raise AdapterNotFoundError(
            f"The model `{model[:200]}...` does not exist or you do not have access to it.", param="model"
        )
    prefix, sep, name = model.rpartition(":")
    if sep and prefix != base:
        name = ""
    key = version_of(name) if name else None
    if key is not None:
        return name, key
    shown = model if len(model) <= 200 else model[:200] + "..."
    raise AdapterNotFoundError(f"The model `{shown}` does not exist or you do not have access to it.", param="model")
