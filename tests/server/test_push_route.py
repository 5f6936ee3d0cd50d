"""``POST /v1/adapters/{id}/versions`` over a real socket: a trainer pushes safetensors bytes
(the config in their metadata), samples pinned to a version with ``adapter_version`` (echoed in
the usage and the headers), is refused 409 past ``max_staleness`` and 413 past the body bound."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file
from server_harness import ADMIN_KEY, assert_openai_error, make_engine, read_sse, running_server

from lorapage.registry.push import encode
from lorapage.tiny import demo_adapter_dirs

ACME = demo_adapter_dirs()["acme"]
OCTETS = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/octet-stream"}


def body(step: int) -> bytes:
    tensors = load_file(str(ACME / "adapter_model.safetensors"))
    config = json.loads((ACME / "adapter_config.json").read_text())
    g = torch.Generator().manual_seed(step)
    return encode({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}, config)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv():
    engine = make_engine()
    try:
        async with running_server(engine, max_push_bytes=1 << 20) as server:
            yield server
    finally:
        await engine.close()


async def push(srv, data: bytes, query: str = "", headers: dict | None = None):
    url = f"{srv.url}/v1/adapters/policy/versions{query}"
    async with srv.session.post(url, data=data, headers=headers or OCTETS) as resp:
        return resp.status, await resp.json()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_push_then_sample_pinned(srv):
    status, out = await push(srv, body(1), "?tenant=alpha&max_staleness=1")
    assert (status, out["version"], out["current"]) == (201, 1, 1)
    status, out = await push(srv, body(2))
    assert (status, out["version"], out["current"], out["tier"]) == (201, 2, 2, "gpu")
    status, out = await push(srv, body(2))  # the same bytes: the same version
    assert (status, out["version"]) == (200, 2)
    req = {"model": "policy", "prompt": "hi", "max_tokens": 3, "adapter_version": 1, "logprobs": 0}
    status, answer, headers = await srv.post("/v1/completions", req)
    assert status == 200, answer
    assert answer["model"] == "policy@1" and answer["usage"]["adapter_version"] == 1
    assert headers["x-adapter-version"] == "1"
    status, answer, _ = await srv.post("/v1/chat/completions", {
        "model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "logprobs": True, "logprobs_mode": "processed_logprobs", "temperature": 0.7,
    })  # fmt: skip
    assert status == 200 and answer["usage"]["adapter_version"] == 2
    status, answer, _ = await srv.post("/v1/completions", {**req, "model": "policy@2"})
    assert_openai_error(answer, 400, "adapter_version")
    assert status == 400


async def test_stale_versions_are_refused_409(srv):
    for step in (3, 4):
        assert (await push(srv, body(step)))[0] == 201
    req = {"model": "policy", "prompt": "hi", "max_tokens": 2, "adapter_version": 2}
    status, answer, _ = await srv.post("/v1/completions", req)
    assert status == 409, answer
    assert_openai_error(answer, 409, "adapter_version")
    assert answer["error"]["code"] == "adapter_version_stale"
    status, answer, _ = await srv.post("/v1/completions", {**req, "adapter_version": 3, "stream": True,
                                                            "stream_options": {"include_usage": True}})  # fmt: skip
    assert status == 200
    status, versions, _ = await srv.request("GET", "/v1/adapters/policy/versions", headers=srv.admin())
    assert [v["version"] for v in versions["data"]] == [1, 2, 3, 4]  # the registry keeps them all
    assert [v["servable"] for v in versions["data"]] == [False, False, True, True]


async def test_streamed_usage_carries_the_version(srv):
    req = {"model": "policy", "prompt": "hi", "max_tokens": 2, "stream": True, "logprobs": 0,
           "stream_options": {"include_usage": True}}  # fmt: skip
    async with srv.session.post(srv.url + "/v1/completions", json=req, headers=srv.auth()) as resp:
        chunks = [c async for c in read_sse(resp)]
    assert chunks[-1]["usage"]["adapter_version"] == 4
    assert all(c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"] and c["choices"][0]["text"])


async def test_push_refusals(srv):
    status, answer = await push(srv, b"\0" * ((1 << 20) + 1))
    assert status == 413
    assert_openai_error(answer, 413)
    status, answer = await push(srv, b"junk")
    assert status == 400
    status, answer = await push(srv, body(5), headers={**OCTETS, "Authorization": "Bearer key-alpha"})
    assert status in (401, 403)
    status, answer = await push(srv, body(5), "?max_staleness=x")
    assert_openai_error(answer, 400, "max_staleness")


async def test_the_example_client_pushes_and_samples(srv):
    """scripts/rl_client.py's two calls, as a trainer runs them."""
    import asyncio
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "rl_client.py"
    spec = importlib.util.spec_from_file_location("rl_client", path)
    assert spec is not None and spec.loader is not None
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    tensors = load_file(str(ACME / "adapter_model.safetensors"))
    config = json.loads((ACME / "adapter_config.json").read_text())
    tensors = {k: v * 1.5 for k, v in tensors.items()}
    pushed = await asyncio.to_thread(client.push, srv.url, ADMIN_KEY, "policy", tensors, config, max_staleness=2)
    answer = await asyncio.to_thread(client.rollout, srv.url, "key-alpha", "policy", pushed["version"], "hi", 2, 3)
    assert answer["usage"]["adapter_version"] == pushed["version"]
    assert len(answer["choices"]) == 2 and all(c["logprobs"]["token_logprobs"] for c in answer["choices"])


async def test_a_push_from_shared_memory(srv, tmp_path):
    import os
    import uuid

    from lorapage.frontend.push_route import SHM_DIR, read_shm

    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm here")
    name = f"lorapage-test-{uuid.uuid4().hex}"
    (SHM_DIR / name).write_bytes(body(6))
    try:
        status, out = await push(srv, b"", f"?shm={name}")
        assert status == 201, out
        status, out = await push(srv, b"x", f"?shm={name}")
        assert_openai_error(out, 400, "shm")
        link = SHM_DIR / f"{name}-link"
        os.symlink(tmp_path, link)
        try:
            for bad in ("../etc/passwd", link.name, "missing-" + name):
                with pytest.raises(Exception, match="shm"):
                    read_shm(bad, 1 << 20)
        finally:
            link.unlink()
    finally:
        (SHM_DIR / name).unlink()
