"""A request's prompt to token ids, without holding the event loop, each tenant in its turn.

Decoding a big body, rendering a chat template and tokenizing take time proportional to the
input, so they run in a few worker threads the server owns, never on the loop, and those threads
serve the tenants round robin (:mod:`lorapage.tenancy.fair_workers`): one tenant's backlog of huge
prompts does not hold another's small one. Before any of it, cheap bounds refuse what cannot fit,
with a 400 ``context_length_exceeded``:

- a prompt (or the messages' contents together) of more characters than ``max_model_len x``
  :func:`max_chars_per_token` needs more tokens than the context holds;
- a chat of more messages than the context has tokens (a template spends at least one token on
  each message's role marker).

A prompt longer than one chunk (:data:`CHUNK_CHARS`) is tokenized chunk by chunk first, each
chunk a unit of work in its tenant's turn, and refused as soon as the chunks hold more tokens
than the context: a prompt far over the context costs about a context's worth of tokenizing, not
its whole length. One that fits is then tokenized whole, so its ids are exactly the tokenizer's
(a chunk boundary can change how the text around it splits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorapage.errors import InvalidRequestError, LorapageError, PromptTooLongError
from lorapage.frontend.fields import ToolUse, tool_use
from lorapage.frontend.protocol import Parsed
from lorapage.frontend.template_kwargs import template_kwargs
from lorapage.tenancy.fair_workers import FairWorkers
from lorapage.tools.families import AUTO, tool_format
from lorapage.tools.prompting import conversation
from lorapage.tools.reasoning import opens_thinking

if TYPE_CHECKING:
    from lorapage.model.tokenizer import Tokenizer

_WORKERS = 2  # threads for bodies, templates and tokenization; a tenant holds one at most
_COMPOSITION = 4  # Unicode composition (NFC, NFKC) turns at most 4 code points into one
CHUNK_CHARS = 1 << 16  # a prompt is tokenized in chunks of about this many characters
_CUT_WINDOW = 1024  # a chunk ends at the last space or newline in its final this many characters
_BOUNDARY_SLACK = 8  # tokens a chunk boundary may add to the count (a word split in two)
INLINE_BODY_BYTES = 1 << 16  # bodies up to this size are decoded on the loop (well under a millisecond)


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """The most input characters one token can stand for: the longest vocabulary entry (added
    tokens included), times :data:`_COMPOSITION` when the tokenizer normalizes its input first.

    A byte-level entry has one character per byte and a byte-fallback piece (``<0xE2>``) six
    characters for one byte, so the entry's length bounds the characters it covers from above.
    """
    longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)
    return longest * (_COMPOSITION if tokenizer.backend.normalizer is not None else 1)


def chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, each cut after a space or newline
    near its end when there is one (so words are rarely split)."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            low = max(start + 1, end - _CUT_WINDOW)
            cut = max(text.rfind(" ", low, end), text.rfind("\n", low, end))
            end = cut + 1 if cut >= low else end
        yield text[start:end]
        start = end


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (what the engine computes,
    so what usage reports and the quota charges); a bad ``keep`` is refused with the sampling
    parameters."""
    return ids[-keep:] if isinstance(keep, int) and 0 < keep < len(ids) else ids


@dataclass(frozen=True)
class Prompts:
    """A request's prompts as token ids, with what the answer needs of them: each one's text (an
    echoed completion starts with it) and the chat's tools."""

    ids: list[list[int]]
    texts: list[str]
    tools: ToolUse | None = None
    thinking_open: bool = False  # the chat's prompt leaves a <think> block open (reasoning_parser qwen3)


class PromptBuilder:
    """Bounds, renders and tokenizes prompts for one model, fairly across tenants, in :attr:`workers`."""

    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int, threads: int = _WORKERS, *, tool_call_parser: str = AUTO
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = max_chars_per_token(tokenizer)
        self.max_prompt_chars = max_model_len * self.chars_per_token
        self.workers = FairWorkers(threads, name="lorapage-prompt")
        # How this model writes tool calls: --tool-call-parser's, else the one its (tool) template shows.
        self.tool_format = tool_format(tool_call_parser, tokenizer.tool_template)

    def check_chars(self, chars: int, where: str) -> None:
        """Refuse ``chars`` characters of prompt that no tokenization could fit in the context."""
        if chars > self.max_prompt_chars:
            raise PromptTooLongError(
                f"The {where} is {chars} characters; this model's maximum context length is "
                f"{self.max_model_len} tokens, which hold at most {self.max_prompt_chars} characters "
                f"({self.chars_per_token} per token at most). Shorten the {where}.",
                param=where,
            )

    def check_chat(self, messages: list[dict[str, Any]]) -> None:
        if len(messages) > self.max_model_len:
            raise PromptTooLongError(
                f"{len(messages)} messages cannot fit in this model's maximum context length of "
                f"{self.max_model_len} tokens (each message takes at least one); send fewer messages.",
                param="messages",
            )
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")

    async def parse(self, tenant: str, body: bytes, parse: Callable[[bytes], Parsed]) -> Parsed:
        """``parse(body)``: on the loop for a small body, in ``tenant``'s turn on a worker for a big one."""
        if len(body) <= INLINE_BODY_BYTES:
            return parse(body)
        return await self.workers.run(tenant, parse, body)

    async def chat(
        self,
        tenant: str,
        messages: list[dict[str, Any]],
        tools: ToolUse | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation (with its tools, and earlier tool calls and results, as the template
        takes them: :func:`lorapage.tools.conversation`) through the chat template, with the
        request's ``chat_template_kwargs``, tokenized (the template writes BOS itself)."""
        return (await self._chat(tenant, messages, tools, template_kwargs))[1]

    async def _chat(
        self, tenant: str, messages: list[dict[str, Any]], tools: ToolUse | None, template_kwargs: dict[str, Any] | None
    ) -> tuple[str, list[int]]:
        self.check_chat(messages)
        text = await self.workers.run(tenant, self._render, messages, tools, True, template_kwargs)
        return text, await self._encode(tenant, text, "messages", add_special_tokens=False)

    async def of(self, kind: str, tenant: str, parsed: Parsed) -> Prompts:
        """Every prompt of a parsed chat or completions request, tokenized in ``tenant``'s turn."""
        keep = parsed.req.truncate_prompt_tokens
        if kind == "chat":
            req = parsed.req
            tools = tool_use(req, self.tool_format)
            kwargs = template_kwargs(req.chat_template_kwargs, req.chat_template)
            rendered, chat_ids = await self._chat(tenant, parsed.prompt, tools, kwargs)
            return Prompts([truncated(chat_ids, keep)], [], tools, opens_thinking(rendered))
        whole = [await self.completion(tenant, p) for p in parsed.prompts]
        ids = [truncated(p, keep) for p in whole]
        if not getattr(parsed.req, "echo", False):
            return Prompts(ids, [])
        texts = [
            p if isinstance(p, str) and len(cut) == len(full) else self.tokenizer.backend.decode(cut)
            for p, full, cut in zip(parsed.prompts, whole, ids, strict=True)
        ]
        return Prompts(ids, texts)

    async def completion(self, tenant: str, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (BOS added as the tokenizer config says)."""
        if not isinstance(prompt, str):
            return prompt
        self.check_chars(len(prompt), "prompt")
        return await self._encode(tenant, prompt, "prompt", add_special_tokens=True)

    async def tokens(self, tenant: str, text: str, where: str, *, add_special_tokens: bool) -> list[int]:
        """``text`` tokenized as it is (``add_special_tokens``: BOS as the tokenizer config says),
        bounded like a prompt: vLLM's ``/tokenize`` of a prompt."""
        self.check_chars(len(text), where)
        return await self._encode(tenant, text, where, add_special_tokens=add_special_tokens)

    async def chat_tokens(
        self,
        tenant: str,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """:meth:`chat` with the template's options: the generation prompt or not, special tokens
        on top of the template's, and extra template variables (``tools``)."""
        self.check_chat(messages)
        text = await self.workers.run(tenant, self._render, messages, None, add_generation_prompt, template_kwargs)
        return await self._encode(tenant, text, "messages", add_special_tokens=add_special_tokens)

    async def detokenize(self, tenant: str, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept (vLLM's ``/detokenize``), in ``tenant``'s turn."""
        return await self.workers.run(tenant, self.tokenizer.backend.decode, ids, False)

    async def _encode(self, tenant: str, text: str, where: str, *, add_special_tokens: bool) -> list[int]:
        encode = self.tokenizer.encode
        if len(text) > CHUNK_CHARS:
            counted = 0
            for boundaries, piece in enumerate(chunks(text)):
                counted += len(await self.workers.run(tenant, encode, piece, False))
                if counted > self.max_model_len + _BOUNDARY_SLACK * boundaries:
                    raise PromptTooLongError(
                        f"The {where} is more than {self.max_model_len} tokens (tokenizing stopped there); this "
                        f"model's maximum context length is {self.max_model_len} tokens. Shorten the {where}.",
                        param=where,
                    )
        return await self.workers.run(tenant, encode, text, add_special_tokens)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: ToolUse | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            fmt = tools.fmt if tools is not None else self.tool_format
            tokenizer = self.tokenizer
            template = tokenizer.tool_template if tools is not None else tokenizer.chat_template
            messages, extra = conversation(
                messages, tools.tools if tools else None, fmt, template, system_role=tokenizer.takes_system_role
            )
            kwargs.update(extra)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except LorapageError:
            raise
        except Exception as exc:  # jinja errors of third-party templates: the messages do not fit them
            raise InvalidRequestError(
                f"the model's chat template could not render these messages ({type(exc).__name__}: {exc})",
                param="messages",
            ) from None
