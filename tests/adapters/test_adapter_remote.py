"""Adapters registered from remote sources through the admin API, end to end: an https source on
a local aiohttp file server (a wrong checksum, a truncated body, a download that fails when a
request needs it) and an s3 source on moto's S3 server. Bad downloads fail only the requests that
need them; every other request is served."""

from __future__ import annotations

import asyncio
import shutil

from remote_sources import files, s3_bucket, s3_endpoint
from server_harness import assert_openai_error, make_engine, running_server

from lorapage.adapters.digest import content_digest
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

__all__ = ["files", "s3_bucket", "s3_endpoint"]  # fixtures, imported to be found
COMP = "/v1/completions"
WRONG = "0" * 64
WEIGHTS = "adapter_model.safetensors"


def _complete(model: str) -> dict:
    return {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}


async def test_https_source_is_verified_and_a_failed_download_fails_only_its_requests(tmp_path, files):
    acme = demo_adapter_dirs()["acme"]
    url = files.publish("acme-v1", acme)
    digest = content_digest(acme)
    engine = make_engine(state_dir=str(tmp_path / "state"), allow_private_adapter_sources=True)
    async with running_server(engine) as srv:

        async def register(**body):
            return await srv.post("/v1/adapters", {"id": "remote", "tenant": "alpha", **body}, headers=srv.admin())

        status, body, _ = await register(source=url, sha256=WRONG)
        assert status == 502, body
        assert_openai_error(body, 502, "source")
        assert body["error"]["code"] == "adapter_integrity_failed" and digest in body["error"]["message"]
        files.truncate.add("acme-v1/adapter_model.safetensors")
        status, body, _ = await register(source=url, sha256=digest)
        assert status == 502 and body["error"]["code"] == "adapter_source_failed", body
        assert "remote" not in engine.admin.catalog.index.ids()  # nothing half registered
        files.truncate.clear()
        status, body, _ = await register(source=url, sha256=digest)
        assert status == 201 and body["digest"] == digest and body["source"] == url, body
        # The downloaded copy is gone and the source now cuts the body short: the request that
        # needs the adapter fails with 502, the others are served, and a later one retries.
        shutil.rmtree(tmp_path / "state" / "adapter-cache" / digest)
        files.truncate.add("acme-v1/adapter_model.safetensors")
        failing = asyncio.ensure_future(srv.post(COMP, _complete("remote")))
        status, body, _ = await srv.post(COMP, _complete("globex"))
        assert status == 200 and body["choices"][0]["text"] == DEMO_MARKERS["globex"]
        status, body, _ = await failing
        assert status == 502, body
        assert_openai_error(body, 502)
        # The tenant learns the kind of failure, not the server's source, paths or digests.
        message = body["error"]["message"]
        assert body["error"]["code"] == "adapter_source_failed" and "remote@1" in message, body
        assert not any(part in message for part in (url, digest, "127.0.0.1", str(tmp_path))), message
        files.truncate.clear()
        status, body, headers = await srv.post(COMP, _complete("remote"))
        assert status == 200 and body["choices"][0]["text"] == DEMO_MARKERS["acme"], body
        assert headers["x-adapter-tier"] == "disk"
    await engine.close()


async def test_s3_source_registers_and_serves(tmp_path, s3_endpoint, s3_bucket):
    globex = demo_adapter_dirs()["globex"]
    s3_bucket("team/globex", globex)
    engine = make_engine(state_dir=str(tmp_path / "state"), s3_endpoint_url=s3_endpoint)
    async with running_server(engine) as srv:
        body = {"id": "from-s3", "source": "s3://adapters/team/globex", "tenant": "alpha"}
        status, info, _ = await srv.post("/v1/adapters", body, headers=srv.admin())
        assert status == 201, info
        assert info["digest"] == content_digest(globex) and info["source"] == "s3://adapters/team/globex"
        status, out, headers = await srv.post(COMP, _complete("from-s3"))
        assert status == 200 and out["choices"][0]["text"] == DEMO_MARKERS["globex"], out
        assert headers["x-adapter-version"] == "1"
        status, refused, _ = await srv.post(
            "/v1/adapters", {**body, "id": "wrong", "sha256": WRONG}, headers=srv.admin()
        )
        assert status == 502 and refused["error"]["code"] == "adapter_integrity_failed", refused
    await engine.close()


async def test_a_cached_digest_is_no_key_to_another_tenants_adapter(tmp_path, files):
    """alpha's adapter is in the download cache; beta knows its sha256 and names a source that
    cannot serve it: refused as that source fails, not registered from alpha's copy. A source of
    beta's that does serve the content registers (downloaded again, from beta's own source)."""
    acme = demo_adapter_dirs()["acme"]
    url, digest = files.publish("alpha/acme", acme), content_digest(acme)
    engine = make_engine(state_dir=str(tmp_path / "state"), allow_private_adapter_sources=True)
    async with running_server(engine) as srv:

        async def register(adapter_id: str, tenant: str, source: str):
            body = {"id": adapter_id, "tenant": tenant, "source": source, "sha256": digest}
            return await srv.post("/v1/adapters", body, headers=srv.admin())

        assert (await register("alphas", "alpha", url))[0] == 201
        fetched = files.hits[f"alpha/acme/{WEIGHTS}"]
        status, body, _ = await register("stolen", "beta", "http://127.0.0.1:9/nothing-here")
        assert status == 502 and body["error"]["code"] == "adapter_source_failed", body
        assert "stolen" not in engine.admin.catalog.index.ids()
        status, body, _ = await register("stolen", "beta", files.publish("beta/acme", acme))
        assert status == 201, body
        assert files.hits[f"beta/acme/{WEIGHTS}"] == 1  # verified against beta's own source
        assert (await register("again", "alpha", url))[0] == 201  # alpha's own source proved it: the cache serves
        assert files.hits[f"alpha/acme/{WEIGHTS}"] == fetched
        status, body, _ = await srv.post(COMP, _complete("alphas"))
        assert status == 200 and body["choices"][0]["text"] == DEMO_MARKERS["acme"], body
        assert files.hits[f"alpha/acme/{WEIGHTS}"] == fetched  # a registered version loads from the cache
    await engine.close()
