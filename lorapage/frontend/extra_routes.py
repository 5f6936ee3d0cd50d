"""The routes the front end has for clients written against vLLM and OpenAI's newer API.

vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, ``GET /version`` and
``GET|POST /ping``, and OpenAI's ``POST /v1/responses`` (vLLM's LoRA load and unload are admin
routes: :mod:`lorapage.frontend.admin`). What they answer is decided in framework-neutral modules
(:mod:`lorapage.frontend.tokenization`, :mod:`~lorapage.frontend.version`,
:mod:`~lorapage.frontend.responses_api`, :mod:`~lorapage.frontend.responses_output`); this module ties
them to aiohttp and the front end's state (``lorapage serve``'s and the fleet ingress's alike),
with the checks in the order every route keeps: tenant key (401), declared size (413), the
tenant's requests per minute (429), the body, the model's visibility (404), the prompt in the
tenant's turn; a response runs like a chat completion (its tokens against the tenant's TPM, the
engine's queue).
``/version`` and ``/ping`` take no key (vLLM's do not either; ``/health`` does not). The tokenizer
routes answer without a key for the base model's tokenizer alone, key-less callers sharing one
bounded share (:mod:`lorapage.frontend.tokenization` says why that is safe).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from lorapage.frontend import tokenization
from lorapage.frontend.auth import bearer_key
from lorapage.frontend.backend import Backend
from lorapage.frontend.bodies import check_body_length, json_response
from lorapage.frontend.generation import Answer, Job, Timing
from lorapage.frontend.prompts import PromptBuilder
from lorapage.frontend.responses_api import ResponsesPlan, parse_responses
from lorapage.frontend.responses_output import answer_response, responses_job
from lorapage.frontend.state import STATE, ServerState
from lorapage.frontend.version import PING_BODY, version_body
from lorapage.request import TokenStream
from lorapage.tools import ToolFormat

# A tokenizer route's work: (prompts, tenant, body, check_model) -> its answer.
TokenizerWork = Callable[[PromptBuilder, str, bytes, tokenization.ModelCheck], Awaitable[Any]]


async def _tokenizer_info(
    prompts: PromptBuilder, tenant: str, body: bytes, check_model: tokenization.ModelCheck
) -> Any:
    return tokenization.tokenizer_info(prompts)


class ExtraRoutes:
    """Handlers over the front end's state (:data:`~lorapage.frontend.state.STATE`)."""

    def __init__(self) -> None:
        self._tool_format: ToolFormat | None = None
        self.keyless = tokenization.KeylessShare()

    def tool_format(self, state: ServerState[Backend]) -> ToolFormat:
        """The format the model's chat template writes tool calls in (found once)."""
        if self._tool_format is None:
            self._tool_format = state.prompts.tool_format  # --tool-call-parser's, else the template's
        return self._tool_format

    def _admitted(self, request: web.Request) -> tuple[ServerState[Backend], str]:
        """The state and the tenant, once its key is known and its declared body size fits."""
        state = request.app[STATE]
        tenant = state.access.tenant_for(request)
        check_body_length(request.content_length, state.max_body_bytes)
        return state, tenant

    async def _tokenizer_route(self, request: web.Request, work: TokenizerWork) -> web.Response:
        """A tokenizer route's answer: in the tenant's turn and quota with a key, in the key-less
        callers' share (the base's tokenizer only) without one."""
        state = request.app[STATE]
        if bearer_key(request) is None:
            check_body_length(request.content_length, state.max_body_bytes)
            self.keyless.admit()
            try:
                body = await request.read()
                return json_response(
                    await work(state.prompts, tokenization.KEYLESS_TENANT, body, self.keyless.check_model)
                )
            finally:
                self.keyless.release()
        state, tenant = self._admitted(request)
        reservation = state.admit(tenant)
        try:
            body = await request.read()
            return json_response(await work(state.prompts, tenant, body, self._model_check(state, tenant)))
        finally:
            state.release(reservation)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenization.tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, tokenization.detokenize)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return await self._tokenizer_route(request, _tokenizer_info)

    async def version(self, request: web.Request) -> web.Response:
        return web.Response(body=version_body(), content_type="application/json")

    async def ping(self, request: web.Request) -> web.Response:
        """vLLM's (SageMaker's) liveness check: 200 with no body, 503 once shutting down."""
        return web.Response(body=PING_BODY, status=503 if request.app[STATE].closing else 200)

    @staticmethod
    def _model_check(state: ServerState[Backend], tenant: str) -> tokenization.ModelCheck:
        async def route(model: str) -> object:
            return state.route(model, tenant)

        return route

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: checked and run as a chat completion is, answered in the
        Responses API's shapes."""
        arrival = time.monotonic()
        state, tenant = self._admitted(request)
        state.check_open()
        reservation = state.admit(tenant)  # before the body is read: a refusal costs nothing more
        try:
            body = await request.read()
            tokenizer, fmt = state.backend.tokenizer, self.tool_format(state)
            template, system_role = tokenizer.tool_template, tokenizer.takes_system_role
            parsed = await state.prompts.parse(tenant, body, lambda b: parse_responses(b, template, fmt, system_role))
            plan: ResponsesPlan = parsed.req
            state.route(plan.req.model, tenant)  # 404 before the template or the tokenizer runs
            ids = await state.prompts.chat_tokens(tenant, plan.messages, template_kwargs=plan.template_kwargs)
            # Resolved again: the adapter may have been deleted (or re-pointed) while the input was tokenized.
            model, adapter = state.route(plan.req.model, tenant)
            max_len = state.backend.max_model_len
            job = responses_job(plan, model, adapter, tenant, ids, max_len, arrival, state.access)

            async def respond(outputs: TokenStream, job: Job, timing: Timing) -> Answer:
                return await answer_response(outputs, job, plan, timing)

            return await state.run(request, job, reservation, respond)
        finally:
            state.release(reservation)  # already released (with its usage) once it ran: then nothing


def add_extra_routes(app: web.Application) -> None:
    routes = ExtraRoutes()
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/tokenizer_info", routes.tokenizer_info)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/ping", routes.ping)
    app.router.add_post("/ping", routes.ping)
    app.router.add_post("/v1/responses", routes.responses)
