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
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from lorapage.adapters.names import parse_name
from lorapage.errors import LorapageError
from lorapage.frontend.access_log import SENT
from lorapage.frontend.error_json import error_payload
from lorapage.frontend.formatter import Formatter
from lorapage.frontend.job import Job
from lorapage.frontend.metrics import ServerMetrics
from lorapage.frontend.sse import DONE, event_stream, frame
from lorapage.request import PromptProgress, RequestOutput, TokenStream
from lorapage.tenancy.quota import AdmissionRate

if TYPE_CHECKING:
    from lorapage.engine import Engine


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
        self.job.generated += new  # a running sum: 16,384 choices must not cost 16,384 additions per output
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


class Ended:
    """Whether every choice of an answer has had its finished output: counted as outputs come,
    never by scanning the choices (a request may hold 16,384)."""

    def __init__(self, choices: int) -> None:
        self.choices = choices
        self.finished: set[int] = set()

    def saw(self, out: Any) -> bool:
        if out.finished:
            self.finished.add(out.index)
        return len(self.finished) == self.choices


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
        ended = Ended(job.choices)
        while True:
            fmt.gather(out)
            last[out.index] = out
            if ended.saw(out):
                break
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        return Answer(headers, body=await fmt.body([last[i] for i in sorted(last)]))
    finally:
        if not streaming:
            await outputs.aclose()


async def _events(
    outputs: TokenStream, out: RequestOutput, job: Job, fmt: Formatter, timing: Timing
) -> AsyncGenerator[bytes, None]:
    last: dict[int, Any] = {}
    ended = Ended(job.choices)
    try:
        while True:
            for chunk in fmt.deltas(out):
                yield frame(chunk)
            last[out.index] = out
            if ended.saw(out):
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
