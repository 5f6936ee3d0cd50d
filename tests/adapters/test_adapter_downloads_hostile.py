"""Downloads from hostile sources (issue 26, cases 6, 11 and 17): no loopback, private or
link-local address unless allowed, a redirect followed only where a source itself may go, nothing
about a host that could not be reached in the answer, a total deadline and a minimum rate per
download, one tenant's downloads waiting for its own slots only, and prefetch going on for other
tenants while a download is stuck. Real HTTP servers on 127.0.0.1 (and 127.0.0.2)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web
from engine_util import collect
from remote_sources import FileServer, cache_listing, files, make_adapter, start_server
from server_harness import assert_openai_error, make_engine, running_server

from lorapage.adapters.digest import ADAPTER_FILES, content_digest
from lorapage.errors import AdapterSourceError
from lorapage.sources import NO_ROOTS, AdapterSources, DownloadLimits, parse_source

__all__ = ["files"]  # a fixture, imported to be found
CAP = 1 << 20
SLACK_S = 8.0  # what a cut may take past its limit on a loaded machine: generous, and far below "never"


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


@pytest.fixture
async def make_sources(tmp_path: Path, executor: ThreadPoolExecutor) -> AsyncIterator[Callable[..., AdapterSources]]:
    made: list[AdapterSources] = []

    def make(**limits: object) -> AdapterSources:
        options: dict = {"max_bytes": CAP, "allow_private": True} | limits
        sources = AdapterSources(
            tmp_path / "cache", 1 << 30, limits=DownloadLimits(**options), adapter_roots=NO_ROOTS, executor=executor
        )
        made.append(sources)
        return sources

    yield make
    for sources in made:
        await sources.close()


class Hosts:
    """A server on 127.0.0.1 that redirects or trickles as told, and one on 127.0.0.2 that
    counts what reaches it (nothing should)."""

    def __init__(self, adapter: Path) -> None:
        self.adapter = adapter
        self.redirects: dict[str, str] = {}  # path prefix -> Location template ({file} = the file name)
        self.trickle_s = 0.0  # > 0: the body comes one byte at a time, this far apart
        self.hits: Counter[str] = Counter()
        self.elsewhere_hits = 0
        self.base = self.elsewhere = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        prefix, _, name = request.match_info["path"].rpartition("/")
        self.hits[prefix] += 1
        if prefix in self.redirects:
            raise web.HTTPFound(self.redirects[prefix].format(file=name, base=self.base, elsewhere=self.elsewhere))
        data = (self.adapter / name).read_bytes()
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(request)
        if not self.trickle_s:
            await resp.write(data)
            return resp
        for i in range(len(data)):
            await resp.write(data[i : i + 1])
            await asyncio.sleep(self.trickle_s)
        return resp

    async def count_elsewhere(self, request: web.Request) -> web.Response:
        self.elsewhere_hits += 1
        return web.Response(body=(self.adapter / request.match_info["file"]).read_bytes())


@pytest.fixture
async def hosts(tmp_path: Path) -> AsyncIterator[Hosts]:
    server = Hosts(make_adapter(tmp_path / "adapter"))
    app = web.Application()
    app.router.add_get("/{path:.*}", server.handle)
    runner, server.base = await start_server(app)
    other = web.Application()
    other.router.add_get("/{prefix:.*}/{file}", server.count_elsewhere)
    other_runner = web.AppRunner(other)
    await other_runner.setup()
    site = web.TCPSite(other_runner, "127.0.0.2", 0)
    await site.start()
    server.elsewhere = f"http://127.0.0.2:{other_runner.addresses[0][1]}"
    yield server
    await runner.cleanup()
    await other_runner.cleanup()


async def test_loopback_and_private_addresses_are_refused_unless_allowed(
    tmp_path: Path, files: FileServer, make_sources: Callable[..., AdapterSources]
) -> None:
    adapter = make_adapter(tmp_path / "a")
    digest = content_digest(adapter)
    url = files.publish("a", adapter)
    port = url.split(":")[2].split("/")[0]
    sources = make_sources(allow_private=False)
    for uri, says in ((url, "127.0.0.1 is a loopback address"), (f"http://localhost:{port}/a", "loopback")):
        with pytest.raises(AdapterSourceError, match=says) as info:
            await sources.fetch(parse_source(uri, sha256=digest, roots=NO_ROOTS), digest)
        assert "--allow-private-adapter-sources" in info.value.message
    assert not files.hits  # refused before connecting
    allowed = make_sources(allow_private=True)
    assert (await allowed.fetch(parse_source(url, sha256=digest, roots=NO_ROOTS), digest)).name == digest


@pytest.mark.parametrize(
    ("location", "says"),
    [
        ("{elsewhere}/x/{file}", "plain http is only allowed to 127.0.0.1"),  # another loopback host
        ("http://169.254.169.254/latest/meta-data/{file}", "plain http is only allowed"),
        ("https://169.254.169.254/latest/{file}", "link-local"),  # cloud metadata: never
        ("https://[::ffff:169.254.169.254]/latest/{file}", "link-local"),
        ("https://user:pw@example.com/{file}", "credentials"),
        ("{base}/loop/{file}", "more than 5 redirects"),
    ],
)
async def test_a_redirect_goes_only_where_a_source_may_go(
    hosts: Hosts, make_sources: Callable[..., AdapterSources], location: str, says: str
) -> None:
    """Even with private addresses allowed (these servers are on the loopback), a redirect to
    a host the parser would refuse is not followed, and nothing reaches 127.0.0.2."""
    digest = content_digest(hosts.adapter)
    hosts.redirects = {"r": location, "loop": "{base}/loop/{file}", "ok": "{base}/real/{file}"}
    sources = make_sources()
    with pytest.raises(AdapterSourceError, match=says) as info:
        await sources.fetch(parse_source(f"{hosts.base}/r", sha256=digest, roots=NO_ROOTS), digest)
    assert "redirect" in info.value.message
    assert hosts.elsewhere_hits == 0
    # A redirect a source could name itself is followed.
    path = await sources.fetch(parse_source(f"{hosts.base}/ok", sha256=digest, roots=NO_ROOTS), digest)
    assert content_digest(path) == digest and hosts.hits["real"] == len(ADAPTER_FILES)


@pytest.mark.parametrize(
    ("host", "says"),
    [
        ("[64:ff9b::a9fe:a9fe]", "169.254.169.254 is a link-local"),  # NAT64 of the metadata address
        ("[64:ff9b:1::a9fe:a9fe]", "169.254.169.254 is a link-local"),
        ("[2002:a9fe:a9fe::]", "169.254.169.254 is a link-local"),  # 6to4 of it
        ("[fd00:ec2::254]", "fd00:ec2::254 is a cloud metadata address"),  # AWS's IPv6 IMDS
        ("100.100.100.200", "100.100.100.200 is a cloud metadata address"),  # Alibaba's
    ],
)
async def test_metadata_addresses_are_refused_in_every_form_even_with_private_allowed(
    make_sources: Callable[..., AdapterSources], host: str, says: str
) -> None:
    """The operator's flag opens private addresses for a mirror, never a metadata service, and an
    IPv6 address is judged by the IPv4 one it delivers to."""
    digest = "0" * 64
    with pytest.raises(AdapterSourceError, match=says):
        await make_sources(allow_private=True).fetch(
            parse_source(f"https://{host}/latest/meta-data", sha256=digest, roots=NO_ROOTS), digest
        )


async def test_an_unreachable_source_says_nothing_of_why(
    make_sources: Callable[..., AdapterSources], caplog: pytest.LogCaptureFixture
) -> None:
    """Refused, reset or timed out tells a caller what listens where: the answer is the same
    for all of them, and the operator's log has the reason."""
    digest = "0" * 64
    with pytest.raises(AdapterSourceError) as info:
        await make_sources().fetch(parse_source("http://127.0.0.1:9/a", sha256=digest, roots=NO_ROOTS), digest)
    assert info.value.message == (
        "adapter source http://127.0.0.1:9/a/adapter_config.json is unreachable; the server's log has the detail"
    )
    assert any("could not be reached" in r.getMessage() and "127.0.0.1:9" in r.getMessage() for r in caplog.records)


async def test_a_trickling_source_is_cut_at_its_deadline(
    tmp_path: Path, hosts: Hosts, make_sources: Callable[..., AdapterSources]
) -> None:
    digest = content_digest(hosts.adapter)
    hosts.trickle_s = 0.2  # fast enough for any rate floor of 1 byte/s, far too slow to finish
    sources = make_sources(timeout_s=2.0, min_bytes_per_s=1)
    source = parse_source(f"{hosts.base}/a", sha256=digest, roots=NO_ROOTS)
    started = time.monotonic()
    with pytest.raises(AdapterSourceError, match="cut after") as info:
        await asyncio.wait_for(sources.fetch(source, digest), 60)
    assert time.monotonic() - started < 2.0 + SLACK_S
    assert "within 2s" in info.value.message
    assert cache_listing(tmp_path / "cache") == []


async def test_a_source_under_the_minimum_rate_is_cut_after_its_grace(
    tmp_path: Path, hosts: Hosts, make_sources: Callable[..., AdapterSources]
) -> None:
    digest = content_digest(hosts.adapter)
    hosts.trickle_s = 0.2  # 5 bytes/s
    sources = make_sources(timeout_s=600.0, min_bytes_per_s=1000, grace_s=1.0)
    source = parse_source(f"{hosts.base}/a", sha256=digest, roots=NO_ROOTS)
    started = time.monotonic()
    with pytest.raises(AdapterSourceError, match="average at least 1000 bytes/s"):
        await asyncio.wait_for(sources.fetch(source, digest), 60)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert sources.downloads_running("t") == 0  # its slot is back


class HeldServer(FileServer):
    """A :class:`FileServer` whose paths under a held prefix answer only once released."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, asyncio.Event] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        prefix = request.match_info["path"].partition("/")[0]
        if prefix in self.held:
            self.hits[request.match_info["path"]] += 1
            await self.held[prefix].wait()
            self.hits[request.match_info["path"]] -= 1  # counted once, by FileServer.handle
        return await super().handle(request)


async def test_one_tenants_downloads_wait_for_its_own_slots_only(
    tmp_path: Path, make_sources: Callable[..., AdapterSources]
) -> None:
    """Tenant a starts three downloads from a source that does not answer: two take its slots,
    the third waits in a's own line (its source sees no request); tenant b's download of the
    same content from its own source starts and lands at once."""
    server = HeldServer()
    app = web.Application()
    app.router.add_get("/{path:.*}", server.handle)
    runner, server.base = await start_server(app)
    try:
        sources = make_sources()
        uris, digests = [], []
        for i in range(3):
            adapter = make_adapter(tmp_path / f"a{i}", variant=i)
            digests.append(content_digest(adapter))
            uris.append(server.publish(f"slow{i}", adapter))
            server.held[f"slow{i}"] = asyncio.Event()
        b_uri = server.publish("fast", tmp_path / "a2")
        fetches = [
            asyncio.create_task(sources.fetch(parse_source(u, sha256=d, roots=NO_ROOTS), d, owner="a"))
            for u, d in zip(uris, digests, strict=True)
        ]
        for _ in range(500):
            if sum(server.hits.values()) >= 2:
                break
            await asyncio.sleep(0.01)
        b_path = await asyncio.wait_for(
            sources.fetch(parse_source(b_uri, sha256=digests[2], roots=NO_ROOTS), digests[2], owner="b"), 30
        )
        assert b_path.name == digests[2]
        assert sources.downloads_running("a") == 2
        slow_hits = {p.partition("/")[0] for p, n in server.hits.items() if n and p.startswith("slow")}
        assert len(slow_hits) == 2, server.hits  # a's third download has not asked its source yet
        for event in server.held.values():
            event.set()
        assert [p.name for p in await asyncio.gather(*fetches)] == digests
        assert sources.downloads_running("a") == 0
    finally:
        await runner.cleanup()


async def test_a_registration_from_a_trickling_source_is_answered_within_its_deadline(tmp_path, hosts: Hosts):
    """One byte now and then kept a registration pending for minutes: it fails (502) once the
    download's deadline passes, and the server answers everything else meanwhile."""
    digest = content_digest(hosts.adapter)
    hosts.trickle_s = 0.5
    engine = make_engine(
        state_dir=str(tmp_path / "state"), allow_private_adapter_sources=True, adapter_download_timeout_s=2.0
    )
    try:
        async with running_server(engine) as srv:
            body = {"id": "slow", "source": f"{hosts.base}/a", "sha256": digest, "tenant": "alpha"}
            started = time.monotonic()
            pending = asyncio.ensure_future(srv.post("/v1/adapters", body, tenant=None, headers=srv.admin()))
            status, out, _ = await srv.post("/v1/completions", {"model": "acme", "prompt": "Hi", "max_tokens": 4})
            assert status == 200, out
            status, refused, _ = await asyncio.wait_for(pending, 60)
            assert time.monotonic() - started < 2.0 + SLACK_S
            assert status == 502 and refused["error"]["code"] == "adapter_source_failed", refused
            assert_openai_error(refused, 502, "source")
            assert "slow" not in engine.admin.catalog.index.ids()
    finally:
        await engine.close()


async def test_prefetch_goes_on_for_others_while_a_download_is_stuck(tmp_path, files: FileServer):
    """Tenant a's request needs a version whose download does not answer; tenant b's request
    still prefetches b's other recent adapter into host RAM meanwhile (a load waiting on a
    download reads no files, so it holds no prefetch back)."""
    acme = make_adapter(tmp_path / "remote-acme")
    digest = content_digest(acme)
    url = files.publish("r", acme)
    state = str(tmp_path / "state")
    first = make_engine(state_dir=state, allow_private_adapter_sources=True)
    await first.register_adapter("r", url, owner="alpha", sha256=digest)
    await first.close()
    shutil.rmtree(Path(state) / "adapter-cache" / digest)  # the next process must download it
    engine = make_engine(state_dir=state, allow_private_adapter_sources=True, max_cpu_loras=1, io_threads=3)
    try:
        for name in ("acme", "globex"):  # b's recent adapters; acme then falls off host RAM
            await collect(engine, "Hi", name, tenant="b")
        await engine.admin.unload("acme")
        assert engine.debug.residency.tier("acme@1") == "disk"
        files.gate.clear()
        stuck = asyncio.create_task(collect(engine, "Hi", "r", tenant="alpha"))
        for _ in range(500):
            if files.hits:
                break
            await asyncio.sleep(0.01)
        assert files.hits, "the download did not start"
        await collect(engine, "Hi", "globex", tenant="b")  # queues a prefetch of acme for b
        for _ in range(500):
            if engine.debug.residency.prefetch.counts["done"]:
                break
            await asyncio.sleep(0.01)
        assert engine.debug.residency.prefetch.counts["done"] == 1 and engine.debug.residency.tier("acme@1") == "ram"
        assert not stuck.done()
        files.gate.set()
        out, _ = await asyncio.wait_for(stuck, 60)
        assert out.finished
    finally:
        files.gate.set()
        await engine.close()
