"""OpenAI's error JSON for every failure: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise :class:`~lorapage.errors.LorapageError` subclasses; :func:`error_middleware`
turns those, aiohttp's own HTTP errors (unknown route, wrong method, body too large) and anything
unexpected into that shape with the right status, so no input yields an HTML page or a bare 500.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from lorapage.errors import BodyTooLargeError, LorapageError
from lorapage.frontend.route_hints import not_found_message

log = logging.getLogger("lorapage.server")

# HTTP status -> OpenAI's error "type".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
_DEFAULT_RETRY_AFTER_S = 1  # a 503 without a better estimate


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return _TYPES.get(status, "server_error")


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


class HttpError(LorapageError):
    """A refusal aiohttp (or an unexpected exception) produced, with its own status and code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_payload(exc: LorapageError) -> bytes:
    """The JSON bytes of one error, as OpenAI formats it."""
    detail = _ErrorDetail(message=exc.message, type=error_type(exc.status), param=exc.param, code=exc.code)
    return msgspec.json.encode(_ErrorBody(error=detail))


def error_headers(exc: LorapageError) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) where waiting helps: the error's own estimate,
    or a default for a 503 without one."""
    retry_after = exc.retry_after
    if retry_after is None and exc.status == 503:
        retry_after = _DEFAULT_RETRY_AFTER_S
    return {} if retry_after is None else {"Retry-After": str(max(1, int(retry_after + 0.999)))}


def error_response(exc: LorapageError) -> web.Response:
    """The HTTP response for a refused request, with ``Retry-After`` where waiting helps."""
    return web.Response(
        status=exc.status, body=error_payload(exc), content_type="application/json", headers=error_headers(exc)
    )


def app_routes(app: web.Application) -> list[tuple[str, str]]:
    """``(method, pattern)`` of every route ``app`` serves (HEAD, which aiohttp adds to GET, left out)."""
    return [
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    ]


def _from_http(request: web.Request, exc: web.HTTPException) -> LorapageError:
    if exc.status == 413:
        return BodyTooLargeError(f"request body too large: {exc.text or 'over the limit'}")
    if exc.status == 404:
        return HttpError(404, "not_found", not_found_message(request.method, request.path, app_routes(request.app)))
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ())))
        return HttpError(405, "method_not_allowed", f"method not allowed; allowed: {allowed}")
    return HttpError(exc.status, LorapageError.code, exc.reason or "request refused")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def log_refusal(method: str, path: str, remote: str | None, exc: LorapageError) -> None:
    """One line per refused request, no traceback: anyone can send bad requests, and a
    traceback each would bury the log (unexpected exceptions keep theirs)."""
    detail = " ".join(exc.message.split())[:200]
    log.info("refused %s %s from %s: %d %s: %s", method, path[:200], remote or "-", exc.status, exc.code, detail)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map every failure of a handler onto an OpenAI-shaped error response (a refusal logged in one line)."""
    try:
        return await handler(request)
    except LorapageError as exc:
        log_refusal(request.method, request.path, request.remote, exc)
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        refusal = _from_http(request, exc)
        log_refusal(request.method, request.path, request.remote, refusal)
        return error_response(refusal)
    except (ConnectionResetError, ConnectionAbortedError):
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return error_response(
            HttpError(500, "internal_error", "internal server error; the failure is in the server log")
        )
