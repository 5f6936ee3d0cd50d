"""OpenAI's Responses API: the answer, whole (a ``response`` object) or as its stream of events.

A stream is what the openai SDK's ``responses.create(stream=True)`` and the Agents SDK parse:
``response.created`` and ``response.in_progress``; for the text, ``response.output_item.added``
(a message), ``response.content_part.added``, ``response.output_text.delta`` as tokens come,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
for each function call, its ``output_item.added``, ``function_call_arguments.delta`` and
``.done``, ``output_item.done``; then ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it). Each SSE frame carries ``event: <type>`` and the JSON event with
its ``sequence_number``; there is no ``[DONE]`` (OpenAI sends none on this route). Text that may
start a tool call is held back while it streams (:class:`~lorapage.tools.ToolStream`), so a
call never leaks as text. A failure after the stream started is a ``response.failed`` event.

:func:`answer_response` is framework-neutral, like :func:`lorapage.frontend.generation.answer`:
both front ends write the :class:`~lorapage.frontend.generation.Answer` it returns.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from lorapage.adapters.names import parse_name
from lorapage.errors import InvalidRequestError, LorapageError, ServiceUnavailableError
from lorapage.frontend.auth import Access
from lorapage.frontend.generation import Answer, Job, Timing, adapter_headers
from lorapage.frontend.responses_api import ResponsesPlan
from lorapage.request import RequestOutput, TokenStream
from lorapage.tools import ToolCall, ToolStream

_encoder = msgspec.json.Encoder()


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str = "completed"  # in_progress | completed | incomplete
    role: str = "assistant"
    type: str = "message"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class ResponseObject(msgspec.Struct):
    """A ``response`` as OpenAI's API returns it (the fields this subset has)."""

    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | failed
    output: list[Any]  # OutputMessage and FunctionCallItem
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    text: Any
    metadata: dict[str, str]
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: None = None
    reasoning: dict[str, None] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    truncation: str = "disabled"
    object: str = "response"


def responses_job(
    plan: ResponsesPlan,
    model: str,
    adapter: str | None,
    tenant: str,
    ids: list[int],
    max_model_len: int,
    arrival: float,
    access: Access,
) -> Job:
    """The :class:`~lorapage.frontend.generation.Job` of a checked, resolved ``/v1/responses``
    request whose rendered input is ``ids``, with what ``access`` lets its tenant share and see
    (as :func:`~lorapage.frontend.generation.make_job` gives a chat request)."""
    if not ids:
        raise InvalidRequestError("the input is empty", param="input")
    sampling = plan.sampling(len(ids), max_model_len)
    job = Job(
        kind="responses",
        model=model,
        adapter=adapter,
        tenant=tenant,
        prompts=[ids],
        sampling=sampling,
        stream=bool(plan.req.stream),
        include_usage=False,
        arrival=arrival,
        request_id=plan.response_id,
    )
    job.prefix_group = access.prefix_group(tenant)
    if adapter is not None:
        adapter_id, job.adapter_version = parse_name(adapter)  # the version this request runs on to its end
        job.show_tier = access.sole_user(tenant, adapter_id)
    return job


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One request's ``response`` objects and events, as its outputs arrive."""

    def __init__(self, job: Job, plan: ResponsesPlan) -> None:
        self.job, self.plan = job, plan
        self.sequence = 0
        self.stream = ToolStream(plan.tool_format, plan.tools) if plan.tool_format is not None else None
        self.message_id = _item_id("msg")
        self.text = ""  # the message's text released so far
        self.open = False  # the message item was announced (streaming)

    def response(
        self, status: str, output: list[Any], out: Any = None, error: LorapageError | None = None
    ) -> ResponseObject:
        req, sampling = self.plan.req, self.job.sampling
        usage = None
        if out is not None:
            p, c = len(out.prompt_token_ids), len(out.token_ids)
            usage = ResponseUsage(input_tokens=p, output_tokens=c, total_tokens=p + c)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return ResponseObject(
            id=self.plan.response_id,
            created_at=self.plan.created_at,
            model=self.job.model,
            status=status,
            output=output,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=sampling.temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            tools=req.tools or [],
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text or {"format": {"type": "text"}},
            metadata=req.metadata or {},
            usage=usage,
            error=None if error is None else {"code": _error_code(error), "message": error.message},
            incomplete_details=incomplete,
            user=req.user,
        )

    def calls(self, calls: list[ToolCall]) -> list[FunctionCallItem]:
        kept = calls if self.plan.req.parallel_tool_calls is not False else calls[:1]
        return [FunctionCallItem(id=_item_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments) for c in kept]

    def whole(self, out: Any) -> ResponseObject:
        """The finished response of the last output ``out``."""
        status = _status(out)
        if self.plan.tool_format is not None:
            content, calls = self.plan.tool_format.parse(out.text, out.finish_reason == "length", self.plan.tools)
        else:
            content, calls = out.text, []
        items: list[Any] = self.calls(calls)
        if content or not items:
            part = OutputText(text=content)
            items.insert(0, OutputMessage(id=self.message_id, content=[part], status=_item_status(status)))
        return self.response(status, items, out)

    # -- streaming ------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE frame: ``event: <kind>`` and the event's JSON with its sequence number."""
        data = _encoder.encode({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self) -> list[bytes]:
        created = self.response("in_progress", [])
        return [self.event("response.created", response=created), self.event("response.in_progress", response=created)]

    def _open_message(self) -> list[bytes]:
        if self.open:
            return []
        self.open = True
        item = OutputMessage(id=self.message_id, content=[], status="in_progress")
        part = OutputText(text="")
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
            ),
        ]

    def _text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        frames = self._open_message()
        self.text += delta
        fields = {"item_id": self.message_id, "output_index": 0, "content_index": 0, "logprobs": []}
        return [*frames, self.event("response.output_text.delta", delta=delta, **fields)]

    def delta(self, out: Any) -> list[bytes]:
        """The frames of what ``out`` adds to the text (a possible tool call held back)."""
        delta = out.delta_text or ""
        return self._text(self.stream.feed(delta) if self.stream is not None else delta)

    def finish(self, out: Any) -> list[bytes]:
        """The closing frames, ending with the finished response."""
        status = _status(out)
        cut = out.finish_reason == "length"
        rest, calls = self.stream.finish(cut) if self.stream is not None else ("", [])
        frames = self._text(rest)
        items: list[Any] = []
        call_items = self.calls(calls)
        if self.open or not call_items:
            frames += self._open_message()
            part = OutputText(text=self.text)
            message = OutputMessage(id=self.message_id, content=[part], status=_item_status(status))
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            frames += [
                self.event("response.output_text.done", text=self.text, logprobs=[], **where),
                self.event("response.content_part.done", part=part, **where),
                self.event("response.output_item.done", output_index=0, item=message),
            ]
            items.append(message)
        for call in call_items:
            index = len(items)
            pending = FunctionCallItem(
                id=call.id, call_id=call.call_id, name=call.name, arguments="", status="in_progress"
            )
            frames += [
                self.event("response.output_item.added", output_index=index, item=pending),
                self.event(
                    "response.function_call_arguments.delta", item_id=call.id, output_index=index, delta=call.arguments
                ),
                self.event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    arguments=call.arguments,
                ),
                self.event("response.output_item.done", output_index=index, item=call),
            ]
            items.append(call)
        final = self.response(status, items, out)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*frames, self.event(kind, response=final)]

    def failed(self, error: LorapageError) -> bytes:
        return self.event("response.failed", response=self.response("failed", [], error=error))


def _status(out: Any) -> str:
    if out.finish_reason == "abort":
        raise ServiceUnavailableError("the request was aborted: the server is shutting down; retry elsewhere")
    return "incomplete" if out.finish_reason == "length" else "completed"


def _item_status(status: str) -> str:
    return "incomplete" if status == "incomplete" else "completed"


def _error_code(error: LorapageError) -> str:
    """The Responses API's error code nearest to a lorapage error."""
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(error.status, "server_error")


async def answer_response(outputs: TokenStream, job: Job, plan: ResponsesPlan, timing: Timing) -> Answer:
    """Await ``outputs``' first item (a refusal raises here, before anything is sent), then the
    whole ``response`` as one JSON body, or its events."""
    builder = ResponseBuilder(job, plan)
    streaming = False
    try:
        out = await anext(outputs)
        timing.observe(out)
        headers = adapter_headers(job, out.adapter_tier)
        if job.stream:
            streaming = True
            return Answer(headers, events=_events(outputs, out, builder, timing))
        while not out.finished:
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        return Answer(headers, body=_encoder.encode(builder.whole(out)))
    finally:
        if not streaming:
            await outputs.aclose()


async def _events(
    outputs: TokenStream, out: RequestOutput, builder: ResponseBuilder, timing: Timing
) -> AsyncGenerator[bytes, None]:
    try:
        for data in builder.start():
            yield data
        while True:
            for data in builder.delta(out):
                yield data
            if out.finished:
                break
            out = await anext(outputs)
            timing.observe(out)
        timing.finish()
        for data in builder.finish(out):
            yield data
    except LorapageError as exc:
        timing.job.stream_error = exc.status
        yield builder.failed(exc)
    finally:
        await outputs.aclose()
