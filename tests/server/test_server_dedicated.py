"""``lorapage serve``'s dedicated tier at runtime, over real HTTP on 127.0.0.1 with the tiny model:
promote starts a merged engine beside the shared one (checked before it takes traffic), its
requests go there with the same greedy tokens, demote routes them back; with ``--auto-promote``
an adapter outside the shared envelope registers and its first request starts its merged engine,
waiting a bounded time (then 503 with Retry-After)."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from hf_reference import make_peft_adapter
from server_harness import assert_openai_error, make_engine, make_roots, running_server

from lorapage import Engine, EngineConfig
from lorapage.sampling_params import SamplingParams
from lorapage.serve.dedicated import LocalDedicated, merged_engine
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMP = "/v1/completions"


def completion(model: str) -> dict:
    return {"model": model, "prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


async def until(srv, name: str, state: str, timeout_s: float = 60.0) -> dict:
    """``GET /v1/adapters/{name}`` once its dedicated deployment is in ``state``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body, _ = await srv.request("GET", f"/v1/adapters/{name}", srv.admin())
        assert status == 200, body
        if (body["dedicated"] or {}).get("state") == state:
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.1)


async def test_promote_serves_the_same_tokens_merged_and_demote_returns_to_the_shared_engine():
    engine = make_engine()
    try:
        async with running_server(engine) as srv:
            status, before, _ = await srv.post(COMP, completion("acme"))
            assert status == 200, before
            status, err, _ = await srv.post("/v1/adapters/acme/promote", {}, tenant="alpha")
            assert status in (401, 403), err  # the admin key only
            status, body, _ = await srv.post("/v1/adapters/acme/promote", {}, tenant=None, headers=srv.admin())
            assert status == 202 and body["dedicated"]["state"] == "starting", body
            status, err, _ = await srv.post("/v1/adapters/acme/promote", {}, tenant=None, headers=srv.admin())
            assert status == 409, err  # one at a time
            assert_openai_error(err, 409, param="id")

            body = await until(srv, "acme", "merged")
            assert body["traffic_tier"] == "merged" and body["dedicated"]["deployment"] == "in-process"
            check = body["dedicated"]["check"]
            assert check["passed"] is True and check["mismatched_prompts"] == 0
            status, merged, _ = await srv.post(COMP, completion("acme"))
            assert status == 200 and merged["choices"][0]["text"] == before["choices"][0]["text"], merged
            status, base, _ = await srv.post(COMP, completion("globex"))  # the others stay on the shared engine
            assert status == 200, base
            status, state, _ = await srv.request("GET", "/internal/state", srv.admin())
            assert state["dedicated"]["acme"]["state"] == "merged"
            status, err, _ = await srv.request("DELETE", "/v1/adapters/acme", srv.admin())
            assert status == 409, err  # demote first

            status, body, _ = await srv.post("/v1/adapters/acme/demote", {}, tenant=None, headers=srv.admin())
            assert status == 200 and body["dedicated"] is None and body["traffic_tier"] != "merged", body
            status, back, _ = await srv.post(COMP, completion("acme"))
            assert status == 200 and back["choices"][0]["text"] == before["choices"][0]["text"]
            status, err, _ = await srv.post("/v1/adapters/acme/demote", {}, tenant=None, headers=srv.admin())
            assert status == 409, err
            status, err, _ = await srv.post("/v1/adapters/no-such/promote", {}, tenant=None, headers=srv.admin())
            assert status == 404, err
            assert_openai_error(err, 404)
            # The merged engine's requests are the adapter's traffic: in the one table.
            status, body, _ = await srv.request("GET", "/v1/adapters/acme", srv.admin())
            assert body["traffic"]["last_24h"]["requests"] == 3
    finally:
        await engine.close()


async def test_outside_the_envelope_the_first_request_starts_its_merged_engine(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(demo_adapter_dirs()["acme"], root / "acme")
    make_peft_adapter(TINY_BASE_DIR, root / "wide", r=32, targets=ALL, seed=7)
    config = EngineConfig(model=str(TINY_BASE_DIR), max_lora_rank=64, shared_envelope="all:16")
    engine = Engine(config, adapter_roots=make_roots(root))
    built: list[float] = []

    def slow_build(primary: Engine) -> Engine:  # a merged engine that takes a while to build
        time.sleep(0.5)
        built.append(time.monotonic())
        return merged_engine(primary)

    dedicated = LocalDedicated(engine, auto=True, wait_s=0.05, build=slow_build)
    try:
        async with running_server(engine, dedicated=dedicated) as srv:
            body = {"id": "wide", "source": str(root / "wide"), "tenant": "alpha"}
            status, created, _ = await srv.post("/v1/adapters", body, tenant=None, headers=srv.admin())
            assert status == 201 and created["serving_tier"] == "dedicated" and created["dedicated"] is None, created

            # The first request starts it and waits 50 ms, less than the build: 503, retry after the wait.
            status, err, headers = await srv.post(COMP, completion("wide"))
            assert status == 503, err
            assert_openai_error(err, 503)
            assert "starting" in err["error"]["message"] and int(headers["Retry-After"]) >= 1
            dedicated.wait_s = 60.0  # the next request waits for the check
            status, answer, _ = await srv.post(COMP, completion("wide"))
            assert status == 200, answer
            assert len(built) == 1  # one merged engine, started by the first request

            body = await until(srv, "wide", "merged")
            assert body["dedicated"]["actor"] == "auto-promotion" and body["traffic_tier"] == "merged"
            # The merged tokens are the adapter's: those of an engine serving it unmerged.
            reference = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_lora_rank=64))
            try:
                reference.add_adapter("wide", root / "wide")
                sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
                out = await reference.run_to_end("Hello there", "wide", sampling)
            finally:
                await reference.close()
            assert answer["choices"][0]["text"] == out.text
            # An adapter inside the envelope is not promoted by its use.
            assert (await srv.post("/v1/adapters", {"id": "acme", "source": str(root / "acme"), "tenant": "alpha"},
                                   tenant=None, headers=srv.admin()))[0] == 201  # fmt: skip
            assert (await srv.post(COMP, completion("acme")))[0] == 200
            assert dedicated.promotions.get("acme") is None
    finally:
        await engine.close()
