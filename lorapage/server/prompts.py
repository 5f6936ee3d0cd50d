"""A request's prompt to token ids, without holding the event loop.

Rendering a chat template and tokenizing take time proportional to the input, so they run in a
small thread pool the server owns, never on the loop. Before either, cheap bounds refuse what
cannot fit, with a 400 ``context_length_exceeded``:

- a prompt (or the messages' contents together) of more characters than ``max_model_len x``
  :func:`max_chars_per_token` needs more tokens than the context holds;
- a chat of more messages than the context has tokens (a template spends at least one token on
  each message's role marker).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from lorapage.errors import InvalidRequestError, LorapageError, PromptTooLongError

if TYPE_CHECKING:
    from collections.abc import Callable

    from lorapage.model.tokenizer import Tokenizer

T = TypeVar("T")
_WORKERS = 2  # threads for templates and tokenization; each job is bounded by max_prompt_chars
_COMPOSITION = 4  # Unicode composition (NFC, NFKC) turns at most 4 code points into one


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """The most input characters one token can stand for: the longest vocabulary entry (added
    tokens included), times :data:`_COMPOSITION` when the tokenizer normalizes its input first.

    A byte-level entry has one character per byte and a byte-fallback piece (``<0xE2>``) six
    characters for one byte, so the entry's length bounds the characters it covers from above.
    """
    longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)
    return longest * (_COMPOSITION if tokenizer.backend.normalizer is not None else 1)


class PromptBuilder:
    """Bounds, renders and tokenizes prompts for one model; owns the worker threads."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = max_chars_per_token(tokenizer)
        self.max_prompt_chars = max_model_len * self.chars_per_token
        self._workers = ThreadPoolExecutor(_WORKERS, thread_name_prefix="lorapage-prompt")

    def check_chars(self, chars: int, where: str) -> None:
        """Refuse ``chars`` characters of prompt that no tokenization could fit in the context."""
        if chars > self.max_prompt_chars:
            raise PromptTooLongError(
                f"The {where} is {chars} characters; this model's maximum context length is "
                f"{self.max_model_len} tokens, which hold at most {self.max_prompt_chars} characters "
                f"({self.chars_per_token} per token at most). Shorten the {where}.",
                param=where,
            )

    def check_chat(self, messages: list[dict[str, str]]) -> None:
        if len(messages) > self.max_model_len:
            raise PromptTooLongError(
                f"{len(messages)} messages cannot fit in this model's maximum context length of "
                f"{self.max_model_len} tokens (each message takes at least one); send fewer messages.",
                param="messages",
            )
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the chat template, tokenized (the template writes BOS itself)."""
        self.check_chat(messages)
        return await self._off_loop(self._chat_ids, messages)

    async def completion(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (BOS added as the tokenizer config says)."""
        if not isinstance(prompt, str):
            return prompt
        self.check_chars(len(prompt), "prompt")
        return await self._off_loop(partial(self.tokenizer.encode, add_special_tokens=True), prompt)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, partial(fn, *args))

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except LorapageError:
            raise
        except Exception as exc:  # jinja errors of third-party templates: the messages do not fit them
            raise InvalidRequestError(
                f"the model's chat template could not render these messages ({type(exc).__name__}: {exc})",
                param="messages",
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)
