"""OpenAI response bodies (completions, chat, their stream chunks, models) as msgspec structs."""

from __future__ import annotations

import msgspec

from lorapage.adapters.cost import AdapterCost
from lorapage.registry.store import TrafficRow
from lorapage.usage.report import hour_iso


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    adapter_version: int | None = None  # the adapter version that served it (absent for the base)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]
    refusal: None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ToolCallDelta(msgspec.Struct):
    """One call in a stream: sent whole, once (clients accumulate ``arguments`` either way)."""

    index: int
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class ReasoningMessage(AssistantMessage):
    """An answer under a reasoning parser: vLLM's ``reasoning_content`` beside the content."""

    reasoning_content: str | None = None


class PromptLogprob(msgspec.Struct):
    """vLLM's ``prompt_logprobs`` entry for one token (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatChoice(msgspec.Struct):
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    index: int = 0


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when asked for


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # under a reasoning parser (vLLM's field)
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    index: int = 0


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for the first token of an echoed prompt
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    index: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when asked for


class Completion(msgspec.Struct):
    """A whole completion, and also the shape of each streamed completion chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: None = None


class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    parent: str | None = None
    root: str | None = None
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"


class AdapterVersionOut(msgspec.Struct):
    """One immutable version of an adapter id (``GET /v1/adapters/{id}/versions``)."""

    id: str  # id@version
    adapter_id: str
    version: int
    digest: str
    source: str
    base_digest: str
    created: float
    current: bool
    servable: bool  # False: validated against another base than the one this server runs
    in_flight: int
    projected_cost_pct: float | None = None  # as stored at registration (None: never costed on this base)
    object: str = "adapter.version"


class AdapterCostOut(msgspec.Struct):
    """How an adapter's projected cost was computed (docs/capacity.md has the formula)."""

    reference_batch: int  # rows, each on its own adapter
    decode_bytes_pct: float  # extra decode bytes per token at that batch, % of the base's: projected_cost_pct
    flops_pct: float  # extra FLOPs per token, % of the base's (any batch)
    adapter_bytes: int  # read once per step by each batch holding the adapter
    base_bytes: int  # read once per step by every batch
    adapter_params: int
    base_params: int

    @classmethod
    def of(cls, cost: AdapterCost) -> AdapterCostOut:
        return cls(
            reference_batch=cost.reference_batch,
            decode_bytes_pct=cost.projected_cost_pct,
            flops_pct=cost.flops_pct,
            adapter_bytes=cost.adapter_bytes,
            base_bytes=cost.base_bytes,
            adapter_params=cost.adapter_params,
            base_params=cost.base_params,
        )


class TrafficHourOut(msgspec.Struct):
    """One hour of a version's traffic."""

    hour: str  # the hour's start, UTC ISO: 2026-12-03T12:00:00Z
    requests: int
    prompt_tokens: int
    output_tokens: int


TRAFFIC_HOURS = 24  # GET /v1/adapters/{id} shows this many hours of traffic (the one in progress included)


class TrafficOut(msgspec.Struct):
    """A version's recent traffic: its hourly rows of the last 24 hours (the hour in progress and
    the 23 before; hours without requests left out), oldest first, and their totals."""

    last_24h: TrafficHourOut  # its `hour`: the first hour counted
    hours: list[TrafficHourOut]

    @classmethod
    def of(cls, rows: list[TrafficRow], first_hour: int) -> TrafficOut:
        """From one version's rows (hours since the epoch), counted from ``first_hour``."""
        hours = [
            TrafficHourOut(hour_iso(r.hour), r.requests, r.prompt_tokens, r.output_tokens)
            for r in sorted(rows, key=lambda r: r.hour)
            if r.hour >= first_hour
        ]
        total = TrafficHourOut(
            hour_iso(first_hour),
            sum(h.requests for h in hours),
            sum(h.prompt_tokens for h in hours),
            sum(h.output_tokens for h in hours),
        )
        return cls(last_24h=total, hours=hours)


class PromotionOut(msgspec.Struct):
    """An adapter's dedicated deployment (its weights merged into the base) as ``GET
    /v1/adapters/{id}`` shows it: a fleet's Serve application, or a merged engine in ``lorapage serve``."""

    state: str  # starting | merged | failed | stopping
    version: int  # the version merged
    deployment: str  # the Serve application's name (a fleet), or "in-process" (lorapage serve)
    since: int  # Unix seconds, when it entered this state
    actor: str  # who asked (an admin key's id, or "auto-promotion")
    replicas: list[str] = msgspec.field(default_factory=list)  # its replicas' ids, once checked (a fleet)
    check: dict | None = None  # the equivalence check's numbers (MergeCheck.as_json)
    reason: str | None = None  # why it failed


class AdapterOut(msgspec.Struct):
    """An adapter as the admin routes describe it."""

    id: str
    owner: str | None
    parent: str
    path: str
    rank: int
    target_modules: list[str]
    size_bytes: int
    num_params: int
    tier: str
    in_flight: int
    version: int = 0  # the version described (id@version); requests naming the id get `current`
    current: int | None = None
    digest: str = ""  # sha256 content digest of the version
    source: str = ""
    base_digest: str = ""
    versions: list[int] = msgspec.field(default_factory=list)
    pinned: bool = False  # pinned resident by an admin (PUT /v1/adapters/{id}/pin)
    # Extra decode bytes per token at the reference batch, % of the base's; its arithmetic in `cost`.
    projected_cost_pct: float | None = None
    cost: AdapterCostOut | None = None
    serving_tier: str = "shared"  # shared | dedicated, from its shape and the serving envelope
    # From its hourly traffic (docs/capacity.md): cold | warm | hot, or merged while its dedicated
    # deployment serves it; never declared. None (and the next two): not judged where this answer comes from.
    traffic_tier: str | None = None
    kept_hot: bool | None = None  # kept resident for being hot (within the pins' bounds)
    status: str | None = None  # resident | loading | failed | available | draining
    traffic: TrafficOut | None = None  # GET /v1/adapters/{id} only
    dedicated: PromotionOut | None = None  # its dedicated merged deployment (POST .../promote), if any
    object: str = "adapter"
