"""Request bodies and error answers of the ingress, as Starlette has them.

The error JSON and the ``Retry-After`` header come from :mod:`lorapage.server.error_json`, as for
the aiohttp server; this module only wraps them in Starlette responses. A body is read as it
streams and refused (413) once past its limit, so one without a Content-Length is never read whole
before it is measured.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.requests import Request
from starlette.responses import Response

from lorapage.errors import LorapageError
from lorapage.server.admin import body_too_large, check_body_length
from lorapage.server.error_json import HttpError, error_headers, error_payload
from lorapage.server.route_hints import not_found_message


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: 413 (BodyTooLargeError) from a declared
    length over it before anything is read, or as soon as the bytes streamed pass it."""
    length = request.headers.get("content-length")
    check_body_length(int(length) if length is not None and length.isdigit() else None, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(exc: LorapageError) -> Response:
    """The HTTP answer for a refused request, with ``Retry-After`` where waiting helps."""
    return Response(
        error_payload(exc), status_code=exc.status, media_type="application/json", headers=error_headers(exc)
    )


def no_route(method: str, path: str, routes: Iterable[tuple[str, str]]) -> Response:
    """The 404 of an unknown route, naming the nearest of the ingress's ``routes`` (as ``lorapage serve``'s does)."""
    return error_response(HttpError(404, "not_found", not_found_message(method, path, routes)))


def method_not_allowed(allowed: str) -> Response:
    response = error_response(HttpError(405, "method_not_allowed", f"method not allowed; allowed: {allowed}"))
    response.headers["Allow"] = allowed
    return response


def internal_error() -> Response:
    return error_response(HttpError(500, "internal_error", "internal server error; the failure is in the ingress log"))
