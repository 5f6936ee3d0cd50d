"""``AdapterSources``: a source and a digest in, a verified local adapter directory out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from lorapage.adapters.digest import content_digest
from lorapage.errors import AdapterIntegrityError, AdapterSourceError, LorapageError
from lorapage.sources import disk_cache
from lorapage.sources.download import Budget, DownloadLimits, S3Reader, fetch_hf, fetch_https, https_session
from lorapage.sources.parse import FileSource, HfSource, HttpsSource, RemoteSource, Source
from lorapage.sources.roots import AdapterRoots
from lorapage.sources.slots import TenantSlots

T = TypeVar("T")
DOWNLOADS_PER_TENANT = 2  # one tenant's downloads running at once; its others wait in its own line
DOWNLOAD_THREADS = 16  # s3 and hf transfers (blocking clients) run here, never on the engine's I/O threads
_SHARED = ""  # the download slots of owner-less versions


@dataclass(frozen=True)
class SourceStats:
    """Counters since start, by scheme where they have one, and the cache's size now."""

    downloads: dict[str, int]  # downloads that completed and matched
    bytes_downloaded: dict[str, int]  # bytes received, failed downloads included
    failures: dict[str, int]  # fetches that failed (integrity failures included)
    integrity_failures: int
    cache_hits: int
    cache_evictions: int
    cache_bytes: int
    cache_entries: int


class AdapterSources:
    """Fetches adapter versions for one engine: ``file://`` directories checked in place, remote
    ones through a content-addressed disk cache ``<cache_dir>/<digest>/`` of at most
    ``cache_bytes`` (least recently used entries evicted after each download).

    Every directory it returns was hashed against ``digest`` during that call (when one is given),
    cache hits included, so a file changed or corrupted on disk is caught before use: in place it
    is an AdapterIntegrityError, in the cache the entry is dropped and downloaded again. Concurrent
    fetches of one digest (or, without a digest, of one uri) by one tenant share one download or
    one check; another tenant's fetch downloads from its own source (so a slow or hostile source
    of one tenant never stands in for another's). An entry is never evicted while a fetch is
    returning it or a :meth:`use` block holds it.

    A cache entry stands in for a tenant's source only once that tenant has shown its source
    serves the content: a tenant that names a cached digest with a source it never downloaded it
    from downloads it again (and fails as its source does), so knowing another tenant's digest
    gets nothing. ``registered`` (a version the owner registered already) and the operator's
    versions use the cache as it is.

    A directory is checked against ``adapter_roots`` for its version's owner at every fetch.
    Downloads are held to ``limits`` (bytes, a total deadline, a minimum rate) and to
    :data:`DOWNLOADS_PER_TENANT` at once per tenant. File work runs on ``executor``; https
    streams on the event loop; s3 and hf run on threads of their own.
    """

    def __init__(
        self,
        cache_dir: Path | None,
        cache_bytes: int,
        *,
        limits: DownloadLimits,
        adapter_roots: AdapterRoots,
        executor: concurrent.futures.Executor,
        s3_endpoint_url: str | None = None,
        hf_endpoint: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._roots = adapter_roots
        self._executor = executor
        self._downloads_executor = concurrent.futures.ThreadPoolExecutor(
            DOWNLOAD_THREADS, thread_name_prefix="lorapage-download"
        )
        self._clock = clock
        self._slots = TenantSlots(DOWNLOADS_PER_TENANT)
        self._s3 = S3Reader(s3_endpoint_url)
        self._hf_endpoint = hf_endpoint
        self._session: aiohttp.ClientSession | None = None
        self._cache: disk_cache.DiskCache | None = None
        if cache_dir is not None:  # once, at start: a directory listing, before any request
            self._cache, over = disk_cache.open_cache(cache_dir, cache_bytes)
            for path in over:
                disk_cache.remove_dir(path)
        # Fetches in flight, by (tenant, digest or uri): what a tenant's concurrent fetches share.
        self._flights: dict[tuple[str, str], asyncio.Task[Path]] = {}
        self._waiting: Counter[tuple[str, str]] = Counter()  # fetch calls awaiting each flight
        self._landed: dict[tuple[str, str], str] = {}  # a flight without a digest -> the digest it landed as
        self._held: Counter[str] = Counter()  # digest -> use() blocks reading it
        self._removing: dict[str, asyncio.Task[None]] = {}  # digest -> eviction deleting it
        self._proven: dict[str, set[str]] = {}  # digest -> tenants whose own source delivered it (this run)
        self._downloads: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._integrity_failures = 0
        self._hits = 0
        self._evictions = 0

    async def fetch(
        self, source: Source, digest: str | None, owner: str | None = None, *, registered: bool = False
    ) -> Path:
        """A local directory holding the adapter files of ``source``, verified against ``digest``
        (stored form, :func:`normalize_digest`) when given, for a version owned by ``owner``.
        Raises AdapterSourceError or AdapterIntegrityError. A remote entry may be evicted once
        this returns; read it inside :meth:`use` instead when another download could need the
        room meanwhile."""
        return await self._fetch(source, digest, owner, hold=False, registered=registered)

    @asynccontextmanager
    async def use(
        self, source: Source, digest: str | None, owner: str | None = None, *, registered: bool = False
    ) -> AsyncIterator[Path]:
        """:meth:`fetch`, with the entry kept from eviction until the block ends."""
        path = await self._fetch(source, digest, owner, hold=True, registered=registered)
        try:
            yield path
        finally:
            if not isinstance(source, FileSource):
                self._held[path.name] -= 1
                if not self._held[path.name]:
                    del self._held[path.name]

    def stats(self) -> SourceStats:
        cache = self._cache
        return SourceStats(
            downloads=dict(self._downloads),
            bytes_downloaded=dict(self._bytes),
            failures=dict(self._failures),
            integrity_failures=self._integrity_failures,
            cache_hits=self._hits,
            cache_evictions=self._evictions,
            cache_bytes=cache.bytes_used if cache else 0,
            cache_entries=len(cache) if cache else 0,
        )

    async def close(self) -> None:
        """Cancel fetches in flight (their temp directories are removed) and close the session."""
        flights = list(self._flights.values())
        for task in flights:
            task.cancel()
        await asyncio.gather(*flights, *self._removing.values(), return_exceptions=True)
        self._downloads_executor.shutdown(wait=False, cancel_futures=True)
        if self._session is not None:
            await self._session.close()

    def cached(self, digest: str) -> bool:
        """Whether the disk cache holds ``digest`` (by its bookkeeping: no disk is read)."""
        return self._cache is not None and self._cache.contains(digest)

    def downloads_running(self, owner: str | None) -> int:
        """``owner``'s downloads holding one of its slots now."""
        return self._slots.running(owner if owner is not None else _SHARED)

    async def _fetch(
        self, source: Source, digest: str | None, owner: str | None, *, hold: bool, registered: bool
    ) -> Path:
        try:
            if isinstance(source, FileSource):
                return await self._fetch_local(source, digest, owner)
            tenant = owner if owner is not None else _SHARED
            return await self._fetch_remote(source, digest, tenant, hold=hold, trusted=registered or owner is None)
        except AdapterSourceError as exc:
            self._failures[source.scheme] += 1
            self._integrity_failures += isinstance(exc, AdapterIntegrityError)
            raise

    async def _fetch_local(self, source: FileSource, digest: str | None, owner: str | None) -> Path:
        try:
            path = await self._run(self._roots.check, source.path, owner)
            got = None if digest is None else await self._run(content_digest, path, self.limits.max_bytes)
        except LorapageError as exc:  # the directory moved, became a link out, or a root was dropped
            raise AdapterSourceError(f"adapter directory {source.path} is no longer usable: {exc.message}") from None
        except OSError as exc:
            raise AdapterSourceError(f"adapter directory {source.path} cannot be read ({exc})") from None
        if got != digest:
            raise AdapterIntegrityError(
                f"adapter files in {path} changed after registration: sha256 {got}, registered {digest}; "
                "register the new content as a new version"
            )
        return path

    async def _fetch_remote(
        self, source: RemoteSource, digest: str | None, tenant: str, *, hold: bool, trusted: bool
    ) -> Path:
        if self._cache is None:
            raise AdapterSourceError(
                f"adapter source {source.uri}: remote sources need a disk cache; start the server with "
                "--adapter-cache-dir"
            )
        key = (tenant, digest or source.uri)
        flight = self._flights.get(key)
        if flight is None:
            task = self._obtain(source, digest, key, trusted)
            flight = self._flights[key] = asyncio.get_running_loop().create_task(task)
            flight.add_done_callback(functools.partial(self._flight_done, key))
        self._waiting[key] += 1
        try:
            # Shielded: a caller that gives up leaves the download to the others (and the cache).
            path = await asyncio.shield(flight)
            if hold:  # no await since the flight ended, so no eviction could slip in between
                self._held[path.name] += 1
            return path
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
                self._landed.pop(key, None)

    def _flight_done(self, key: tuple[str, str], task: asyncio.Task[Path]) -> None:
        del self._flights[key]
        if not task.cancelled():
            task.exception()  # every waiter may have given up; do not warn about it

    async def _obtain(self, source: RemoteSource, digest: str | None, key: tuple[str, str], trusted: bool) -> Path:
        assert self._cache is not None
        if digest is not None and (trusted or key[0] in self._proven.get(digest, ())):
            if removal := self._removing.get(digest):
                await removal
            if (path := self._cache.lookup(digest)) is not None:
                if await self._run(_still_matches, path, digest):
                    self._hits += 1
                    return path
                self._cache.forget(digest)  # corrupted or removed behind our back: fetch again
                await self._run(disk_cache.remove_dir, path)
        return await self._download(source, digest, key)

    async def _download(self, source: RemoteSource, digest: str | None, key: tuple[str, str]) -> Path:
        assert self._cache is not None
        release = await self._slots.acquire(key[0])  # waits behind this tenant's own downloads only
        try:
            temp = await self._run(disk_cache.make_temp, self._cache.root)
        except BaseException:
            release()
            raise
        budget = Budget(self.limits, source.uri, self._clock)
        try:
            await self._transfer(source, temp, budget, release)
            got = await self._run(content_digest, temp)
            if digest is not None and got != digest:
                hint = source.pin_hint() if isinstance(source, HfSource) else ""
                raise AdapterIntegrityError(
                    f"adapter source {source.uri}: downloaded files have sha256 {got}, expected {digest}{hint}"
                )
            if removal := self._removing.get(got):
                await removal
            size = await self._run(disk_cache.commit, temp, self._cache.path(got))
        except OSError as exc:
            raise AdapterSourceError(f"adapter source {source.uri}: writing the download failed ({exc})") from None
        finally:
            self._bytes[source.scheme] += budget.received
            await self._run(disk_cache.remove_dir, temp)  # nothing there once committed
        self._downloads[source.scheme] += 1
        if digest is None:
            self._landed[key] = got
        self._proven.setdefault(got, set()).add(key[0])
        await self._evict(self._cache.insert(got, size, protect=self._protected()))
        return self._cache.path(got)

    async def _transfer(self, source: RemoteSource, dest: Path, budget: Budget, release: Callable[[], None]) -> None:
        """Download into ``dest`` under ``budget``; gives the tenant's slot back (``release``) once
        the transfer has ended, which for a blocking client past its deadline is when its thread does."""
        if isinstance(source, HttpsSource):
            try:
                if self._session is None:
                    self._session = https_session(self.limits.allow_private)
                await fetch_https(self._session, source, dest, budget, self._run)
            finally:
                release()
            return
        if isinstance(source, HfSource):
            # huggingface_hub reports no progress: only the deadline can be watched from here.
            work, watch_rate = functools.partial(fetch_hf, source, dest, budget, self._hf_endpoint), False
        else:
            work, watch_rate = functools.partial(self._s3.fetch, source, dest, budget), True
        thread = asyncio.get_running_loop().run_in_executor(self._downloads_executor, work)
        thread.add_done_callback(functools.partial(_thread_done, release))
        while True:  # the worker counts bytes as they come; each wait lasts as long as they buy
            patience = budget.patience(rate=watch_rate)
            try:
                await asyncio.wait_for(asyncio.shield(thread), max(patience, 0))
                return
            except TimeoutError:
                if budget.patience(rate=watch_rate) <= 0:
                    budget.cancelled = True  # the worker stops at its next chunk
                    raise budget.too_slow() from None

    def _protected(self) -> set[str]:
        """Digests a fetch is returning (or checking) or a use() block holds."""
        return {self._landed.get(key, key[1]) for key in self._waiting} | set(self._held)

    async def _evict(self, victims: list[str]) -> None:
        assert self._cache is not None
        tasks = []
        for digest in victims:
            task = asyncio.get_running_loop().create_task(self._run(disk_cache.remove_dir, self._cache.path(digest)))
            task.add_done_callback(functools.partial(self._removed, digest))
            self._removing[digest] = task
            self._proven.pop(digest, None)
            tasks.append(task)
        self._evictions += len(victims)
        await asyncio.gather(*tasks)

    def _removed(self, digest: str, task: asyncio.Task[None]) -> None:
        if self._removing.get(digest) is task:
            del self._removing[digest]

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))


def _thread_done(release: Callable[[], None], done: asyncio.Future[None]) -> None:
    """A blocking transfer ended: its tenant's slot is free (its outcome was, or never will be, awaited)."""
    release()
    if not done.cancelled():
        done.exception()  # read: a transfer the loop gave up on is not logged as never retrieved


def _still_matches(path: Path, digest: str) -> bool:
    """Whether a cache entry is still whole and unchanged; marks it used. Blocking."""
    try:
        disk_cache.touch(path)
        return content_digest(path) == digest
    except OSError:
        return False
