"""Running one request through the engine and answering it, whole or as a stream.

The engine's first output is awaited before any byte is sent, so every refusal that happens at
submission (queue full, prompt too long, adapter unreadable) is still a proper HTTP error with
its status. After the stream has started, a failure becomes an ``error`` event before
``[DONE]``. Whatever ends the handler (finish, failure, client gone), the engine's generator is
closed, which aborts an unfinished request and frees its pages within one step.

:func:`answer` is the framework-neutral part (an :class:`Answer`: headers and a JSON body, or
SSE frames); :func:`respond` writes it with aiohttp, and the Ray Serve ingress
(``lorapage.fleet``) writes the same answer with Starlette.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from lorapage.adapters.registry import parse_name
from lorapage.errors import InvalidRequestError, LorapageError, ServiceUnavailableError
from lorapage.sampling_params import SamplingParams
from lorapage.server import protocol, responses as r
from lorapage.server.auth import Access
from lorapage.server.error_json import error_payload
from lorapage.server.metrics import ServerMetrics
from lorapage.server.quota import AdmissionRate
from lorapage.server.sse import DONE, EventStream, frame


@dataclass
class Job:
    """A validated request, ready for the engine."""

    kind: str  # "chat" | "completion"
    model: str  # the id echoed back (as /v1/models lists it)
    adapter: str | None
    tenant: str
    prompt: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    arrival: float = field(default_factory=time.monotonic)
    request_id: str = ""  # what the client is told (the body's id, x-request-id); may carry the client's id
    generated: int = 0  # tokens generated so far (what the quota is charged for)
    created: int = field(default_factory=lambda: int(time.time()))
    adapter_version: int | None = None  # the immutable version the adapter resolved to, when versioned
    # The engine's id for it: always made here, never the client's, so no tenant can name (and
    # so collide with or refuse) another's request by predicting its id.
    engine_id: str = ""
    prefix_group: str | None = None  # whose cached prompt prefixes it shares (None: its tenant's only)
    show_tier: bool = False  # x-adapter-tier tells where the adapter was (only the tenant uses it)

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.engine_id = self.engine_id or f"{prefix}-{uuid.uuid4().hex}"
        self.request_id = self.request_id or self.engine_id


def make_job(
    kind: str,
    req: Any,
    model: str,
    adapter: str | None,
    tenant: str,
    ids: list[int],
    max_model_len: int,
    logprobs: int | None,
    arrival: float,
    access: Access,
    request_id: str = "",
) -> Job:
    """The :class:`Job` of a decoded, checked and resolved request whose prompt is ``ids``
    (400 when the prompt is empty or the completion budget does not fit the context), with what
    ``access`` lets its tenant share and see; without a ``request_id`` to tell the client it gets
    a new one (the engine's id is always new)."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt" if kind == "completion" else "messages")
    sampling = protocol.sampling_params(req, len(ids), max_model_len, logprobs, kind)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    job = Job(kind, model, adapter, tenant, ids, sampling, bool(req.stream), include_usage, arrival, request_id)
    job.prefix_group = access.prefix_group(tenant)
    if adapter is not None:
        adapter_id, job.adapter_version = parse_name(adapter)  # the version this request runs on to its end
        job.show_tier = access.sole_user(tenant, adapter_id)
    return job


class Timing:
    """Counts a request's generated tokens (what its quota is charged for) and, given metrics,
    feeds the latency histograms from its outputs."""

    def __init__(self, job: Job, metrics: ServerMetrics | None = None, admissions: AdmissionRate | None = None) -> None:
        self.job, self.metrics, self.admissions = job, metrics, admissions
        self.seen = 0
        self.last = job.arrival
        self.tier = "none"

    def observe(self, out: Any) -> None:
        self.tier = out.adapter_tier or "none"
        now, n = time.monotonic(), len(out.token_ids)
        new = n - self.seen
        if new <= 0:
            return
        self.job.generated = n
        if self.metrics is None or self.admissions is None:
            self.seen, self.last = n, now
            return
        labels = (self.job.tenant, self.tier)
        self.metrics.generation_tokens.labels(self.job.tenant).inc(new)
        if self.seen == 0:
            self.admissions.record(now)
            self.metrics.prompt_tokens.labels(self.job.tenant).inc(len(out.prompt_token_ids))
            self.metrics.ttft.labels(*labels).observe(now - self.last)
        else:
            gap = self.metrics.itl.labels(*labels)
            for _ in range(new):  # tokens that arrived together split the wait evenly
                gap.observe((now - self.last) / new)
        self.seen, self.last = n, now

    def finish(self) -> None:
        if self.metrics is not None:
            self.metrics.e2e.labels(self.job.tenant, self.tier).observe(time.monotonic() - self.job.arrival)


def _usage(out: Any) -> r.Usage:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return r.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _finish_reason(out: Any) -> str:
    if out.finish_reason == "abort":
        raise ServiceUnavailableError("the request was aborted: the server is shutting down; retry elsewhere")
    return out.finish_reason or "stop"


class Formatter:
    """Builds one request's chat or completion bodies, including logprobs, from engine outputs."""

    def __init__(self, job: Job, tokenizer: Any) -> None:
        self.job, self.tokenizer = job, tokenizer
        self.logprobs_sent = 0
        self.text_offset = 0

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, items: list) -> r.ChatLogprobs:
        content = []
        for lp in items:
            tok = self._token(lp.token_id)
            top = [r.TopLogprob(t, v, list(t.encode())) for t, v in ((self._token(i), v) for i, v in lp.top)]
            content.append(r.ChatTokenLogprob(tok, lp.logprob, list(tok.encode()), top))
        return r.ChatLogprobs(content=content)

    def _completion_logprobs(self, items: list) -> r.CompletionLogprobs:
        out = r.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in items:
            tok = self._token(lp.token_id)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._token(i): v for i, v in lp.top})
            out.text_offset.append(self.text_offset)
            self.text_offset += len(tok)
        return out

    def _new_logprobs(self, out: Any) -> Any:
        """Logprobs of the tokens not reported yet (``None`` when there are none)."""
        items = (out.logprobs or [])[self.logprobs_sent :]
        if not items:
            return None
        self.logprobs_sent += len(items)
        return self._chat_logprobs(items) if self.job.kind == "chat" else self._completion_logprobs(items)

    def whole(self, out: Any) -> r.ChatCompletion | r.Completion:
        j, reason, logprobs = self.job, _finish_reason(out), self._new_logprobs(out)
        if j.kind == "chat":
            message = r.AssistantMessage(content=out.text)
            chat = r.ChatChoice(message=message, finish_reason=reason, logprobs=logprobs)
            return r.ChatCompletion(
                id=j.request_id, created=j.created, model=j.model, choices=[chat], usage=_usage(out)
            )
        choice = r.CompletionChoice(text=out.text, finish_reason=reason, logprobs=logprobs)
        return r.Completion(id=j.request_id, created=j.created, model=j.model, choices=[choice], usage=_usage(out))

    def chunk(self, text: str | None, logprobs: Any = None, finish: str | None = None, *, role: bool = False):
        j = self.job
        if j.kind == "chat":
            delta = r.ChatDelta(role="assistant" if role else None, content=text)
            chat = r.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
            return r.ChatCompletionChunk(id=j.request_id, created=j.created, model=j.model, choices=[chat])
        choice = r.CompletionChoice(text=text or "", finish_reason=finish, logprobs=logprobs)
        return r.Completion(id=j.request_id, created=j.created, model=j.model, choices=[choice])

    def delta(self, out: Any):
        """The chunk carrying what ``out`` adds, or ``None`` when it adds nothing to show."""
        logprobs = self._new_logprobs(out)
        if not out.delta_text and logprobs is None:
            return None
        return self.chunk(out.delta_text, logprobs)

    def usage(self, out: Any):
        j = self.job
        kind = r.ChatCompletionChunk if j.kind == "chat" else r.Completion
        return kind(id=j.request_id, created=j.created, model=j.model, choices=[], usage=_usage(out))


SHARED_TIER = "shared"  # x-adapter-tier of an adapter other tenants may use too: where it is would tell of their use


def adapter_headers(job: Job, tier: str) -> dict[str, str]:
    """``x-adapter-id``, ``x-adapter-version``, ``x-adapter-tier`` (the tier only for an adapter
    no other tenant may use; ``none`` for the base) and ``x-request-id``."""
    adapter_id = parse_name(job.adapter)[0] if job.adapter else "none"  # the version goes in its own header
    shown = (tier or "none") if job.adapter is None or job.show_tier else SHARED_TIER
    headers = {"x-adapter-id": adapter_id, "x-adapter-tier": shown, "x-request-id": job.request_id}
    if job.adapter_version is not None:
        headers["x-adapter-version"] = str(job.adapter_version)
    return headers


@dataclass
class Answer:
    """A request's answer, whatever serves it over HTTP: status 200 with ``headers`` and either one
    JSON ``body`` or ``events``, the SSE frames up to and including ``[DONE]``. Closing ``events``
    early (the client went away) closes the engine's generator, which aborts the request."""

    headers: dict[str, str]
    body: bytes | None = None
    events: AsyncGenerator[bytes, None] | None = None


async def answer(outputs: AsyncGenerator[Any, None], job: Job, fmt: Formatter, timing: Timing) -> Answer:
    """Await ``outputs``' first item (a refusal raises here, before anything is sent), then
    answer ``job`` whole or as a stream of SSE frames."""
    streaming = False
    try:
        out = await anext(outputs)
        timing.observe(out)
        headers = adapter_headers(job, out.adapter_tier)
        if job.stream:
            streaming = True
            return Answer(headers, events=_events(outputs, out, job, fmt, timing))
        while not out.finished:
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        return Answer(headers, body=msgspec.json.encode(fmt.whole(out)))
    finally:
        if not streaming:
            await outputs.aclose()


async def _events(
    outputs: AsyncGenerator[Any, None], out: Any, job: Job, fmt: Formatter, timing: Timing
) -> AsyncGenerator[bytes, None]:
    try:
        if job.kind == "chat":
            yield frame(fmt.chunk("", role=True))
        while True:
            if (chunk := fmt.delta(out)) is not None:
                yield frame(chunk)
            if out.finished:
                break
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        yield frame(fmt.chunk(None if job.kind == "chat" else "", finish=_finish_reason(out)))
        if job.include_usage:
            yield frame(fmt.usage(out))
    except LorapageError as exc:
        yield frame(error_payload(exc))
    finally:
        await outputs.aclose()
    yield DONE


async def respond(
    request: web.Request, engine: Any, job: Job, metrics: ServerMetrics, admissions: AdmissionRate
) -> web.StreamResponse:
    """Run ``job`` and answer it: one JSON body, or an SSE stream when the client asked for one.
    Its first output is recorded in ``admissions``."""
    timing = Timing(job, metrics, admissions)
    fmt = Formatter(job, engine.tokenizer)
    outputs = engine.generate(
        job.prompt,
        job.adapter,
        job.sampling,
        tenant=job.tenant,
        request_id=job.engine_id,
        prefix_group=job.prefix_group,
    )
    got = await answer(outputs, job, fmt, timing)
    if got.events is None:
        return web.Response(body=got.body, content_type="application/json", headers=got.headers)
    stream = EventStream(got.headers)
    events = got.events
    try:
        await stream.open(request)
        async for data in events:
            await stream.write(data)
    finally:
        await events.aclose()
    await stream.close()
    return stream.response
