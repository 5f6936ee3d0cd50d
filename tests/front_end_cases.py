"""HTTP cases both front ends must answer alike: ``lorapage serve`` (tests/server) and the fleet's
ingress (tests/fleet). Each case is one request and what it must get: a status and, for an
error, OpenAI's error JSON with the same ``type``, ``code`` and ``param`` (messages may differ in
wording, not in kind). Both front ends run the harness's tenants (server_harness.TENANTS_TOML)
with the tiny base and the demo adapters.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from server_harness import ADMIN_KEY, BASE, KEYS, OPENAI_ERROR_TYPES, TENANTS_TOML

from lorapage.frontend.app import STATE

ALPHA, BETA, ADMIN = KEYS["alpha"], KEYS["beta"], ADMIN_KEY


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    status: int
    key: str | None = ALPHA
    body: Any = None  # bytes sent as they are; anything else as JSON; None: no body
    code: str | None = None  # the error's code, when the status is an error
    param: str | None = None  # the error's param, when it names one


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": BASE, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}


CASES: tuple[Case, ...] = (
    Case("health", "GET", "/health", 200, key=None),
    Case("models without a key", "GET", "/v1/models", 401, key=None, code="invalid_api_key"),
    Case("models with a wrong key", "GET", "/v1/models", 401, key="not-a-key", code="invalid_api_key"),
    Case("models", "GET", "/v1/models", 200),
    Case("one model", "GET", f"/v1/models/{BASE}", 200),
    Case("another tenant's adapter is not there", "GET", "/v1/models/initech", 404, code="model_not_found"),
    Case("completion", "POST", "/v1/completions", 200, body=_completion()),
    Case("completion on an adapter", "POST", "/v1/completions", 200, body=_completion(model="acme")),
    Case(
        "chat",
        "POST",
        "/v1/chat/completions",
        200,
        body={"model": BASE, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    ),  # fmt: skip
    Case("not JSON", "POST", "/v1/completions", 400, body=b"{not json", code="invalid_request"),
    Case("JSON, not an object", "POST", "/v1/completions", 400, body=[1, 2], code="invalid_request"),
    Case("unknown model", "POST", "/v1/completions", 404, body=_completion(model="nope"), code="model_not_found"),
    Case(
        "another tenant's adapter",
        "POST",
        "/v1/completions",
        404,
        body=_completion(model="initech"),
        code="model_not_found",
    ),  # fmt: skip
    Case(
        "a field out of range",
        "POST",
        "/v1/completions",
        400,
        body=_completion(max_tokens=-1),
        code="invalid_request",
        param="max_tokens",
    ),  # fmt: skip
    Case(
        "a field of the wrong type",
        "POST",
        "/v1/completions",
        400,
        body=_completion(temperature="hot"),
        code="invalid_request",
        param="temperature",
    ),  # fmt: skip
    Case(
        "chat without messages",
        "POST",
        "/v1/chat/completions",
        400,
        body={"model": BASE},
        code="invalid_request",
        param="messages",
    ),  # fmt: skip
    Case("a wrong method", "GET", "/v1/completions", 405, code="method_not_allowed"),
    Case("no such route", "GET", "/v1/nothing-here", 404, code="not_found"),
    Case("tokenize", "POST", "/tokenize", 200, body={"model": BASE, "prompt": "Hello"}),
    Case("version", "GET", "/version", 200, key=None),
    Case("audit needs the admin key", "GET", "/v1/audit", 403, code="permission_denied"),
    Case(
        "an adapter the admin does not have", "GET", "/v1/adapters/nope", 404, key=ADMIN, code="model_not_found"
    ),  # fmt: skip
    # Another tenant's adapter is not there for it (a 404, as for one nobody has: no existence leak).
    Case("a tenant reads another's adapter", "GET", "/v1/adapters/initech", 404, code="model_not_found"),
    # Cases the two front ends once answered apart (Ray's proxy and a hand-kept router in the fleet).
    Case("a stream", "POST", "/v1/completions", 200, body=_completion(stream=True)),
    Case(
        "a version that does not exist",
        "POST",
        "/v1/completions",
        404,
        body=_completion(model="acme@99"),
        code="model_not_found",
    ),  # fmt: skip
    Case("an adapter's model card", "GET", "/v1/models/acme", 200),
    Case("responses", "POST", "/v1/responses", 200, body={"model": BASE, "input": "Hi", "max_output_tokens": 4}),
    Case("detokenize", "POST", "/detokenize", 200, body={"model": BASE, "tokens": [72, 105]}),
    Case("tokenizer info", "GET", "/tokenizer_info", 200),
    # Without a key the base's tokenizer answers (lm-eval's probe); naming a model takes a key.
    Case("tokenizer info without a key", "GET", "/tokenizer_info", 200, key=None),
    Case("tokenize without a key", "POST", "/tokenize", 200, key=None, body={"prompt": "Hi"}),
    Case(
        "tokenize naming a model",
        "POST",
        "/tokenize",
        401,
        key=None,
        body={"model": "acme", "prompt": "Hi"},
        code="invalid_api_key",
    ),
    Case("ping", "GET", "/ping", 200, key=None),
    Case("ping by POST", "POST", "/ping", 200, key=None),
    Case("metrics need a key", "GET", "/metrics", 401, key=None, code="invalid_api_key"),
    Case("metrics with a tenant key", "GET", "/metrics", 403, code="permission_denied"),
    Case("metrics with the admin key", "GET", "/metrics", 200, key=ADMIN),
    Case("usage", "GET", "/v1/usage", 200),
    Case("usage of another tenant", "GET", "/v1/usage?tenant=beta", 403, code="permission_denied", param="tenant"),
    Case("a wrong method on a route with a parameter", "POST", "/v1/models/acme", 405, code="method_not_allowed"),
    Case("no such route under one that exists", "GET", "/v1/models/acme/nothing", 404, code="not_found"),
    Case("an admin route's wrong method", "PATCH", "/v1/adapters", 405, key=ADMIN, code="method_not_allowed"),
    Case("admin list needs the admin key", "GET", "/v1/adapters", 403, code="permission_denied"),
    Case("admin list", "GET", "/v1/adapters", 200, key=ADMIN),
    Case("an adapter, to the admin", "GET", "/v1/adapters/acme", 200, key=ADMIN),
    Case("an adapter's versions", "GET", "/v1/adapters/acme/versions", 200, key=ADMIN),
    Case("a version's versions", "GET", "/v1/adapters/acme@1/versions", 404, key=ADMIN, code="model_not_found"),
    Case("internal state", "GET", "/internal/state", 200, key=ADMIN),
    Case("internal state needs the admin key", "GET", "/internal/state", 403, code="permission_denied"),
    Case(
        "a deploy to a version that does not exist",
        "PUT",
        "/v1/adapters/acme/current",
        404,
        key=ADMIN,
        body={"version": 99},
        code="model_not_found",
    ),  # fmt: skip
    Case(
        "a deploy without a body", "PUT", "/v1/adapters/acme/current", 400, key=ADMIN, body=b"", code="invalid_request"
    ),  # fmt: skip
    Case(
        "register without a source", "POST", "/v1/adapters", 400, key=ADMIN, body={"id": "x"}, code="invalid_request"
    ),  # fmt: skip
    Case("audit", "GET", "/v1/audit?limit=1", 200, key=ADMIN),
    Case("audit with an unknown filter", "GET", "/v1/audit?who=me", 400, key=ADMIN, code="invalid_request"),
)


@dataclass(frozen=True)
class Answer:
    status: int
    code: str | None  # the error's code (None for a success)
    param: str | None


async def ask(session: aiohttp.ClientSession, url: str, case: Case) -> Answer:
    """Send ``case`` to the front end at ``url``; check the error JSON's shape on the way."""
    headers = {"Authorization": f"Bearer {case.key}"} if case.key else {}
    data = None
    if case.body is not None:
        data = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        headers["Content-Type"] = "application/json"
    async with session.request(case.method, url + case.path, data=data, headers=headers) as resp:
        text = await resp.text()
    if resp.status < 400:
        return Answer(resp.status, None, None)
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (case.name, body)
    error = body["error"]
    assert error["type"] == OPENAI_ERROR_TYPES[resp.status] and error["message"], (case.name, error)
    return Answer(resp.status, error["code"], error["param"])


async def answers(url: str) -> dict[str, Answer]:
    """Every case's answer from the front end at ``url``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return {case.name: await ask(session, url, case) for case in CASES}


def expected() -> dict[str, Answer]:
    return {c.name: Answer(c.status, c.code, c.param if c.code else None) for c in CASES}


def mismatches(got: dict[str, Answer]) -> dict[str, tuple[Answer, Answer]]:
    """Cases whose answer differs from the table (a param is compared only where a case names one)."""
    out = {}
    for name, want in expected().items():
        have = got[name]
        have = Answer(have.status, have.code, have.param if want.param is not None else None)
        if have != want:
            out[name] = (want, have)
    return out


def replica_less_ingress(max_body_bytes: int | None = None) -> Any:
    """The fleet's real ingress, set up as its constructor sets it up but with no engine replicas
    behind it (the constructor would ask them what they run first): its aiohttp app is ``.app``.
    Only what reaches no replica can be asked of it."""
    from lorapage import EngineConfig
    from lorapage.fleet.bases import FleetBases
    from lorapage.fleet.config import DEFAULT_MAX_BODY_BYTES, FleetConfig
    from lorapage.fleet.ingress import FleetIngress
    from lorapage.fleet.messages import EngineProfile
    from lorapage.tiny import TINY_BASE_DIR

    config = FleetConfig(
        engine=EngineConfig(model=str(TINY_BASE_DIR)),
        tenants_toml=TENANTS_TOML,
        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
    )
    ingress = FleetIngress.__new__(FleetIngress)
    ingress.setup(None, config, FleetBases([None]), EngineProfile(BASE, 256, 512, "0" * 64))
    return ingress


async def while_closing(app: web.Application, url: str) -> dict[str, int]:
    """The status of ``/health`` and ``/ping`` at ``url`` while ``app`` (serving there) shuts down
    with a request still in flight, and once it is no more: ``{"health", "ping", "health after"}``."""
    state = app[STATE]
    state.request_ids.add("held")  # what a request in flight holds (the drain waits for it)
    state.idle.clear()
    draining = asyncio.ensure_future(app.shutdown())  # the listener stays open: the runner closes it after
    got: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            for _ in range(100):
                await asyncio.sleep(0.01)
                if state.closing:
                    break
            for name, path in (("health", "/health"), ("ping", "/ping")):
                async with session.get(url + path) as resp:
                    got[name] = resp.status
            state.request_ids.discard("held")
            state.idle.set()  # the request ends: the drain finishes
            await asyncio.wait_for(draining, 30)
            async with session.get(url + "/health") as resp:
                got["health after"] = resp.status
    finally:
        draining.cancel()
    return got
