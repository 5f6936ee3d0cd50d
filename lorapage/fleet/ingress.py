"""The fleet's ingress: the OpenAI API of ``lorapage serve`` as a Ray Serve deployment.

Ray Serve's HTTP proxy hands each request to :meth:`FleetIngress.__call__` as a Starlette request.
The checks run in the order and with the shared code of the aiohttp server (``lorapage.server``:
auth, protocol, prompts, quotas, generation): API key (401), body size (413), JSON and fields
(400), model visibility (404), prompt length (400), quota (429). Then the request goes to an engine
replica through a deployment handle whose ``multiplexed_model_id`` is the adapter, so the
deployment's request router (:mod:`lorapage.fleet.request_router`) routes it by adapter affinity.

Quotas are fleet-wide because this deployment runs exactly one replica and holds every tenant's
token buckets (a restart of it refills them, as a restart of ``lorapage serve`` does).

A replica that dies is restarted by Ray. A request it held that had sent nothing to its client
(every whole answer, and a stream before its first token) is sent again, to a live replica, up
to ``request_retries`` times; a stream already under way ends with a retryable ``error`` event
(``unavailable``) before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import msgspec
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lorapage.adapters.registry import parse_name
from lorapage.errors import BodyTooLargeError, LorapageError, QuotaExceededError, ServiceUnavailableError
from lorapage.fleet.config import FleetConfig
from lorapage.fleet.http import error_response, internal_error, method_not_allowed, no_route
from lorapage.fleet.messages import EngineJob, EngineProfile, ReplicaStart
from lorapage.model.tokenizer import Tokenizer
from lorapage.server import protocol
from lorapage.server.auth import Access
from lorapage.server.generation import Formatter, Job, Timing, answer, make_job
from lorapage.server.prompts import PromptBuilder
from lorapage.server.quota import QuotaExceeded, QuotaManager, Reservation
from lorapage.server.responses import Model, ModelList
from lorapage.server.sse import SSE_HEADERS
from lorapage.server.tenants import TenantsConfig

log = logging.getLogger("lorapage.fleet")

REPLICA_HEADER = "x-lorapage-replica"  # which engine replica answered (Ray's replica id)
_RETRY_BACKOFF_S = 0.25  # before resending a request whose replica died (times the attempt)
_RAY_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # Ray's (or the client's) id, if safe to echo


class FleetIngress:
    """Auth, tenants, quotas and the OpenAI protocol in front of the engine replicas."""

    def __init__(self, engines: Any, config: FleetConfig) -> None:
        self.engines = engines  # a DeploymentHandle to the EngineReplica deployment
        self.config = config
        self.access = Access(TenantsConfig.from_toml(config.tenants_toml))
        self.quotas = QuotaManager(self.access.tenants, now=time.monotonic())
        self.adapters = {name for name, _ in config.lora_modules}  # registered on every replica
        self.tokenizer = Tokenizer.from_dir(config.engine.model)
        self.started = int(time.time())
        self._profile: EngineProfile | None = None
        self._prompts: PromptBuilder | None = None
        self._routes = {
            "/v1/chat/completions": ("POST", self.chat_completions),
            "/v1/completions": ("POST", self.completions),
            "/v1/models": ("GET", self.list_models),
            "/health": ("GET", self.health),
        }

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._dispatch(request)
        except LorapageError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.url.path)
            return internal_error()

    async def _dispatch(self, request: Request) -> Response:
        path = request.url.path
        if path.startswith("/v1/models/"):
            method, handler = "GET", self.get_model
        elif path in self._routes:
            method, handler = self._routes[path]
        else:
            return no_route()
        if request.method != method:
            return method_not_allowed(method)
        return await handler(request)

    # -- what the engines are ---------------------------------------------------------------------

    async def profile(self) -> EngineProfile:
        """The engines' base name and context, asked of a replica once (they all run one config)."""
        if self._profile is None:
            self._profile = await self.engines.profile.remote()
        return self._profile

    async def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            self._prompts = PromptBuilder(self.tokenizer, (await self.profile()).max_model_len)
        return self._prompts

    def visible(self, tenant: str, adapter: str) -> bool:
        """``adapter`` (``id`` or ``id@N``; the replica resolves the version) may be used by ``tenant``."""
        adapter_id, _ = parse_name(adapter)
        return adapter_id in self.adapters and self.access.may_use(tenant, adapter_id)

    async def resolve(self, model: str, tenant: str) -> tuple[str, str | None]:
        base = (await self.profile()).base_name
        return protocol.resolve_model(model, base, lambda name: name if self.visible(tenant, name) else None)

    # -- routes -----------------------------------------------------------------------------------

    def tenant(self, request: Request) -> str:
        # Access reads only the request's headers, which Starlette's request has too.
        return self.access.tenant_for(cast(Any, request))

    async def body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BodyTooLargeError(f"request body is {length} bytes; the limit is {limit}")
        body = await request.body()
        if len(body) > limit:
            raise BodyTooLargeError(f"request body is over the limit of {limit} bytes")
        return body

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        tenant = self.tenant(request)
        req = protocol.decode(await self.body(request), protocol.ChatCompletionRequest)
        protocol.check_common(req)
        logprobs = protocol.chat_logprobs(req)
        messages = protocol.chat_messages(req)
        await self.resolve(req.model, tenant)  # 404 before the template runs
        ids = await (await self.prompts()).chat(messages)
        return await self.run(await self._job("chat", request, req, tenant, ids, logprobs, arrival))

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        tenant = self.tenant(request)
        req = protocol.decode(await self.body(request), protocol.CompletionRequest)
        protocol.check_common(req)
        logprobs = protocol.completion_logprobs(req)
        profile = await self.profile()
        prompt = protocol.completion_prompt(req, profile.vocab_size, profile.max_model_len)
        await self.resolve(req.model, tenant)  # 404 before the tokenizer runs
        ids = await (await self.prompts()).completion(prompt)
        return await self.run(await self._job("completion", request, req, tenant, ids, logprobs, arrival))

    async def _job(
        self, kind: str, request: Request, req: Any, tenant: str, ids: list[int], logprobs: int | None, arrival: float
    ) -> Job:
        model, adapter = await self.resolve(req.model, tenant)
        max_len = (await self.profile()).max_model_len
        # Ray's proxy answers with the x-request-id it gave the request (or the client sent): the
        # body's id ends with it, so a client's and Ray's logs name the same request.
        ray_id = request.headers.get("x-request-id", "")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{ray_id}" if _RAY_REQUEST_ID.match(ray_id) else ""
        return make_job(kind, req, model, adapter, tenant, ids, max_len, logprobs, arrival, rid)

    async def _models(self, tenant: str) -> list[Model]:
        profile = await self.profile()
        base, max_len = profile.base_name, profile.max_model_len
        out = [Model(id=base, created=self.started, owned_by="lorapage", root=base, max_model_len=max_len)]
        for name in sorted(a for a in self.adapters if self.visible(tenant, a)):
            out.append(
                Model(id=name, created=self.started, owned_by=tenant, parent=base, root=base, max_model_len=max_len)
            )
        return out

    async def list_models(self, request: Request) -> Response:
        data = await self._models(self.tenant(request))
        return Response(msgspec.json.encode(ModelList(data=data)), media_type="application/json")

    async def get_model(self, request: Request) -> Response:
        tenant = self.tenant(request)
        model, _ = await self.resolve(request.url.path.removeprefix("/v1/models/"), tenant)
        found = next(m for m in await self._models(tenant) if m.id == model)
        return Response(msgspec.json.encode(found), media_type="application/json")

    async def health(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    # -- running a request on the engines ---------------------------------------------------------

    def reserve(self, job: Job) -> Reservation:
        got = self.quotas.check_and_reserve(job.tenant, len(job.prompt), job.sampling.max_tokens, time.monotonic())
        if isinstance(got, QuotaExceeded):
            raise QuotaExceededError(got.message, retry_after=got.retry_after_s)
        return got

    def release(self, job: Job, reservation: Reservation) -> None:
        # Refund everything when nothing was generated (refused, or cut before a token).
        used = len(job.prompt) + job.generated if job.generated else 0
        self.quotas.release(reservation, used, time.monotonic())

    async def run(self, job: Job) -> Response:
        reservation = self.reserve(job)
        served: list[str] = []  # the replica that took it (the last, after a retry)
        try:
            got = await answer(self.outputs(job, served), job, Formatter(job, self.tokenizer), Timing(job))
        except BaseException:
            self.release(job, reservation)
            raise
        # x-request-id is the proxy's to write (it always does); a second one would be ambiguous.
        headers = {k: v for k, v in got.headers.items() if k != "x-request-id"}
        headers[REPLICA_HEADER] = served[-1] if served else "none"
        if got.events is None:
            self.release(job, reservation)
            return Response(got.body, media_type="application/json", headers=headers)
        return StreamingResponse(
            self._stream(got.events, job, reservation), headers={**SSE_HEADERS, **headers}, media_type=None
        )

    async def _stream(
        self, events: AsyncGenerator[bytes, None], job: Job, reservation: Reservation
    ) -> AsyncGenerator[bytes, None]:
        try:
            async for data in events:
                yield data
        finally:
            await events.aclose()
            self.release(job, reservation)

    async def outputs(self, job: Job, served: list[str]) -> AsyncGenerator[Any, None]:
        """The engine outputs of ``job`` from a replica the router picks; resent while nothing of it
        has been passed on. A whole answer passes on only its last output, so it can always be resent."""
        spec = EngineJob(job.prompt, job.adapter, job.sampling, job.tenant, job.request_id)
        handle = self.engines.options(stream=True, multiplexed_model_id=job.adapter or "")
        for attempt in range(self.config.request_retries + 1):
            passed_on = False
            stream = handle.generate.remote(spec)
            try:
                async for item in stream:
                    if isinstance(item, ReplicaStart):
                        served.append(item.replica_id)
                        job.adapter_version = item.adapter_version
                    elif isinstance(item, LorapageError):
                        raise item
                    elif job.stream or item.finished:
                        passed_on = True
                        yield item
                return
            except RayActorError:
                if passed_on:
                    raise ServiceUnavailableError(
                        "the engine replica serving this request stopped mid-answer; send the request again",
                        retry_after=1,
                    ) from None
                log.warning("replica %s died before answering %s; resending", served[-1:], job.request_id)
            finally:
                stream.cancel()
            await asyncio.sleep(_RETRY_BACKOFF_S * (attempt + 1))
        raise ServiceUnavailableError(
            f"no engine replica could answer after {self.config.request_retries + 1} attempts; retry later",
            retry_after=5,
        )
