"""Bringing one adapter version's two files from a remote source into a directory, under a byte
cap. https streams on the event loop (writes go to a worker); s3 and hf are blocking clients and
run whole in a worker. Every failure is an AdapterSourceError that names the source."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import aiohttp

from lorapage.adapters.digest import ADAPTER_FILES
from lorapage.adapters.sources.parse import HfSource, HttpsSource, S3Source
from lorapage.errors import AdapterSourceError

_CHUNK = 1 << 20
# No total deadline: a large adapter on a slow link is fine as long as bytes keep coming.
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)

Run = Callable[..., Awaitable[Any]]  # runs a blocking call in the executor


class Budget:
    """The bytes one adapter version may still download, and what it has received so far."""

    def __init__(self, limit: int, uri: str) -> None:
        self.limit = limit
        self.uri = uri
        self.received = 0

    def expect(self, name: str, size: int) -> None:
        """Fail before downloading when a declared size cannot fit."""
        if self.received + size > self.limit:
            raise self._over(name, f"declares {size} bytes")

    def take(self, name: str, n: int) -> None:
        self.received += n
        if self.received > self.limit:
            raise self._over(name, f"sent more than {self.limit - (self.received - n)} bytes")

    def _over(self, name: str, what: str) -> AdapterSourceError:
        return AdapterSourceError(
            f"adapter source {self.uri}: {name} {what}, over the server's adapter download cap of "
            f"{self.limit} bytes (both files together)"
        )


async def fetch_https(
    session: aiohttp.ClientSession, source: HttpsSource, dest: Path, budget: Budget, run: Run
) -> None:
    """GET ``<uri>/<file>`` for each adapter file into ``dest``, streaming under ``budget``."""
    for name in ADAPTER_FILES:
        url = source.url(name)
        try:
            async with session.get(url, headers={"Accept-Encoding": "identity"}) as resp:
                if resp.status != 200:
                    raise AdapterSourceError(f"adapter source {url}: HTTP {resp.status} {resp.reason or ''}".rstrip())
                if resp.content_length is not None:
                    budget.expect(name, resp.content_length)
                file: IO[bytes] = await run(open, dest / name, "wb")
                try:
                    async for chunk in resp.content.iter_chunked(_CHUNK):
                        budget.take(name, len(chunk))
                        await run(file.write, chunk)
                finally:
                    await run(file.close)
        except aiohttp.ClientPayloadError as exc:
            raise AdapterSourceError(f"adapter source {url}: the body ended early ({exc}); retry later") from None
        except aiohttp.ClientError as exc:
            raise AdapterSourceError(f"adapter source {url} is unreachable ({exc})") from None
        except TimeoutError:
            raise AdapterSourceError(f"adapter source {url}: timed out waiting for data") from None


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
                    while chunk := body.read(_CHUNK):
                        budget.take(name, len(chunk))
                        file.write(chunk)
            except botocore.exceptions.ClientError as exc:
                error = exc.response.get("Error", {})
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                raise AdapterSourceError(
                    f"adapter source {where}: {error.get('Code', status)} {error.get('Message', '')}".rstrip()
                ) from None
            except botocore.exceptions.BotoCoreError as exc:
                raise AdapterSourceError(f"adapter source {where}: {exc}") from None

    def _get_client(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                config = Config(connect_timeout=10, read_timeout=60, retries={"max_attempts": 3})
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
