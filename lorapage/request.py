"""Typed request state and the outputs streamed back to callers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

import torch

from lorapage.model.sampler import TokenLogprob
from lorapage.sampling import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"  # queued: adapter loading and / or no capacity yet
    RUNNING = "running"  # has KV pages and a batch row
    FINISHED = "finished"


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
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    adapter_tier: str  # where the adapter was when the request arrived: gpu | ram | disk | none


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
    outputs: asyncio.Queue
    detokenizer: object
    generator: torch.Generator | None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    block_table: list[int] = field(default_factory=list)  # page ids holding this sequence's KV
    num_computed: int = 0  # tokens whose K/V are in the pool
    lora_slot: int = 0
    finish_reason: str | None = None
    aborted: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    sent_len: int = 0  # characters of text already streamed to the caller

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
