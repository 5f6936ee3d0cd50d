"""A route's JSON body in and out, one way for every route module: a declared length past the
limit refused (413) before anything is read, an admin body read as it streams and cut at its
limit, and a JSON answer."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from lorapage.errors import BodyTooLargeError

# An admin body is a few hundred bytes of JSON (an id, a tenant, a source URI, two digests).
ADMIN_MAX_BODY_BYTES = 64 << 10


def check_body_length(length: int | None, limit: int) -> None:
    """Refuse (413) a body whose declared length is over ``limit``, before reading any of it."""
    if length is not None and length > limit:
        raise BodyTooLargeError(f"request body is {length} bytes; the limit is {limit}")


def body_too_large(limit: int) -> BodyTooLargeError:
    """The 413 for a body that streamed past ``limit`` (no length declared, or a wrong one)."""
    return BodyTooLargeError(f"request body is over the limit of {limit} bytes; reading stopped there")


async def read_admin_body(request: web.Request, limit: int = ADMIN_MAX_BODY_BYTES) -> bytes:
    """An admin route's body, read as it streams and refused (413) once past ``limit``: a body
    without a Content-Length (chunked) is never read whole first."""
    check_body_length(request.content_length, limit)
    chunks, size = [], 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_response(body: Any, status: int = 200) -> web.Response:
    """``body`` (msgspec structs, dicts, lists) as a JSON answer."""
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")
