"""Starting and stopping a server: listen, serve until SIGTERM / SIGINT, shut down gracefully."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from lorapage.frontend.edge import EDGE_LIMITS, ConnectionCap, EdgeLimits, GuardedSite, connection_log


class Closes(Protocol):
    """What serves the requests behind the app (an engine, or ``lorapage serve``'s engines)."""

    async def close(self) -> None: ...


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: an ephemeral port), not yet accepting; raises OSError
    (a busy port, an address not on this machine) before anything else has started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def start(app: web.Application, sock: socket.socket | tuple[str, int]) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``sock`` (or on a new socket bound to ``(host, port)``) and return the
    runner and the bound port.

    Handlers are cancelled when their client disconnects, which aborts the engine request and
    frees its pages without waiting for the next write to fail. The app's :class:`EdgeLimits`
    bound how long a connection may take to send its headers and how many one address may hold.
    """
    if isinstance(sock, tuple):
        sock = listen(*sock)
    limits = app.get(EDGE_LIMITS) or EdgeLimits()
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=5.0,
        access_log=None,
        keepalive_timeout=limits.header_timeout_s,  # armed at connect and after each answer (see edge.py)
        logger=connection_log(),
    )
    await runner.setup()
    site = GuardedSite(runner, sock, ConnectionCap(limits.max_connections_per_ip))
    await site.start()
    return runner, sock.getsockname()[1]


async def serve_until_signal(
    app: web.Application,
    engine: Closes,
    sock: socket.socket,
    on_ready: Callable[[int], None],
    on_reload: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting, let running requests finish (or abort
    them after the grace period), and close the engine (every engine of
    ``lorapage serve``'s :class:`~lorapage.serve.engines.Engines`).
    SIGHUP calls ``on_reload``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_reload is not None:
        loop.add_signal_handler(signal.SIGHUP, on_reload)
    runner, bound = await start(app, sock)
    on_ready(bound)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        await engine.close()
