"""Bringing one adapter version's two files from a remote source into a directory, under a byte
cap, a total deadline and a minimum rate (:class:`Budget`). https streams on the event loop
(writes go to a worker), following a redirect only to a URL and an address a source itself may
name (:mod:`lorapage.sources.addresses`); s3 and hf are blocking clients and run whole in
a worker. Every failure is an AdapterSourceError that names the source; what the server learnt
about a host it could not reach is logged, not returned."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
from yarl import URL

from lorapage.adapters.digest import ADAPTER_FILES
from lorapage.errors import AdapterSourceError, InvalidRequestError
from lorapage.sources.addresses import CheckedResolver, RefusedAddressError, check_host
from lorapage.sources.parse import HfSource, HttpsSource, S3Source, check_download_url

log = logging.getLogger("lorapage.adapters")

_CHUNK = 1 << 20
_S3_CHUNK = 256 << 10  # smaller reads of a blocking body: the deadline is looked at between them
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Per socket operation; the whole download is bounded by its Budget (deadline and minimum rate).
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)

Run = Callable[..., Awaitable[Any]]  # runs a blocking call in the executor


@dataclass(frozen=True)
class DownloadLimits:
    """What one adapter download (both files together) may take: ``max_bytes``, ``timeout_s`` from
    its start, and past its first ``grace_s`` at least ``min_bytes_per_s`` on average (0: no floor),
    so a source that trickles a byte now and then cannot hold a registration or a load for long.
    ``allow_private``: https sources may reach loopback and private addresses (never link-local)."""

    max_bytes: int
    timeout_s: float = 600.0
    min_bytes_per_s: int = 64 << 10
    grace_s: float = 10.0
    allow_private: bool = False


class Budget:
    """The bytes and the time one adapter version's download may still take, and what it has
    received so far. Its clock is injected; :meth:`take` (any thread) refuses what passes a limit,
    :meth:`patience` says how long the event loop may wait for more bytes."""

    def __init__(self, limits: DownloadLimits, uri: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.limit = limits.max_bytes
        self.uri = uri
        self.received = 0
        self.clock = clock
        self.started = clock()
        self.cancelled = False  # set by the loop when it gave up: a worker stops at its next chunk

    def expect(self, name: str, size: int) -> None:
        """Fail before downloading when a declared size cannot fit."""
        if self.received + size > self.limit:
            raise self._over(name, f"declares {size} bytes")

    def take(self, name: str, n: int) -> None:
        """Count ``n`` bytes of ``name`` received; refuse them past the byte cap, the deadline or
        under the minimum rate."""
        self.received += n
        if self.received > self.limit:
            raise self._over(name, f"sent more than {self.limit - (self.received - n)} bytes")
        if self.cancelled or self.patience() <= 0:
            raise self.too_slow()

    def patience(self, rate: bool = True) -> float:
        """Seconds the bytes received so far buy before the download is cut: it must end within
        ``timeout_s`` and, once ``grace_s`` has passed, average ``min_bytes_per_s`` (unless
        ``rate`` is False: a transfer that reports its bytes only at its end)."""
        lim = self.limits
        end = self.started + lim.timeout_s
        if rate and lim.min_bytes_per_s > 0:
            end = min(end, self.started + max(lim.grace_s, self.received / lim.min_bytes_per_s))
        return end - self.clock()

    def too_slow(self) -> AdapterSourceError:
        lim, elapsed = self.limits, self.clock() - self.started
        return AdapterSourceError(
            f"adapter source {self.uri}: cut after {elapsed:.0f}s with {self.received} bytes; a download must "
            f"finish within {lim.timeout_s:g}s and average at least {lim.min_bytes_per_s} bytes/s"
        )

    def _over(self, name: str, what: str) -> AdapterSourceError:
        return AdapterSourceError(
            f"adapter source {self.uri}: {name} {what}, over the server's adapter download cap of "
            f"{self.limit} bytes (both files together)"
        )


def https_session(allow_private: bool) -> aiohttp.ClientSession:
    """The session https sources download with: raw bytes (the cap and the digest apply to what
    was sent), no proxy from the environment, every name resolved under the address rule."""
    connector = aiohttp.TCPConnector(resolver=CheckedResolver(allow_private), use_dns_cache=False)
    return aiohttp.ClientSession(timeout=HTTP_TIMEOUT, auto_decompress=False, connector=connector)


async def fetch_https(
    session: aiohttp.ClientSession, source: HttpsSource, dest: Path, budget: Budget, run: Run
) -> None:
    """GET ``<uri>/<file>`` for each adapter file into ``dest``, streaming under ``budget``."""
    for name in ADAPTER_FILES:
        url = source.url(name)
        try:
            async with asyncio.timeout(max(budget.patience(), 0)):  # connecting and redirects count too
                resp = await _get(session, url, budget)
            async with resp:
                if resp.status != 200:
                    raise AdapterSourceError(f"adapter source {url}: HTTP {resp.status} {resp.reason or ''}".rstrip())
                if resp.content_length is not None:
                    budget.expect(name, resp.content_length)
                file: IO[bytes] = await run(open, dest / name, "wb")
                try:
                    while chunk := await _next_chunk(resp, budget):
                        budget.take(name, len(chunk))
                        await run(file.write, chunk)
                finally:
                    await run(file.close)
        except aiohttp.ClientPayloadError as exc:
            raise AdapterSourceError(f"adapter source {url}: the body ended early ({exc}); retry later") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, RefusedAddressError):
                raise AdapterSourceError(f"adapter source {url}: {exc.os_error}") from None
            raise _unreachable(url, exc) from None
        except aiohttp.ClientError as exc:
            raise _unreachable(url, exc) from None
        except TimeoutError:
            raise budget.too_slow() from None


async def _get(session: aiohttp.ClientSession, url: str, budget: Budget) -> aiohttp.ClientResponse:
    """The response to GET ``url``, after the redirects it names, each to a URL and an address a
    source may name itself (a redirect is no way around the rule)."""
    allow_private = budget.limits.allow_private
    for hop in range(MAX_REDIRECTS + 1):
        try:
            check_host(check_download_url(url), allow_private)
        except (InvalidRequestError, RefusedAddressError) as exc:
            if not hop:
                raise AdapterSourceError(f"adapter source {budget.uri}: {exc}") from None
            raise AdapterSourceError(
                f"adapter source {budget.uri}: redirected to a URL sources may not name: {exc}"
            ) from None
        resp = await session.get(url, headers={"Accept-Encoding": "identity"}, allow_redirects=False)
        location = resp.headers.get("Location")
        if resp.status not in _REDIRECTS or location is None:
            return resp
        resp.release()
        url = str(resp.url.join(URL(location, encoded=True)))
    raise AdapterSourceError(f"adapter source {budget.uri}: more than {MAX_REDIRECTS} redirects")


async def _next_chunk(resp: aiohttp.ClientResponse, budget: Budget) -> bytes:
    """The next bytes of the body (empty at its end), waiting only as long as ``budget`` allows."""
    patience = budget.patience()
    if patience <= 0:
        raise budget.too_slow()
    try:
        return await asyncio.wait_for(resp.content.read(_CHUNK), patience)
    except TimeoutError:
        raise budget.too_slow() from None


def _unreachable(url: str, exc: Exception) -> AdapterSourceError:
    # Whether a port refused, timed out or reset tells a caller what listens where: logged only.
    log.warning("adapter source %s could not be reached: %s", url, exc)
    return AdapterSourceError(f"adapter source {url} is unreachable; the server's log has the detail")


class S3Reader:
    """A boto3 client made on first use (in a worker: making one takes a while) and shared by
    the workers (boto3 clients are thread-safe). Credentials come from boto3's usual chain."""

    def __init__(self, endpoint_url: str | None) -> None:
        self.endpoint_url = endpoint_url
        self._client: Any = None
        self._lock = threading.Lock()

    def fetch(self, source: S3Source, dest: Path, budget: Budget) -> None:
        """Each adapter file ``prefix/<file>`` into ``dest``: HEAD for the size cap, then GET
        streamed under ``budget``. Blocking."""
        try:
            import botocore.exceptions
        except ImportError:
            raise AdapterSourceError(
                f"adapter source {source.uri}: s3:// needs boto3: pip install 'lorapage[s3]'"
            ) from None
        client = self._get_client()
        for name in ADAPTER_FILES:
            key = source.key(name)
            where = f"s3://{source.bucket}/{key}"
            try:
                head = client.head_object(Bucket=source.bucket, Key=key)
                budget.expect(name, head["ContentLength"])
                body = client.get_object(Bucket=source.bucket, Key=key, IfMatch=head["ETag"])["Body"]
                with body, open(dest / name, "wb") as file:
                    while chunk := body.read(_S3_CHUNK):
                        budget.take(name, len(chunk))
                        file.write(chunk)
            except botocore.exceptions.ClientError as exc:
                error = exc.response.get("Error", {})
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                raise AdapterSourceError(
                    f"adapter source {where}: {error.get('Code', status)} {error.get('Message', '')}".rstrip()
                ) from None
            except botocore.exceptions.BotoCoreError as exc:
                log.warning("adapter source %s failed: %s", where, exc)
                raise AdapterSourceError(
                    f"adapter source {where} could not be read; the server's log has the detail"
                ) from None

    def _get_client(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                config = Config(connect_timeout=10, read_timeout=20, retries={"max_attempts": 3})
                self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
            return self._client


def fetch_hf(source: HfSource, dest: Path, budget: Budget, endpoint: str | None) -> None:
    """Each adapter file of the repository at the source's revision into ``dest``: the declared
    size is checked against ``budget`` first (huggingface_hub then checks the bytes against it),
    and both files come from the one commit the revision named when the first was asked for.
    Blocking; a token comes from huggingface_hub's usual places (``HF_TOKEN``)."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    except ImportError:
        raise AdapterSourceError(
            f"adapter source {source.uri}: hf:// needs huggingface_hub: pip install 'lorapage[hf]'"
        ) from None
    staging = dest / ".hf"  # huggingface_hub keeps its own metadata beside what it downloads
    revision = source.revision
    for name in ADAPTER_FILES:
        try:
            meta = get_hf_file_metadata(hf_hub_url(source.repo_id, name, revision=revision, endpoint=endpoint))
            revision = meta.commit_hash or revision
            if meta.size is not None:
                budget.expect(name, meta.size)
            local = Path(hf_hub_download(source.repo_id, name, revision=revision, local_dir=staging, endpoint=endpoint))
            budget.take(name, local.stat().st_size)
            os.replace(local, dest / name)
        except AdapterSourceError:
            raise
        except Exception as exc:  # huggingface_hub raises its own, httpx's and OS errors alike
            raise AdapterSourceError(
                f"adapter source {source.uri}: {name} could not be downloaded ({type(exc).__name__}: {exc})"
            ) from None
    shutil.rmtree(staging, ignore_errors=True)
