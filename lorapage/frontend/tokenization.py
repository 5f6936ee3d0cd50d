"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

The bodies and answers are vLLM's, so clients written for vLLM (lm-eval's remote tokenizer,
scripts that count tokens) work unchanged. Both front ends call these functions; each brings its
own auth, quota and body reading, in the order every route keeps: tenant key, the tenant's
requests per minute, the body (bounded), the model's visibility (404 like everywhere; no
``model`` means the base model, as vLLM's default), then the work, in the tenant's turn on the
prompt threads (:class:`~lorapage.frontend.prompts.PromptBuilder`), bounded by the context: a
prompt the model could not take is refused as a generation request's would be.

Without a key the base model's tokenizer answers too (vLLM's does, and lm-eval's local-completions
model probes ``/tokenizer_info`` and ``/tokenize`` without one unless given ``auth_token``; refused,
it falls back to downloading a tokenizer named after the model from the Hugging Face Hub). What
that reveals is the base model's own tokenizer, chat template and context length: the same for
every tenant and every adapter, nothing of any tenant, adapter or request. So a caller without a
key may not name a ``model`` (401: which adapters exist is for tenants to ask), and key-less callers
together are one share (:class:`KeylessShare`): one turn on the prompt threads among the tenants',
and at most :data:`KEYLESS_IN_FLIGHT` requests at once (429 past it); no requests-per-minute
bound, which would break the remote tokenizer of an evaluation (a ``/tokenize`` per document). A
key that is sent must be a tenant's (401 otherwise), and then the tenant's quota applies as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, cast

import msgspec

from lorapage.errors import AuthenticationError, InvalidRequestError, PromptTooLongError, QuotaExceededError
from lorapage.frontend import protocol
from lorapage.frontend.prompts import PromptBuilder
from lorapage.frontend.protocol import MAX_MESSAGES, Parsed
from lorapage.frontend.template_kwargs import template_kwargs

ModelCheck = Callable[[str], Awaitable[object]]  # 404 unless the tenant may use the model
KEYLESS_TENANT = "(no key)"  # the prompt threads' turn key-less callers share (a tenant so named: its turn too)
KEYLESS_IN_FLIGHT = 4  # key-less tokenizer requests at once, all callers together


class KeylessShare:
    """What key-less callers of the tokenizer routes may hold together: :data:`KEYLESS_IN_FLIGHT`
    requests at once (429 past it), each run in :data:`KEYLESS_TENANT`'s turn, for the base only."""

    def __init__(self, limit: int = KEYLESS_IN_FLIGHT) -> None:
        self.limit, self.in_flight = limit, 0

    def admit(self) -> None:
        if self.in_flight >= self.limit:
            raise QuotaExceededError(
                f"{self.limit} tokenizer requests without an API key are running; retry, or send a tenant key",
                retry_after=1,
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    @staticmethod
    async def check_model(model: str) -> object:
        """A key-less caller names no model: the base's tokenizer is the one that answers."""
        raise AuthenticationError(
            "without an API key only the base model's tokenizer answers: omit model, or send a tenant key"
        )


# Fields of vLLM's /tokenize that lorapage refuses unless absent (chat_template: see
# lorapage.frontend.template_kwargs, which checks chat_template_kwargs too).
_REFUSED = ("mm_processor_kwargs", "tools")


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[protocol.ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    tools: Any = None


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def parse_tokenize(body: bytes) -> Parsed:
    """A ``/tokenize`` body, decoded and checked: its prompt text or its messages."""
    req = protocol.decode(body, TokenizeRequest)
    for name in _REFUSED:
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"{name} is not supported by lorapage's /tokenize; omit it", param=name)
    template_kwargs(req.chat_template_kwargs, req.chat_template)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("send either prompt (text) or messages (a chat), once", param="prompt")
    if req.continue_final_message:
        raise InvalidRequestError(
            "continue_final_message is not supported by lorapage; omit it or send false", param="continue_final_message"
        )
    if req.messages is None:
        return Parsed(req, None, [req.prompt or ""])
    if not req.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    chat = protocol.ChatCompletionRequest(model=req.model or "", messages=req.messages)
    return Parsed(req, None, [protocol.chat_messages(chat)])


def parse_detokenize(body: bytes, vocab_size: int, max_model_len: int) -> Parsed:
    """A ``/detokenize`` body: at most a context's worth of token ids, each in the vocabulary."""
    req = protocol.decode(body, DetokenizeRequest)
    if len(req.tokens) > max_model_len:
        raise PromptTooLongError(
            f"{len(req.tokens)} tokens is more than this model's maximum context length of {max_model_len}",
            param="tokens",
        )
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return Parsed(req, None, [req.tokens])


async def tokenize(prompts: PromptBuilder, tenant: str, body: bytes, check_model: ModelCheck) -> TokenizeResponse:
    """``/tokenize``: the prompt's (or the rendered chat's) token ids, for ``tenant``."""
    parsed = await prompts.parse(tenant, body, parse_tokenize)
    req: TokenizeRequest = parsed.req
    if req.model is not None:
        await check_model(req.model)
    if req.messages is None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        assert isinstance(parsed.prompt, str)
        ids = await prompts.tokens(tenant, parsed.prompt, "prompt", add_special_tokens=special)
    else:
        ids = await prompts.chat_tokens(
            tenant,
            cast(list[dict[str, Any]], parsed.prompt),
            add_generation_prompt=req.add_generation_prompt,
            add_special_tokens=bool(req.add_special_tokens),
            template_kwargs=template_kwargs(req.chat_template_kwargs, None),
        )
    if len(ids) > prompts.max_model_len:
        where = "prompt" if req.messages is None else "messages"
        raise PromptTooLongError(
            f"The {where} is {len(ids)} tokens; this model's maximum context length is {prompts.max_model_len} "
            f"tokens. Shorten the {where}.",
            param=where,
        )
    strs = [prompts.tokenizer.backend.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=prompts.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(prompts: PromptBuilder, tenant: str, body: bytes, check_model: ModelCheck) -> DetokenizeResponse:
    """``/detokenize``: the text of the token ids (special tokens kept), for ``tenant``."""
    vocab, max_len = prompts.tokenizer.vocab_size, prompts.max_model_len
    parsed = await prompts.parse(tenant, body, lambda b: parse_detokenize(b, vocab, max_len))
    if parsed.req.model is not None:
        await check_model(parsed.req.model)
    return DetokenizeResponse(prompt=await prompts.detokenize(tenant, cast(list[int], parsed.prompt)))


def tokenizer_info(prompts: PromptBuilder) -> dict[str, Any]:
    """``/tokenizer_info``: the tokenizer's configuration as vLLM reports it (its class, named
    special tokens, the chat template, the context), what lm-eval's remote tokenizer reads."""
    tokenizer = prompts.tokenizer
    info: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}
    info["model_max_length"] = prompts.max_model_len
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
