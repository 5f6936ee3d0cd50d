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
from lorapage.sampling_params import SamplingParams

INT64_MAX = 2**63 - 1
# Bounds on what a body may hold, checked while it is decoded (msgspec) or right after, before
# any per-item Python work: 140,000 empty messages once cost the loop a second before any check.
MAX_MESSAGES = 4096  # a chat's messages
MAX_CONTENT_PARTS = 4096  # content parts of all its messages together
MAX_MODEL_CHARS = 512  # a model name longer than this names nothing (ids are at most 128 characters)
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
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    """Fields chat and completions share."""

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
    logit_bias: Any = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None  # stored-completions tags: nothing to store, so ignored
    prompt_cache_key: str | None = None  # a caching hint; harmless to ignore
    safety_identifier: str | None = None  # like `user`, an opaque end-user id
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    verbosity: Any = None


class CompletionRequest(_Common):
    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: Any = None
    best_of: Any = None
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
    expected_base_digest: str | None = None
    activate: bool = True


class AdapterAliasRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Deploy or roll back: the version an adapter id serves from now on."""

    version: int


def _is(value: Any, *defaults: Any) -> bool:
    """``value`` is one of ``defaults``, with types compared too (so ``1`` is not ``True``)."""
    return any(type(value) is type(d) and value == d for d in defaults)


# Field -> test that its value is the default (behaviour lorapage already has).
_NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "logit_bias": lambda v: _is(v, None, {}),
    "tools": lambda v: _is(v, None, []),
    "tool_choice": lambda v: _is(v, None, "none", "auto"),
    "parallel_tool_calls": lambda v: _is(v, None, True),
    "functions": lambda v: _is(v, None, []),
    "function_call": lambda v: _is(v, None, "none", "auto"),
    "response_format": lambda v: _is(v, None, {"type": "text"}),
    "audio": lambda v: v is None,
    "modalities": lambda v: _is(v, None, ["text"]),
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": lambda v: _is(v, None, False),
    "service_tier": lambda v: _is(v, None, "auto", "default"),
    "verbosity": lambda v: _is(v, None, "medium"),
    "echo": lambda v: _is(v, None, False),
    "best_of": lambda v: _is(v, None, 1),
    "suffix": lambda v: _is(v, None, ""),
}
_SHOWN = {"response_format": '{"type": "text"}', "modalities": '["text"]'}


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
    if req.n is not None and req.n != 1:
        raise InvalidRequestError(
            f"n must be 1: lorapage returns one choice per request (got {req.n}); send n requests instead",
            param="n",
        )
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


def requested_max_tokens(req: _Common) -> tuple[int | None, str]:
    """The completion budget the client asked for (``None``: the rest of the context) and its field."""
    value, param = req.max_tokens, "max_tokens"
    newer = getattr(req, "max_completion_tokens", None)
    if newer is not None:
        if value is not None and value != newer:
            raise InvalidRequestError(
                "max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
                param="max_completion_tokens",
            )
        value, param = newer, "max_completion_tokens"
    if value is not None and value < 1:
        raise InvalidRequestError(f"{param} must be an integer >= 1; got {value}", param=param)
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


_ROLES = ("system", "developer", "user", "assistant")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The conversation as ``{"role", "content"}`` text messages for the chat template."""
    if not req.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    parts = sum(len(m.content) for m in req.messages if isinstance(m.content, list))
    if parts > MAX_CONTENT_PARTS:
        raise InvalidRequestError(
            f"the messages hold {parts} content parts together; at most {MAX_CONTENT_PARTS} are accepted",
            param="messages",
        )
    out = []
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role not in _ROLES:
            raise InvalidRequestError(
                f"{where}.role {msg.role!r} is not supported; use one of {', '.join(_ROLES)} "
                "(lorapage has no tool calling)",
                param=f"{where}.role",
            )
        for name in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if not _is(getattr(msg, name), None, []):
                raise InvalidRequestError(f"{where}.{name} is not supported by lorapage", param=f"{where}.{name}")
        role = "system" if msg.role == "developer" else msg.role
        out.append({"role": role, "content": _message_text(msg.content, where)})
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


def completion_prompt(req: CompletionRequest, vocab_size: int, max_model_len: int) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids checked against the vocabulary
    (after their count, so a list too long for the context is refused without a scan)."""
    prompt = req.prompt
    if prompt is None:
        raise InvalidRequestError("missing required field: prompt", param="prompt")
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    # Counted before any scan: token ids past the context, or (a list of prompts) more than one.
    if len(prompt) > max_model_len and type(prompt[0]) is not int:
        raise InvalidRequestError("lorapage takes one prompt per request; send one request per prompt", param="prompt")
    if len(prompt) > max_model_len:
        raise PromptTooLongError(
            f"The prompt is {len(prompt)} tokens; this model's maximum context length is {max_model_len} "
            "tokens. Shorten the prompt.",
            param="prompt",
        )
    if all(type(t) is int for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt"
            )
        return list(prompt)
    if all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequestError("lorapage takes one prompt per request; send one request per prompt", param="prompt")
    raise InvalidRequestError(
        "prompt must be a string, a list of token ids, or a list holding one of those", param="prompt"
    )


@dataclass(frozen=True)
class Parsed:
    """A body decoded and checked, up to what needs the server's state (model, quota, tokens):
    the request, its logprobs count, and its prompt (chat messages, text or token ids)."""

    req: Any
    logprobs: int | None
    prompt: list[dict[str, str]] | str | list[int]


def parse_chat(body: bytes) -> Parsed:
    """A chat completion body, decoded and checked (its work is bounded by the body's size and
    :data:`MAX_MESSAGES`; the caller runs it off the event loop when the body is big)."""
    req = decode(body, ChatCompletionRequest)
    check_common(req)
    logprobs = chat_logprobs(req)
    return Parsed(req, logprobs, chat_messages(req))


def parse_completion(body: bytes, vocab_size: int, max_model_len: int) -> Parsed:
    """A completion body, decoded and checked, as :func:`parse_chat`."""
    req = decode(body, CompletionRequest)
    check_common(req)
    logprobs = completion_logprobs(req)
    return Parsed(req, logprobs, completion_prompt(req, vocab_size, max_model_len))


def sampling_params(
    req: _Common, prompt_len: int, max_model_len: int, logprobs: int | None, kind: str
) -> SamplingParams:
    """The engine's sampling parameters; the completion budget must fit the context with the prompt.

    Without a budget the completion may use the rest of the context. ``top_p == 0`` (allowed by
    OpenAI) is the limit of nucleus sampling: only the most likely token, i.e. ``top_k = 1``.
    """
    max_tokens, param = requested_max_tokens(req)
    room = max_model_len - prompt_len
    if max_tokens is None and room >= 1:
        max_tokens = room
    if max_tokens is None or max_tokens > room:
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
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=top_p,
        top_k=top_k,
        seed=req.seed,
        stop=stop,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )


def resolve_model(model: str, base: str, version_of: Callable[[str], str | None]) -> tuple[str, str | None]:
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
