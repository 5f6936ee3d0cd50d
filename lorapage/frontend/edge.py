"""Guards at the edge of the server, below HTTP routing: how long a connection may take to send a
request's headers, how many connections one address may hold, and one log line (not a
traceback) for a request aiohttp could not parse.

aiohttp has no header-read timeout of its own, but its keep-alive timer is armed from the moment
a connection opens and re-armed after each answer, and it closes a connection still waiting for
a complete request when it fires. Set to :attr:`EdgeLimits.header_timeout_s`, it bounds both a
slow sender of headers and an idle keep-alive connection (a slow *body* is read inside the
handler, after the tenant's admission, so it holds only that tenant's slots).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from lorapage.frontend.error_json import HttpError, error_payload

log = logging.getLogger("lorapage.server")


@dataclass(frozen=True)
class EdgeLimits:
    """Connection-level bounds (``max_connections_per_ip`` 0: no cap)."""

    header_timeout_s: float = 20.0
    max_connections_per_ip: int = 1024

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0; got {self.header_timeout_s}")
        if self.max_connections_per_ip < 0:
            raise ValueError(f"max_connections_per_ip must be >= 0; got {self.max_connections_per_ip}")


LINGER_S = 2.0  # how long a refused connection's late input is read and dropped before it is closed
EDGE_LIMITS = web.AppKey("lorapage_edge_limits", EdgeLimits)


class ConnectionCap:
    """Open connections per remote address, at most ``limit`` each (0: no cap). Pure counting."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: Counter[str] = Counter()
        self.refused = 0
        self._at_cap: set[str] = set()  # addresses refused since they last dropped below the cap

    def enter(self, address: str) -> bool:
        """Count a new connection from ``address``; False (not counted) when it is at its cap."""
        if self.limit and self.open[address] >= self.limit:
            self.refused += 1
            if address not in self._at_cap:  # one log line per episode, not per refused connection
                self._at_cap.add(address)
                log.warning("refusing connections from %s: it holds %d, the cap", address, self.limit)
            return False
        self.open[address] += 1
        return True

    def leave(self, address: str) -> None:
        self.open[address] -= 1
        self._at_cap.discard(address)
        if self.open[address] <= 0:
            del self.open[address]


def _too_many(limit: int) -> bytes:
    body = error_payload(
        HttpError(429, "too_many_connections", f"this address already holds {limit} connections; reuse or close some")
    )
    head = (
        "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the per-address cap: a connection over the
    cap is answered 429 and closed before aiohttp sees it.

    The refusal half-closes and discards what the client still sends until it closes too (or
    :data:`LINGER_S` passes): closing a socket with unread input resets it, and a reset may
    reach the client before the 429 it was sent."""

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self.inner, self.cap = inner, cap
        self.address: str | None = None  # counted against the cap (None: refused, or not yet)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        if not self.cap.enter(address):
            self._refuse(cast(asyncio.WriteTransport, transport))
            return
        self.address = address
        self.inner.connection_made(transport)

    def _refuse(self, transport: asyncio.WriteTransport) -> None:
        # A stream transport: uvloop's TCPTransport writes like asyncio's but is no subclass of it.
        transport.write(_too_many(self.cap.limit))
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.address is None:
            return
        self.cap.leave(self.address)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.address is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.address is not None else None  # None: the transport closes

    def pause_writing(self) -> None:
        if self.address is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.address is not None:
            self.inner.resume_writing()


class GuardedSite(web.SockSite):
    """``web.SockSite`` whose connections pass a :class:`ConnectionCap` first."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, cap: ConnectionCap) -> None:
        super().__init__(runner, sock)
        self.cap = cap

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: GuardedConnection(server(), self.cap), sock=self._sock, backlog=self._backlog
        )


class OneLineLog(logging.LoggerAdapter):
    """aiohttp's connection log with a request it could not parse (a malformed request line or
    header, a bad Content-Length) as one warning line, and a client that went away mid-answer as
    one info line: anyone can cause those, and a traceback each would fill the log. Anything else
    keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(exc, HttpProcessingError):
            detail = " ".join(str(exc.message or type(exc).__name__).split())[:200]
            self.warning(f"{msg}: malformed request: {exc.code} {detail}", *args)
            return
        if isinstance(exc, ConnectionError):
            self.info(f"{msg}: the client went away: {type(exc).__name__}: {str(exc)[:200]}", *args)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs


def connection_log() -> OneLineLog:
    """The logger to hand aiohttp's request handlers (``AppRunner(logger=...)``)."""
    return OneLineLog(logging.getLogger("aiohttp.server"), {})
