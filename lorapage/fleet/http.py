"""Error answers of the ingress as Starlette responses, in the OpenAI error JSON the server writes.

The JSON and the ``Retry-After`` header come from :mod:`lorapage.server.error_json`, as for the
aiohttp server; this module only wraps them in Starlette responses.
"""

from __future__ import annotations

from starlette.responses import Response

from lorapage.errors import LorapageError
from lorapage.server.error_json import HttpError, error_headers, error_payload


def error_response(exc: LorapageError) -> Response:
    """The HTTP answer for a refused request, with ``Retry-After`` where waiting helps."""
    return Response(
        error_payload(exc), status_code=exc.status, media_type="application/json", headers=error_headers(exc)
    )


def no_route() -> Response:
    return error_response(HttpError(404, "not_found", "no such route; see docs/api.md for the routes lorapage serves"))


def method_not_allowed(allowed: str) -> Response:
    response = error_response(HttpError(405, "method_not_allowed", f"method not allowed; allowed: {allowed}"))
    response.headers["Allow"] = allowed
    return response


def internal_error() -> Response:
    return error_response(HttpError(500, "internal_error", "internal server error; the failure is in the ingress log"))
