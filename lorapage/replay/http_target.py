"""The ``--url`` target: any OpenAI-compatible server, driven through ``POST /v1/completions``
with ``stream: true``, so the first token and every later one are timed as they arrive.

From a lorapage server it also reads ``x-adapter-tier`` (where the adapter was when the request
arrived; ``shared`` for an adapter other tenants may use too, whose tier the server keeps to
itself) and scrapes ``/metrics`` (with the admin key when one is given) before, during and after
the run. Another server's answers count the same; its tier is ``unknown``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from lorapage.replay.keys import Keys
from lorapage.replay.prompts import DEFAULT_TOKEN_RANGE, prompt_for
from lorapage.replay.scrape import parse_prometheus
from lorapage.traces.records import CLIENT_ERROR, HTTP_ERROR, OK, STREAM_ERROR, UNKNOWN_TIER, Result
from lorapage.traces.trace import TraceRequest

GAUGES = {"lorapage_engine_queue_depth": "queue_depth", "lorapage_engine_running": "running"}


def _error_message(text: str) -> str:
    """OpenAI's ``error.message`` when the body is its error JSON, else the body, shortened."""
    try:
        body = json.loads(text)
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body["error"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text
    return str(message)[:300]


class HttpTarget:
    """Sends each request to ``url`` (the server's root, e.g. ``http://127.0.0.1:8000``)."""

    def __init__(
        self,
        url: str,
        keys: Keys,
        *,
        extra_body: Mapping[str, Any] | None = None,
        token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.keys = keys
        self.extra_body = dict(extra_body or {})
        self.token_range = token_range
        self.metrics_note: str | None = None  # why /metrics could not be read, once it could not
        self._session: aiohttp.ClientSession | None = None

    def describe(self) -> dict:
        return {"kind": "url", "url": self.url, "extra_body": self.extra_body}

    async def start(self) -> None:
        # No pool limit: an open-loop replay must never queue requests in the client.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "HttpTarget.start() first"
        return self._session

    def body(self, req: TraceRequest, index: int) -> dict:
        return {
            "model": req.model,
            "prompt": prompt_for(req, index, self.token_range),
            "max_tokens": req.max_tokens,
            **req.sampling_fields(),
            **self.extra_body,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, req: TraceRequest, index: int, res: Result, clock: Callable[[], float]) -> None:
        """Run one request, filling ``res`` as its answer streams in."""
        body = self.body(req, index)
        if isinstance(body["prompt"], list):
            res.prompt_tokens = len(body["prompt"])
        key = self.keys.key_for(req.tenant)
        headers = {"Authorization": f"Bearer {key}"} if key else {}  # no keys file: a server without auth
        try:
            async with self.session.post(self.url + "/v1/completions", json=body, headers=headers) as resp:
                res.status = resp.status
                res.tier = resp.headers.get("x-adapter-tier", UNKNOWN_TIER)
                if resp.status != 200:
                    res.outcome, res.error = HTTP_ERROR, _error_message(await resp.text())
                    return
                await self._read_stream(resp, res, clock)
        except (aiohttp.ClientError, OSError) as exc:
            res.outcome = STREAM_ERROR if res.status else CLIENT_ERROR
            res.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            res.end = clock()

    async def _read_stream(self, resp: aiohttp.ClientResponse, res: Result, clock: Callable[[], float]) -> None:
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                res.outcome = res.outcome or OK
                return
            event = json.loads(data)
            if "error" in event:
                res.outcome, res.error = STREAM_ERROR, _error_message(data)
                continue
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                res.chunk(clock(), res.output_tokens + 1)
            usage = event.get("usage")
            if usage:
                res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                res.output_tokens = usage.get("completion_tokens", res.output_tokens)
        res.outcome, res.error = STREAM_ERROR, res.error or "the stream ended without data: [DONE]"

    async def counters(self) -> dict[str, float] | None:
        """The server's ``/metrics`` parsed, or ``None`` (with :attr:`metrics_note` saying why)."""
        headers = {"Authorization": f"Bearer {self.keys.admin}"} if self.keys.admin else {}
        try:
            async with self.session.get(self.url + "/metrics", headers=headers) as resp:
                if resp.status != 200:
                    hint = (
                        "; give the admin key (--admin-key or the keys file's admin)"
                        if resp.status in (401, 403)
                        else ""
                    )
                    self.metrics_note = f"/metrics answered {resp.status}{hint}"
                    return None
                return parse_prometheus(await resp.text())
        except (aiohttp.ClientError, OSError) as exc:
            self.metrics_note = f"/metrics could not be read: {exc}"
            return None

    async def gauges(self) -> dict[str, float]:
        """Queue depth and running requests now, when the server exports lorapage's gauges."""
        snap = await self.counters()
        return {short: snap[name] for name, short in GAUGES.items() if snap and name in snap}
