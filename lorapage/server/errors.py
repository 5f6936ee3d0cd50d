"""OpenAI's error JSON for every failure: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise :class:`~lorapage.errors.LorapageError` subclasses; :func:`error_middleware`
turns those, aiohttp's own HTTP errors (unknown route, wrong method, body too large) and anything
unexpected into that shape with the right status, so no input yields an HTML page or a bare 500.
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from lorapage.errors import LorapageError

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


class AuthenticationError(LorapageError):
    """No API key, or one that matches no tenant."""

    status = 401
    code = "invalid_api_key"


class PermissionDeniedError(LorapageError):
    """A valid key that may not use this route (a tenant key on an admin route)."""

    status = 403
    code = "permission_denied"


class BodyTooLargeError(LorapageError):
    status = 413
    code = "request_too_large"


class ConflictError(LorapageError):
    """The request clashes with the server's state (an adapter id already taken, a busy adapter)."""

    status = 409
    code = "conflict"


class QuotaExceededError(LorapageError):
    """The tenant's RPM, TPM or concurrency quota is spent. ``retry_after`` is None when waiting
    cannot help (the request alone exceeds the tenant's token burst)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServiceUnavailableError(LorapageError):
    """The server is shutting down or the engine refused work for now; ``retry_after`` seconds."""

    status = 503
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


def error_payload(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    """The JSON bytes of one error, as OpenAI formats it."""
    detail = _ErrorDetail(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)
    return msgspec.json.encode(_ErrorBody(error=detail))


def error_response(exc: LorapageError) -> web.Response:
    """The HTTP response for a refused request, with ``Retry-After`` where waiting helps."""
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is None and exc.status == 503:
        retry_after = 1
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    return web.Response(
        status=exc.status,
        body=error_payload(exc.status, exc.message, exc.code, exc.param),
        content_type="application/json",
        headers=headers,
    )


def _from_http(exc: web.HTTPException) -> LorapageError:
    if exc.status == 413:
        err: LorapageError = BodyTooLargeError(f"request body too large: {exc.text or 'over the limit'}")
    elif exc.status == 404:
        err = LorapageError("no such route; see docs/api.md for the routes lorapage serves")
    elif exc.status == 405:
        err = LorapageError(f"method not allowed; allowed: {', '.join(sorted(getattr(exc, 'allowed_methods', ())))}")
    else:
        err = LorapageError(exc.reason or "request refused")
    err.status = exc.status
    err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, err.code)
    return err


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Map every failure of a handler onto an OpenAI-shaped error response."""
    try:
        return await handler(request)
    except LorapageError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http(exc))
    except (ConnectionResetError, ConnectionAbortedError):
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        err = LorapageError("internal server error; the failure is in the server log")
        err.status, err.code = 500, "internal_error"
        return error_response(err)
