"""A request's job: what the engine runs and the answer needs of it, checked whole before
anything is built. Its size is its work: prompts x ``n`` sequences (each holds a concurrency
slot of its tenant), prompt tokens, ``max_tokens`` per sequence and the prompt-logprob rows its
answer carries (each charged to its tenant's tokens per minute); an answer whose prompt
logprobs would pass :data:`MAX_PROMPT_LOGPROB_ENTRIES` is refused before the engine sees it.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lorapage.adapters.names import parse_name
from lorapage.errors import InvalidRequestError
from lorapage.frontend import protocol
from lorapage.frontend.auth import Access
from lorapage.frontend.fields import ToolUse
from lorapage.sampling_params import SamplingParams


@dataclass
class Job:
    """A validated request, ready for the engine: one or more prompts (a completions request may
    batch several), each answered ``sampling.n`` times; choice ``i * n + k`` is prompt i's k-th."""

    kind: str  # "chat" | "completion"
    model: str  # the id echoed back (as /v1/models lists it)
    adapter: str | None
    tenant: str
    prompts: list[list[int]]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    arrival: float = field(default_factory=time.monotonic)
    request_id: str = ""  # what the client is told (the body's id, x-request-id); may carry the client's id
    generated: int = 0  # tokens generated so far, all choices (what the quota is charged for)
    prompt_computed: int = 0  # prompt tokens the engine computed, known once it ended (charged when cut early)
    created: int = field(default_factory=lambda: int(time.time()))
    adapter_version: int | None = None  # the immutable version the adapter resolved to, when versioned
    # The engine's id for it: always made here, never the client's, so no tenant can name (and
    # so collide with or refuse) another's request by predicting its id.
    engine_id: str = ""
    prefix_group: str | None = None  # whose cached prompt prefixes it shares (None: its tenant's only)
    show_tier: bool = False  # x-adapter-tier tells where the adapter was (only the tenant uses it)
    echo: bool = False  # completions: the prompt goes before each answer, with its logprobs
    echo_only: bool = False  # echo with max_tokens 0: the one token generated is dropped
    prompt_texts: list[str] = field(default_factory=list)  # each prompt's text, for echo
    tools: ToolUse | None = None  # tools the output may call (parsed from it)
    # reasoning_parser qwen3: whether the prompt opened the <think> block (None: no reasoning parser).
    thinking_open: bool | None = None
    # A chat without max_tokens: its budget is set when it is charged (the tenant's TPM left,
    # at least its default_max_tokens, at most the context left), then reserved whole.
    open_ended: bool = False
    reserve_tokens: int | None = None  # the least an open-ended chat is given (default_max_tokens)
    prompt_logprob_copies: int = 0  # times each prompt's logprob rows appear in the answer
    first_token_at: float | None = None  # time.monotonic() of its first token (the request log's TTFT)
    tier: str = "none"  # where its adapter was when it started (x-adapter-tier's value)
    itl_total_s: float = 0.0  # the inter-token gaps observed, summed (the ITL histogram's observations)
    itl_tokens: int = 0  # tokens those gaps led to: their mean is the request's ITL
    stream_error: int | None = None  # status of the error event that ended a started stream

    @property
    def ttft_s(self) -> float | None:
        """Arrival to first token (None: no token came)."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def mean_itl_s(self) -> float | None:
        """Mean gap between its tokens (None: fewer than two)."""
        return self.itl_total_s / self.itl_tokens if self.itl_tokens else None

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.engine_id = self.engine_id or f"{prefix}-{uuid.uuid4().hex}"
        self.request_id = self.request_id or self.engine_id

    @property
    def prompt(self) -> list[int]:
        return self.prompts[0]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.sampling.n

    def engine_ids(self) -> list[str]:
        """The engine's id of each prompt's request."""
        return [self.engine_id if i == 0 else f"{self.engine_id}-p{i}" for i in range(len(self.prompts))]

    @property
    def prompt_logprob_rows(self) -> int:
        """Prompt-logprob rows its answer carries: each prompt token once per copy (vLLM puts a
        completion's on every choice; an echo with logprobs adds the prompt's to each choice)."""
        return self.prompt_tokens * self.prompt_logprob_copies

    @property
    def prompt_work(self) -> int:
        """What its prompts cost its tenant's tokens per minute: their tokens, and a token per
        prompt-logprob row (each is computed, formatted and sent)."""
        return self.prompt_tokens + self.prompt_logprob_rows

    def logprob_entries(self) -> int:
        """Logprob entries (a token's logprob, or an alternative's) its whole answer may carry:
        the prompt's rows and every choice's generated tokens, each with its alternatives."""
        s = self.sampling
        prompt = self.prompt_logprob_rows * (1 + (s.prompt_logprobs or 0))
        generated = 0 if s.logprobs is None else self.completion_budget() * (1 + s.logprobs)
        return prompt + generated

    def completion_budget(self) -> int:
        """Completion tokens the TPM bucket is charged up front, every choice together."""
        return self.sampling.max_tokens * self.choices

    def set_budget(self, room: int | None) -> None:
        """An open-ended chat's budget, per choice: what its tenant's TPM holds beyond its prompt
        (``room``; None: no TPM), at least the tenant's ``default_max_tokens``, at most the
        context left. Reserved whole, so concurrent open-ended chats cannot together outrun the
        bucket (30 of them once drew 115,615 tokens from a 20,000-token bucket)."""
        if not self.open_ended or room is None:
            return
        least = self.reserve_tokens or 1
        per_choice = min(self.sampling.max_tokens, max(least, room // self.choices))
        s = self.sampling
        self.sampling = dataclasses.replace(s, max_tokens=per_choice, min_tokens=min(s.min_tokens, per_choice))


def make_job(
    kind: str,
    parsed: Any,
    model: str,
    adapter: str | None,
    tenant: str,
    prompts: list[list[int]],
    max_model_len: int,
    arrival: float,
    access: Access,
    request_id: str = "",
    *,
    tools: ToolUse | None = None,
    prompt_texts: list[str] | None = None,
    max_adapter_tokens: int | None = None,
) -> Job:
    """The :class:`Job` of a decoded, checked and resolved request (``parsed``: a
    :class:`~lorapage.frontend.protocol.Parsed`) whose prompts are ``prompts`` (400 when one is empty
    or the completion budget does not fit the context beside the longest), with what ``access``
    lets its tenant share and see; without a ``request_id`` to tell the client it gets a new one
    (the engine's id is always new). ``max_adapter_tokens``: the engine's bound on an adapter's
    max_tokens, which a request that sets none gets as its budget."""
    req = parsed.req
    if not prompts or not all(prompts):
        raise InvalidRequestError("the prompt is empty", param="prompt" if kind == "completion" else "messages")
    structured = parsed.structured
    if tools is not None and tools.constraint is not None:
        if structured is not None:
            raise InvalidRequestError(
                f"tool_choice {req.tool_choice!r} constrains the output: it cannot be combined with {structured.param}",
                param="tool_choice",
            )
        structured = tools.constraint
    # A format whose call marker is a special token ([TOOL_CALLS]) must keep it in the text.
    keep_special = tools is not None and tools.fmt.name == "mistral"
    longest = max(map(len, prompts))
    sampling = protocol.sampling_params(
        req, longest, max_model_len, parsed.logprobs, kind, structured, skip_special_tokens=not keep_special
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    job = Job(kind, model, adapter, tenant, prompts, sampling, bool(req.stream), include_usage, arrival, request_id)
    job.echo = kind == "completion" and bool(req.echo)
    job.echo_only = job.echo and protocol.requested_max_tokens(req, allow_zero=True)[0] == 0
    job.prompt_texts = prompt_texts or []
    job.tools = tools if tools is not None and tools.parse else None
    max_tokens, _ = protocol.requested_max_tokens(req, allow_zero=job.echo)
    if max_tokens is None and adapter is not None and max_adapter_tokens is not None:
        # Chat's default (the rest of the context) would be refused on an adapter: the bound is the default.
        sampling = job.sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, max_adapter_tokens))
    if max_tokens is None and kind == "chat":
        job.open_ended = True
        default = access.default_max_tokens(tenant)
        job.reserve_tokens = min(default, sampling.max_tokens) if default is not None else None
    job.prompt_logprob_copies = _prompt_logprob_copies(kind, req, job)
    check_prompt_logprobs(job, "prompt_logprobs" if req.prompt_logprobs is not None else "echo")
    job.prefix_group = access.prefix_group(tenant)
    if adapter is not None:
        adapter_id, job.adapter_version = parse_name(adapter)  # the version this request runs on to its end
        job.show_tier = access.sole_user(tenant, adapter_id)
    return job


# The most prompt-logprob entries (a token's logprob, or one of its alternatives) one answer may
# hold, every choice together: about 25 MB of JSON. lm-eval's loglikelihood (echo, logprobs 1,
# max_tokens 0) on 32 prompts of 2,048 tokens needs 131,072; prompt_logprobs 20 on one prompt of
# 8,192 tokens, 172,032.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18


def _prompt_logprob_copies(kind: str, req: Any, job: Job) -> int:
    n, copies = job.sampling.n, 0
    if req.prompt_logprobs is not None:
        copies += n if kind == "completion" else 1  # a chat's are on the response, once
    if job.echo and job.sampling.logprobs is not None:
        copies += n
    return copies


def check_prompt_logprobs(job: Job, param: str) -> None:
    """400 when the prompt logprobs ``job``'s answer would carry pass
    :data:`MAX_PROMPT_LOGPROB_ENTRIES`, before the engine computes any of them."""
    if not job.prompt_logprob_copies:
        return
    per_row = 1 + (job.sampling.prompt_logprobs or 0)
    entries = job.prompt_logprob_rows * per_row
    if entries <= MAX_PROMPT_LOGPROB_ENTRIES:
        return
    raise InvalidRequestError(
        f"the prompt logprobs of this request would be {entries:,} entries ({job.prompt_tokens} prompt tokens x "
        f"{job.prompt_logprob_copies} copies (n {job.sampling.n}, echo {'on' if job.echo else 'off'}) x {per_row} "
        f"(each token and {per_row - 1} alternatives)); one answer may hold at most {MAX_PROMPT_LOGPROB_ENTRIES:,}: "
        "send fewer or shorter prompts, a smaller n, or fewer alternatives",
        param=param,
    )
