"""Typed request state and the outputs streamed back to callers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from lorapage.sampling_params import SamplingParams
from lorapage.structured.grammars import Constraint


class Detokenizer(Protocol):
    """Turns a request's generated ids into text as they arrive (``IncrementalDecoder``)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class RequestStatus(Enum):
    WAITING = "waiting"  # queued: adapter loading and / or no capacity yet
    RUNNING = "running"  # has KV pages and a batch row
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + tokens more likely than it (prompt logprobs only)


@dataclass
class PromptProgress:
    """What :meth:`Engine.generate` tells its caller once the generator ends, even when it ended
    before the first token (the caller cut it, or it failed): the prompt tokens whose K/V the
    engine computed for it (or found cached), which a quota charges for."""

    computed: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step. ``token_ids``, ``text`` and ``logprobs`` are cumulative;
    ``delta_text`` is what is new since the previous output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    logprobs: list[TokenLogprob] | None
    # The prompt's tokens' logprobs (the first is None: nothing predicts it), when asked for.
    prompt_logprobs: list[TokenLogprob | None] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    adapter_tier: str  # where the adapter was when the request arrived: gpu | ram | disk | none
    index: int = 0  # which of a request's n sequences (SamplingParams.n)


class OutputChannel:
    """A request's outputs on their way to its reader, coalesced: at most one pending item.

    The engine publishes the request's state after every step; a reader that falls behind skips
    the states in between and reads the latest, whose ``delta_text`` covers all it has not seen.
    The output is built when it is read, from the request's own growing lists, so a slow reader
    costs its own tokens and one pending record, never a backlog of cumulative copies.
    """

    def __init__(self, req: Request) -> None:
        self._req = req
        # Only the last state is read (``Engine.generate(final_only=True)``, vLLM's FINAL_ONLY): the
        # states in between are never published, so the reader wakes once, not once a step.
        self.final_only = False
        self._ready = asyncio.Event()
        self._pending: tuple[int, int, str | None] | BaseException | None = None
        self._read_len = 0  # characters of text the reader has had

    def publish(self, visible_len: int, finish_reason: str | None) -> None:
        """The first ``visible_len`` characters of text may be shown; ``finish_reason`` ends it."""
        if self.final_only and finish_reason is None:
            return
        self._pending = (visible_len, len(self._req.output_ids), finish_reason)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised to the reader instead of an output)."""
        self._pending = error
        self._ready.set()

    def pending(self) -> bool:
        return self._pending is not None

    async def get(self) -> RequestOutput:
        """The latest state; raises the error the request failed with."""
        await self._ready.wait()
        self._ready.clear()
        pending, self._pending = self._pending, None
        if isinstance(pending, BaseException):
            raise pending
        assert pending is not None
        visible, n, reason = pending
        r = self._req
        text = r.text[:visible]
        delta, self._read_len = text[self._read_len :], max(self._read_len, visible)
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_ids,
            token_ids=r.output_ids[:n],
            text=text,
            delta_text=delta,
            logprobs=r.logprobs[:n] if r.logprobs is not None else None,
            prompt_logprobs=r.prompt_logprobs,
            finished=reason is not None,
            finish_reason=reason,
            adapter_tier=r.adapter_tier,
        )


@dataclass(eq=False)
class Request:
    """One generation request as the engine tracks it. Mutated only on the engine's event loop."""

    request_id: str
    tenant: str
    adapter: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    adapter_tier: str
    detokenizer: Detokenizer
    generator: torch.Generator | None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by prefill chunks (sampling.prompt_logprobs)
    text: str = ""
    block_table: list[int] = field(default_factory=list)  # page ids holding this sequence's KV
    num_computed: int = 0  # tokens whose K/V are in the pool
    prompt_computed: int = 0  # prompt tokens whose K/V it has had (the most, across preemptions)
    num_scheduled: int = 0  # tokens the step being planned computes for it (admission sets it)
    lora_slot: int = 0
    finish_reason: str | None = None
    aborted: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    sent_len: int = 0  # characters of text released to the caller (stop-string prefixes held back)
    # Prefix caching: what the K/V depend on besides the tokens (None: this request caches
    # nothing) and the keys of its full blocks as far as they are known.
    cache_namespace: bytes | None = None
    block_keys: list[bytes] = field(default_factory=list)
    # Sampling state made at intake: the tokens min_tokens holds back (EOS unless ignored, the
    # stop token ids), each bad word's token ids, and the structured-output constraint.
    stop_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    constraint: Constraint | None = None
    # A dedicated deployment runs its merged version on the base path (adapter None): its usage
    # is still that version's.
    merged_adapter: str | None = None
    outputs: OutputChannel = field(init=False)

    def __post_init__(self) -> None:
        self.outputs = OutputChannel(self)

    @property
    def usage_adapter(self) -> str:
        """The adapter version its usage is charged to ("" for the base)."""
        return self.merged_adapter or self.adapter or ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without copying the rest."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n) : end - n]


# What crosses the front end's backend seam (lorapage.frontend.backend): one request's outputs,
# each a cumulative snapshot of one choice (``index``: prompt * n + sample), from an engine in
# this process or a fleet replica's stream alike.
TokenStream = AsyncGenerator[RequestOutput, None]
