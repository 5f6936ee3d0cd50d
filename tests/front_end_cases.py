"""HTTP cases both front ends must answer alike: ``lorapage serve`` (tests/server) and the fleet's
ingress (tests/fleet). Each case is one request and what it must get: a status and, for an
error, OpenAI's error JSON with the same ``type``, ``code`` and ``param`` (messages may differ in
wording, not in kind). Both front ends run the harness's tenants (server_harness.TENANTS_TOML)
with the tiny base and the demo adapters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
from server_harness import ADMIN_KEY, BASE, KEYS, OPENAI_ERROR_TYPES

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
