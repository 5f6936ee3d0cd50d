"""Running one request through the engine and answering it, whole or as a stream.

The engine's first output is awaited before any byte is sent, so every refusal that happens at
submission (queue full, prompt too long, adapter unreadable) is still a proper HTTP error with
its status. After the stream has started, a failure becomes an ``error`` event before
``[DONE]``. Whatever ends the handler (finish, failure, client gone), the engine's generator is
closed, which aborts an unfinished request and frees its pages within one step.

:func:`answer` is the part that knows nothing of where the outputs come from (an :class:`Answer`:
headers and a JSON body, or SSE frames); :func:`write_answer` writes it with aiohttp, for
``lorapage serve`` and the fleet's ingress alike (:meth:`lorapage.frontend.app.ServerState.run`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from lorapage.adapters.names import parse_name
from lorapage.errors import InvalidRequestError, LorapageError, ServiceUnavailableError
from lorapage.frontend import protocol, responses as r
from lorapage.frontend.access_log import SENT
from lorapage.frontend.auth import Access
from lorapage.frontend.error_json import error_payload
from lorapage.frontend.fields import ToolUse
from lorapage.frontend.metrics import ServerMetrics
from lorapage.frontend.quota import AdmissionRate
from lorapage.frontend.sse import DONE, event_stream, frame
from lorapage.request import PromptProgress, RequestOutput, TokenStream
from lorapage.sampling_params import SamplingParams
from lorapage.tools.formats import ToolCall
from lorapage.tools.stream import ToolStream

if TYPE_CHECKING:
    from lorapage.engine import Engine


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
    # Tokens of max_tokens taken from the TPM bucket up front when the client set no max_tokens
    # (the tenant's default_max_tokens; the rest is settled when the request ends).
    reserve_tokens: int | None = None
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

    def completion_budget(self) -> int:
        """Completion tokens the TPM bucket is charged up front, every choice together."""
        per_choice = self.sampling.max_tokens if self.reserve_tokens is None else self.reserve_tokens
        return per_choice * self.choices


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
        default = access.default_max_tokens(tenant)
        job.reserve_tokens = min(default, sampling.max_tokens) if default is not None else None
    job.prefix_group = access.prefix_group(tenant)
    if adapter is not None:
        adapter_id, job.adapter_version = parse_name(adapter)  # the version this request runs on to its end
        job.show_tier = access.sole_user(tenant, adapter_id)
    return job


async def chained(streams: list[TokenStream], n: int) -> TokenStream:
    """As :func:`merged`, one stream after another (each prompt starts when the one before ends)."""
    try:
        for i, stream in enumerate(streams):
            async for out in stream:
                yield dataclasses.replace(out, index=i * n + out.index)
    finally:
        for stream in streams:
            await stream.aclose()


async def merged(streams: list[TokenStream], n: int) -> TokenStream:
    """The outputs of several prompts' streams as one, each output's ``index`` made its choice's
    (``prompt * n + index``). A stream's error is raised at once; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: TokenStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as exc:  # raised to the reader
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(streams)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield dataclasses.replace(item, index=i * n + item.index)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # out of the streams before closing them
        for stream in streams:
            await stream.aclose()


class Timing:
    """Counts a request's generated tokens, every choice together (what its quota is charged
    for), and, given metrics, feeds the latency histograms from its outputs."""

    def __init__(self, job: Job, metrics: ServerMetrics | None = None, admissions: AdmissionRate | None = None) -> None:
        self.job, self.metrics, self.admissions = job, metrics, admissions
        self.counts: dict[int, int] = {}  # choice index -> tokens seen
        self.last = job.arrival
        self.tier = "none"

    def observe(self, out: Any) -> None:
        self.tier = self.job.tier = out.adapter_tier or "none"
        now, n = time.monotonic(), len(out.token_ids)
        new = n - self.counts.get(out.index, 0)
        if new <= 0:
            return
        first = not self.counts
        if first:
            # Already set when the fleet's ingress saw the first token in an output it did not pass on.
            self.job.first_token_at = self.job.first_token_at or now
        else:
            self.job.itl_total_s += now - self.last
            self.job.itl_tokens += new
        self.counts[out.index] = n
        self.job.generated = sum(self.counts.values())
        if self.metrics is None or self.admissions is None:
            self.last = now
            return
        labels = (self.job.tenant, self.tier)
        self.metrics.generation_tokens.labels(self.job.tenant).inc(new)
        if first:
            self.admissions.record(now)
            self.metrics.prompt_tokens.labels(self.job.tenant).inc(self.job.prompt_tokens)
            self.metrics.ttft.labels(*labels).observe((self.job.first_token_at or now) - self.job.arrival)
        else:
            gap = self.metrics.itl.labels(*labels)
            for _ in range(new):  # tokens that arrived together split the wait evenly
                gap.observe((now - self.last) / new)
        self.last = now

    def finish(self) -> None:
        if self.metrics is not None:
            self.metrics.e2e.labels(self.job.tenant, self.tier).observe(time.monotonic() - self.job.arrival)


def _finish_reason(out: Any, calls: bool = False) -> str:
    if out.finish_reason == "abort":
        raise ServiceUnavailableError("the request was aborted: the server is shutting down; retry elsewhere")
    if calls:
        return "tool_calls"
    return out.finish_reason or "stop"


@dataclass
class _Choice:
    """One choice's formatting state."""

    logprobs_sent: int = 0
    text_offset: int = 0
    gathered: r.ChatLogprobs | r.CompletionLogprobs | None = None
    tools: ToolStream | None = None
    last: Any = None
    role_sent: bool = False


class Formatter:
    """Builds one request's chat or completion bodies, including logprobs, tool calls and echoed
    prompts, from engine outputs, choice by choice.

    A whole answer's logprobs are formatted as its outputs arrive (:meth:`gather`), a step's
    tokens at a time, not all at the end: 16,000 tokens with 20 alternatives each once held the
    event loop for 1.7 s after the last one."""

    def __init__(self, job: Job, tokenizer: Any) -> None:
        self.job, self.tokenizer = job, tokenizer
        self._choices: dict[int, _Choice] = {}
        self._tokens: dict[int, tuple[str, list[int]]] = {}  # token id -> its text and bytes (at most the vocabulary)

    def choice(self, index: int) -> _Choice:
        c = self._choices.get(index)
        if c is None:
            c = self._choices[index] = _Choice()
            if self.job.tools is not None:
                c.tools = ToolStream(self.job.tools.fmt)
        return c

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        got = self._tokens.get(token_id)
        if got is None:
            text = self.tokenizer.backend.decode([token_id])
            got = self._tokens[token_id] = (text, list(text.encode()))
        return got

    def _chat_logprobs(self, items: list) -> r.ChatLogprobs:
        content = []
        for lp in items:
            tok, tok_bytes = self._token(lp.token_id)
            top = [r.TopLogprob(t, v, b) for (t, b), v in ((self._token(i), v) for i, v in lp.top)]
            content.append(r.ChatTokenLogprob(tok, lp.logprob, tok_bytes, top))
        return r.ChatLogprobs(content=content)

    def _completion_logprobs(self, items: list, c: _Choice) -> r.CompletionLogprobs:
        out = r.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp, token_id in items:
            tok = self._token(token_id)[0]
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append({self._token(i)[0]: v for i, v in lp.top} if lp is not None else None)
            out.text_offset.append(c.text_offset)
            c.text_offset += len(tok)
        return out

    def _new_logprobs(self, out: Any) -> Any:
        """Logprobs of the tokens of choice ``out.index`` not reported yet (``None``: none new)."""
        c = self.choice(out.index)
        items = (out.logprobs or [])[c.logprobs_sent :]
        if self.job.echo_only:
            items = []
        if not items:
            return None
        c.logprobs_sent += len(items)
        if self.job.kind == "chat":
            return self._chat_logprobs(items)
        return self._completion_logprobs([(lp, lp.token_id) for lp in items], c)

    def _echoed_logprobs(self, out: Any) -> r.CompletionLogprobs | None:
        """The prompt's tokens as the start of an echoed answer's logprobs (first: None)."""
        if self.job.sampling.logprobs is None:
            return None
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self._completion_logprobs(list(zip(entries, out.prompt_token_ids)), self.choice(out.index))

    def gather(self, out: Any) -> None:
        """Format the logprobs ``out`` adds to its choice, for :meth:`whole`."""
        c = self.choice(out.index)
        c.last = out
        if self.job.echo and c.gathered is None and c.logprobs_sent == 0:
            c.gathered = self._echoed_logprobs(out)
        new = self._new_logprobs(out)
        if new is None:
            return
        if c.gathered is None:
            c.gathered = new
        elif isinstance(c.gathered, r.ChatLogprobs):
            assert isinstance(new, r.ChatLogprobs)
            c.gathered.content.extend(new.content)
        else:
            assert isinstance(new, r.CompletionLogprobs)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(c.gathered, name).extend(getattr(new, name))

    def _prompt_logprobs(self, out: Any) -> r.PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of a choice's prompt, when asked for."""
        if self.job.sampling.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        result: r.PromptLogprobs = []
        for lp in out.prompt_logprobs:
            if lp is None:
                result.append(None)
                continue
            entry = {i: r.PromptLogprob(v, None, self._token(i)[0]) for i, v in lp.top}
            entry[lp.token_id] = r.PromptLogprob(lp.logprob, lp.rank, self._token(lp.token_id)[0])
            result.append(entry)
        return result

    def _text(self, out: Any) -> str:
        text = "" if self.job.echo_only else out.text
        if self.job.echo:
            text = self.job.prompt_texts[out.index // self.job.sampling.n] + text
        return text

    def whole(self, outs: list[Any]) -> r.ChatCompletion | r.Completion:
        """The whole answer from each choice's last output (in choice order)."""
        j = self.job
        usage = _usage(j, outs)
        if j.kind == "chat":
            choices = []
            for out in outs:
                c = self.choice(out.index)
                calls: list[ToolCall] = []
                content: str | None = out.text
                if j.tools is not None:
                    content, calls = j.tools.fmt.parse(out.text)
                tool_calls = [r.ToolCallOut(t.id, r.FunctionCallOut(t.name, t.arguments)) for t in calls] or None
                message = r.AssistantMessage(content=content if content or not calls else None, tool_calls=tool_calls)
                assert c.gathered is None or isinstance(c.gathered, r.ChatLogprobs)
                choices.append(r.ChatChoice(message, _finish_reason(out, bool(calls)), c.gathered, out.index))
            return r.ChatCompletion(
                id=j.request_id,
                created=j.created,
                model=j.model,
                choices=choices,
                usage=usage,
                prompt_logprobs=self._prompt_logprobs(outs[0]),
            )
        completion_choices = []
        for out in outs:
            c = self.choice(out.index)
            assert c.gathered is None or isinstance(c.gathered, r.CompletionLogprobs)
            reason = "length" if j.echo_only else _finish_reason(out)
            completion_choices.append(
                r.CompletionChoice(self._text(out), reason, c.gathered, out.index, self._prompt_logprobs(out))
            )
        return r.Completion(id=j.request_id, created=j.created, model=j.model, choices=completion_choices, usage=usage)

    def chunk(
        self,
        index: int,
        text: str | None,
        logprobs: Any = None,
        finish: str | None = None,
        *,
        role: bool = False,
        calls: list[ToolCall] | None = None,
    ):
        j = self.job
        if j.kind == "chat":
            deltas = [
                r.ToolCallDelta(k, t.id, r.FunctionCallOut(t.name, t.arguments)) for k, t in enumerate(calls or [])
            ]
            delta = r.ChatDelta(role="assistant" if role else None, content=text, tool_calls=deltas or None)
            chat = r.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs, index=index)
            return r.ChatCompletionChunk(id=j.request_id, created=j.created, model=j.model, choices=[chat])
        choice = r.CompletionChoice(text=text or "", finish_reason=finish, logprobs=logprobs, index=index)
        return r.Completion(id=j.request_id, created=j.created, model=j.model, choices=[choice])

    def deltas(self, out: Any) -> list:
        """The chunks carrying what ``out`` adds to its choice (the role first, in a chat), and,
        when it is the choice's last output, its tool calls and finish."""
        c, j = self.choice(out.index), self.job
        chunks = []
        if j.kind == "chat" and not c.role_sent:
            c.role_sent = True
            chunks.append(self.chunk(out.index, "", role=True))
        text = out.delta_text
        if c.tools is not None:
            text = c.tools.feed(text)
        logprobs = self._new_logprobs(out)
        if text or logprobs is not None:
            chunks.append(self.chunk(out.index, text, logprobs))
        if out.finished:
            calls: list[ToolCall] = []
            if c.tools is not None:
                rest, calls = c.tools.finish()
                if rest:
                    chunks.append(self.chunk(out.index, rest))
                if calls:
                    chunks.append(self.chunk(out.index, None, calls=calls))
            finish = _finish_reason(out, bool(calls))
            chunks.append(self.chunk(out.index, None if j.kind == "chat" else "", finish=finish))
        return chunks

    def usage(self, outs: list[Any]):
        j = self.job
        kind = r.ChatCompletionChunk if j.kind == "chat" else r.Completion
        return kind(id=j.request_id, created=j.created, model=j.model, choices=[], usage=_usage(j, outs))


def _usage(job: Job, outs: list[Any]) -> r.Usage:
    """Each prompt counts once, whatever its ``n``; every choice's tokens count."""
    p = job.prompt_tokens
    c = 0 if job.echo_only else sum(len(o.token_ids) for o in outs)
    return r.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


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


async def answer(outputs: TokenStream, job: Job, fmt: Formatter, timing: Timing) -> Answer:
    """Await ``outputs``' first item (a refusal raises here, before anything is sent), then
    answer ``job`` whole or as a stream of SSE frames, every choice in it."""
    streaming = False
    try:
        out = await anext(outputs)
        timing.observe(out)
        headers = adapter_headers(job, out.adapter_tier)
        if job.stream:
            streaming = True
            return Answer(headers, events=_events(outputs, out, job, fmt, timing))
        last: dict[int, Any] = {}
        while True:
            fmt.gather(out)
            last[out.index] = out
            if len(last) == job.choices and all(o.finished for o in last.values()):
                break
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        return Answer(headers, body=msgspec.json.encode(fmt.whole([last[i] for i in sorted(last)])))
    finally:
        if not streaming:
            await outputs.aclose()


async def _events(
    outputs: TokenStream, out: RequestOutput, job: Job, fmt: Formatter, timing: Timing
) -> AsyncGenerator[bytes, None]:
    last: dict[int, Any] = {}
    try:
        while True:
            for chunk in fmt.deltas(out):
                yield frame(chunk)
            last[out.index] = out
            if len(last) == job.choices and all(o.finished for o in last.values()):
                break
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        if job.include_usage:
            yield frame(fmt.usage(list(last.values())))
    except LorapageError as exc:
        job.stream_error = exc.status
        yield frame(error_payload(exc))
    finally:
        await outputs.aclose()
    yield DONE


def engine_outputs(engine: Engine, job: Job, progress: list[PromptProgress]) -> TokenStream:
    """The outputs of every prompt of ``job`` on an engine in this process, as one stream;
    ``progress`` gets each prompt's computed-token count once its generator ends."""
    streams = []
    for prompt, engine_id in zip(job.prompts, job.engine_ids()):
        progress.append(PromptProgress())
        streams.append(
            engine.generate(
                prompt,
                job.adapter,
                job.sampling,
                tenant=job.tenant,
                request_id=engine_id,
                prefix_group=job.prefix_group,
                progress=progress[-1],
            )
        )
    return merged(streams, job.sampling.n)


async def write_answer(request: web.Request, got: Answer) -> web.StreamResponse:
    """``got`` written with aiohttp: one JSON body, or its events as they come (then closed)."""
    if got.events is None:
        return web.Response(body=got.body, content_type="application/json", headers=got.headers)
    stream = event_stream(got.headers)
    try:
        await stream.prepare(request)
        request[SENT] = stream.status
        async for data in got.events:
            await stream.write(data)
    finally:
        await got.events.aclose()
    await stream.write_eof()
    return stream
