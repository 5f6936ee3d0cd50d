"""Adapter sources: parsing, and fetches from real servers on 127.0.0.1 (an aiohttp file server,
moto's S3 server, an aiohttp server speaking the Hub's resolve URLs) through the disk cache."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web
from remote_sources import FileServer, cache_listing, files, make_adapter, s3_bucket, s3_endpoint, start_server

from lorapage.adapters.digest import ADAPTER_FILES, content_digest
from lorapage.errors import (
    AdapterIntegrityError,
    AdapterSourceError,
    InvalidRequestError,
    PermissionDeniedError,
)
from lorapage.sources import (
    NO_ROOTS,
    AdapterRoots,
    AdapterSources,
    DownloadLimits,
    FileSource,
    HfSource,
    parse_source,
)

CAP = 1 << 20  # the download cap in these tests; the demo adapter is about 80 KB
OTHER = "0" * 64  # a digest no adapter here has


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


@pytest.fixture
async def make_sources(tmp_path: Path, executor: ThreadPoolExecutor) -> AsyncIterator[Callable[..., AdapterSources]]:
    made: list[AdapterSources] = []

    def make(cache_bytes: int = 1 << 30, max_download_bytes: int = CAP, **kw: object) -> AdapterSources:
        # The servers here listen on 127.0.0.1: private addresses are allowed.
        limits = DownloadLimits(max_download_bytes, allow_private=True)
        options: dict = {"limits": limits, "adapter_roots": AdapterRoots(shared=(tmp_path / "root",))}
        sources = AdapterSources(tmp_path / "cache", cache_bytes, executor=executor, **(options | kw))
        made.append(sources)
        return sources

    yield make
    for sources in made:
        await sources.close()


def test_parse_source_canonical_forms(tmp_path: Path) -> None:
    root = tmp_path / "root"
    adapter = make_adapter(root / "a")
    roots = AdapterRoots(shared=(root,))
    sha = "SHA256:" + "AB" * 32
    assert parse_source(str(adapter), sha256=None, roots=roots) == FileSource(adapter.as_uri(), adapter)
    assert parse_source(adapter.as_uri() + "/", sha256=None, roots=roots).uri == adapter.as_uri()
    assert parse_source("HTTPS://Host.example/a/b/", sha256=sha, roots=NO_ROOTS).uri == "https://host.example/a/b"
    assert parse_source("http://127.0.0.1:8080/x", sha256=sha, roots=NO_ROOTS).uri == "http://127.0.0.1:8080/x"
    assert parse_source("s3://bucket/p/q/", sha256=None, roots=NO_ROOTS).uri == "s3://bucket/p/q"
    hf = parse_source("hf://org/repo", sha256=None, roots=NO_ROOTS)
    assert hf == HfSource("hf://org/repo@main", "org/repo", "main") and not hf.pinned
    stored = parse_source("hf://org/repo@v1.0", sha256=None, roots=NO_ROOTS)
    assert parse_source(stored.uri, sha256=None, roots=NO_ROOTS) == stored


@pytest.mark.parametrize(
    ("uri", "sha256", "error", "says"),
    [
        ("relative/dir", None, InvalidRequestError, "absolute"),
        ("{tmp}/elsewhere", None, PermissionDeniedError, "outside the adapter roots"),
        ("{tmp}/root/linked", None, PermissionDeniedError, "links outside"),
        ("file://server/dir", None, InvalidRequestError, "local path"),
        ("https://host/a", None, InvalidRequestError, "sha256"),
        ("https://host/a", "abc", InvalidRequestError, "64 hex"),
        ("http://example.com/a", "a" * 64, InvalidRequestError, "127.0.0.1"),
        ("https://user:pw@host/a", "a" * 64, InvalidRequestError, "credentials"),
        ("https://host/a?sig=1", "a" * 64, InvalidRequestError, "query"),
        ("s3://Bad_Bucket/p", None, InvalidRequestError, "bucket"),
        ("hf://just-a-repo", None, InvalidRequestError, "hf://org/repo@revision"),
        ("ftp://host/a", None, InvalidRequestError, "not supported"),
    ],
)
def test_parse_source_refuses(tmp_path: Path, uri: str, sha256: str | None, error: type, says: str) -> None:
    root = tmp_path / "root"
    make_adapter(tmp_path / "elsewhere")
    make_adapter(root / "linked")
    (root / "linked" / "adapter_model.safetensors").unlink()
    (root / "linked" / "adapter_model.safetensors").symlink_to(tmp_path / "elsewhere" / "adapter_model.safetensors")
    with pytest.raises(error, match=says) as info:
        parse_source(uri.format(tmp=tmp_path), sha256=sha256, roots=AdapterRoots(shared=(root,)))
    assert type(info.value) is error


async def test_file_source_is_read_in_place_and_changes_after_registration_are_refused(
    tmp_path: Path, make_sources: Callable[..., AdapterSources]
) -> None:
    adapter = make_adapter(tmp_path / "root" / "a")
    digest = content_digest(adapter)
    source = parse_source(str(adapter), sha256=None, roots=AdapterRoots(shared=(tmp_path / "root",)))
    sources = make_sources()
    assert await sources.fetch(source, digest) == adapter
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterIntegrityError, match=f"registered {digest}"):
        await sources.fetch(source, digest)
    assert sources.stats().failures == {"file": 1}


async def test_https_fetch_verifies_caches_and_hits(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources]
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    source = parse_source(files.publish("a", adapter), sha256=digest, roots=NO_ROOTS)
    sources = make_sources()
    path = await sources.fetch(source, digest)
    assert path == tmp_path / "cache" / digest
    for name in ADAPTER_FILES:
        assert (path / name).read_bytes() == (adapter / name).read_bytes()
    assert await sources.fetch(source, digest) == path
    assert files.hits == {f"a/{name}": 1 for name in ADAPTER_FILES}
    stats = sources.stats()
    assert (stats.downloads, stats.cache_hits, stats.cache_entries) == ({"https": 1}, 1, 1)
    assert stats.bytes_downloaded == {"https": stats.cache_bytes} and stats.cache_bytes > 0


async def test_https_wrong_digest_leaves_nothing_and_the_next_fetch_retries(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources]
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    source = parse_source(files.publish("a", adapter), sha256=OTHER, roots=NO_ROOTS)
    sources = make_sources()
    with pytest.raises(AdapterIntegrityError) as info:
        await sources.fetch(source, OTHER)
    assert all(part in info.value.message for part in (digest, OTHER, source.uri))
    assert cache_listing(tmp_path / "cache") == []
    assert (await sources.fetch(source, digest)).name == digest
    assert sources.stats().integrity_failures == 1


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        ("missing", "HTTP 404"),
        ("truncated", "ended early"),
        ("declared_over_cap", "declares"),
        ("streamed_over_cap", "sent more than"),
        ("unreachable", "unreachable"),
    ],
)
async def test_https_failures_fail_only_that_fetch(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources], setup: str, says: str
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    uri = files.publish("a", adapter)
    weights = "a/adapter_model.safetensors"
    big = b"x" * (CAP + 1)
    match setup:
        case "missing":
            del files.files[weights]
        case "truncated":
            files.truncate.add(weights)
        case "declared_over_cap":
            files.files[weights] = big
        case "streamed_over_cap":
            files.files[weights] = big
            files.chunked.add(weights)
        case "unreachable":
            uri = "http://127.0.0.1:9/a"  # the discard port: nothing listens
    sources = make_sources()
    with pytest.raises(AdapterSourceError, match=says) as info:
        await sources.fetch(parse_source(uri, sha256=digest, roots=NO_ROOTS), digest)
    assert type(info.value) is AdapterSourceError
    assert cache_listing(tmp_path / "cache") == []
    assert sources.stats().failures == {"https": 1}


async def test_concurrent_fetches_of_a_cold_adapter_share_one_download(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources]
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    source = parse_source(files.publish("a", adapter), sha256=digest, roots=NO_ROOTS)
    sources = make_sources()
    files.gate.clear()
    fetches = [asyncio.create_task(sources.fetch(source, digest)) for _ in range(8)]
    while not files.hits:
        await asyncio.sleep(0.01)
    fetches[0].cancel()  # one caller gives up; the download goes on for the others
    files.gate.set()
    paths = await asyncio.gather(*fetches[1:])
    assert set(paths) == {tmp_path / "cache" / digest}
    assert files.hits == {f"a/{name}": 1 for name in ADAPTER_FILES}
    assert sources.stats().downloads == {"https": 1}


async def test_lru_eviction_keeps_recent_and_held_entries_under_the_byte_cap(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources]
) -> None:
    versions = []
    for i in range(3):
        adapter = make_adapter(tmp_path / f"v{i}", variant=i)
        digest = content_digest(adapter)
        versions.append((parse_source(files.publish(f"v{i}", adapter), sha256=digest, roots=NO_ROOTS), digest))
    size = sum((tmp_path / "v0" / name).stat().st_size for name in ADAPTER_FILES)
    sources = make_sources(cache_bytes=2 * size + 2)  # two entries fit, not three
    (s0, d0), (s1, d1), (s2, d2) = versions
    await sources.fetch(s0, d0)
    await sources.fetch(s1, d1)
    await sources.fetch(s0, d0)  # v0 is now more recent than v1
    await sources.fetch(s2, d2)
    assert cache_listing(tmp_path / "cache") == sorted([d0, d2])
    async with sources.use(s0, d0) as path:
        await sources.fetch(s2, d2)  # v0 is the least recently used now, but held
        await sources.fetch(s1, d1)
        assert (path / "adapter_config.json").exists()
    assert cache_listing(tmp_path / "cache") == sorted([d0, d1])
    assert sources.stats().cache_evictions == 2


async def test_cache_survives_restart_and_a_corrupted_entry_is_downloaded_again(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources]
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    source = parse_source(files.publish("a", adapter), sha256=digest, roots=NO_ROOTS)
    path = await make_sources().fetch(source, digest)
    (tmp_path / "cache" / ".tmp-left-by-a-crash").mkdir()
    again = make_sources()
    assert cache_listing(tmp_path / "cache") == [digest]
    assert await again.fetch(source, digest) == path
    assert sum(files.hits.values()) == 2 and again.stats().cache_hits == 1
    (path / "adapter_model.safetensors").write_bytes(b"bit rot")
    assert content_digest(await again.fetch(source, digest)) == digest
    assert sum(files.hits.values()) == 4


# --- s3, against moto's server ------------------------------------------------------------

__all__ = ["files", "s3_bucket", "s3_endpoint"]  # fixtures, imported to be found


async def test_s3_fetch_verifies_and_refuses_a_wrong_digest(
    tmp_path: Path,
    s3_endpoint: str,
    s3_bucket: Callable[[str, Path], None],
    make_sources: Callable[..., AdapterSources],
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    s3_bucket("team/a", adapter)
    source = parse_source("s3://adapters/team/a/", sha256=None, roots=NO_ROOTS)
    sources = make_sources(s3_endpoint_url=s3_endpoint)
    with pytest.raises(AdapterIntegrityError, match=OTHER):
        await sources.fetch(source, OTHER)
    path = await sources.fetch(source, None)  # no digest given: it is what was downloaded
    assert path.name == digest and content_digest(path) == digest
    with pytest.raises(AdapterSourceError, match="404|NoSuchKey"):
        await sources.fetch(parse_source("s3://adapters/team/b", sha256=None, roots=NO_ROOTS), OTHER)
    assert cache_listing(tmp_path / "cache") == [digest]


async def test_s3_object_over_the_cap_fails_before_download(
    tmp_path: Path,
    s3_endpoint: str,
    s3_bucket: Callable[[str, Path], None],
    make_sources: Callable[..., AdapterSources],
) -> None:
    adapter = make_adapter(tmp_path / "a")
    s3_bucket("a", adapter)
    sources = make_sources(s3_endpoint_url=s3_endpoint, max_download_bytes=2000)
    with pytest.raises(AdapterSourceError, match="declares"):
        await sources.fetch(parse_source("s3://adapters/a", sha256=None, roots=NO_ROOTS), None)
    assert sources.stats().bytes_downloaded == {"s3": os.path.getsize(adapter / "adapter_config.json")}


# --- hf, against a server speaking the Hub's resolve URLs ---------------------------------


async def test_hf_fetch_at_a_revision(tmp_path: Path, make_sources: Callable[..., AdapterSources]) -> None:
    pytest.importorskip("huggingface_hub", reason="hf sources need huggingface_hub (pip install 'lorapage[hf]')")
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    commit = "c" * 40
    asked: list[str] = []

    async def resolve(request: web.Request) -> web.Response:
        info = request.match_info
        asked.append(f"{request.method} {info['rev']}")
        if f"{info['org']}/{info['repo']}" != "org/repo" or info["rev"] not in ("v1", commit):
            return web.Response(status=404, headers={"X-Error-Code": "RevisionNotFound"})
        body = (adapter / info["file"]).read_bytes()
        return web.Response(body=body, headers={"X-Repo-Commit": commit, "ETag": f'"{len(body)}"'})

    app = web.Application()
    app.router.add_get("/{org}/{repo}/resolve/{rev}/{file}", resolve)
    runner, endpoint = await start_server(app)
    try:
        sources = make_sources(hf_endpoint=endpoint)
        path = await sources.fetch(parse_source("hf://org/repo@v1", sha256=None, roots=NO_ROOTS), digest)
        assert content_digest(path) == digest and cache_listing(path) == sorted(ADAPTER_FILES)
        assert asked[0] == "HEAD v1" and all(a.endswith(commit) for a in asked[1:])  # one commit for both
        with pytest.raises(AdapterSourceError, match="hf://org/repo@nope"):
            await sources.fetch(parse_source("hf://org/repo@nope", sha256=None, roots=NO_ROOTS), OTHER)
        assert sources.stats().downloads == {"hf": 1}
    finally:
        await runner.cleanup()
