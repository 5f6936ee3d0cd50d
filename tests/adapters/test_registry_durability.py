"""The adapter registry across restarts and ``kill -9``, over a real ``lorapage serve`` subprocess.

Registrations run concurrently while the server is killed at a seeded random moment; after a
restart on the same ``--state-dir`` every registration that was answered 201 is there, with its
owner, version and alias, and serves its adapter's output; every other one is either absent or
just as whole (committed, its answer lost with the process); nothing is half made.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import sqlite3
from pathlib import Path

import aiohttp
import pytest
from server_harness import ADMIN_KEY, KEYS, TENANTS_TOML

from lorapage.registry.store import REGISTRY_FILE
from lorapage.testing.serve_process import ServeProcess, start_serve
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DEMOS = ("acme", "globex", "initech")


def serve(tmp: Path, state: Path, root: Path, tenants: Path) -> ServeProcess:
    """``lorapage serve`` on a free port over ``state`` (killed in the test, or stopped leaving its ``with``)."""
    return start_serve("--state-dir", str(state), "--adapter-root", str(root), "--tenants", str(tenants), under=tmp)


def _setup(tmp_path: Path, n: int) -> tuple[Path, Path, Path]:
    root = tmp_path / "root"
    for i in range(n):
        shutil.copytree(demo_adapter_dirs()[DEMOS[i % 3]], root / f"a{i}")
    for name in DEMOS:
        shutil.copytree(demo_adapter_dirs()[name], root / name)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    return tmp_path / "state", root, tenants


async def _register(session, url: str, adapter_id: str, source: Path, tenant: str = "alpha"):
    body = {"id": adapter_id, "source": str(source), "tenant": tenant}
    async with session.post(f"{url}/v1/adapters", json=body, headers=ADMIN) as resp:
        return resp.status, await resp.json()


async def _complete(session, url: str, model: str, tenant: str = "alpha"):
    body = {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, json.loads(await resp.text()), resp.headers


async def test_registrations_survive_restart_and_kill_9(tmp_path):
    n = 24
    state, root, tenants = _setup(tmp_path, n)
    rng = random.Random(20261201)
    answered: dict[str, int] = {}  # id -> status, for the answers that reached the client
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with serve(tmp_path, state, root, tenants) as first:
            # Committed before the kill: a deploy and a rollback of one id.
            assert (await _register(session, first.url, "cust", root / "acme"))[0] == 201
            assert (await _register(session, first.url, "cust", root / "globex"))[0] == 201
            async with session.put(f"{first.url}/v1/adapters/cust/current", json={"version": 1}, headers=ADMIN) as r:
                assert r.status == 200
            pending = list(range(n))

            async def worker() -> None:
                while pending:
                    i = pending.pop(0)
                    try:
                        status, _ = await _register(session, first.url, f"a{i}", root / f"a{i}")
                    except (TimeoutError, aiohttp.ClientError):
                        return  # the server died under this request
                    answered[f"a{i}"] = status

            workers = [asyncio.ensure_future(worker()) for _ in range(3)]
            answers_before_kill = rng.randint(1, n // 2)  # with up to 3 registrations in flight
            while len(answered) < answers_before_kill:
                await asyncio.sleep(0.001)
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            first.proc.kill()  # no shutdown code runs: what is on disk is all there is
            await asyncio.gather(*workers)
        committed = {i for i, status in answered.items() if status == 201}
        assert committed and len(committed) < n, f"the kill landed outside the registrations: {len(committed)}"
        assert all(status == 201 for status in answered.values()), answered
        with sqlite3.connect(state / REGISTRY_FILE) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)

        with serve(tmp_path, state, root, tenants) as second:
            async with session.get(f"{second.url}/v1/adapters", headers=ADMIN) as resp:
                listed = {a["id"]: a for a in (await resp.json())["data"]}
            assert committed <= set(listed), committed - set(listed)
            for i in range(n):
                adapter_id = f"a{i}"
                if adapter_id not in listed:
                    continue  # never committed: absent, not half there
                info = listed[adapter_id]
                assert (info["owner"], info["version"], info["versions"]) == ("alpha", 1, [1]), info
                status, body, headers = await _complete(session, second.url, adapter_id)
                assert status == 200 and body["choices"][0]["text"] == DEMO_MARKERS[DEMOS[i % 3]], body
                assert headers["x-adapter-version"] == "1"
            # The alias kept its rollback; both versions and the owner came back.
            cust = listed["cust"]
            assert (cust["version"], cust["versions"], cust["owner"]) == (1, [1, 2], "alpha")
            status, body, _ = await _complete(session, second.url, "cust")
            assert body["choices"][0]["text"] == DEMO_MARKERS["acme"]
            status, body, _ = await _complete(session, second.url, "cust@2")
            assert body["choices"][0]["text"] == DEMO_MARKERS["globex"]
            assert (await _complete(session, second.url, "cust", tenant="beta"))[0] == 404
            # The registrations cut off by the kill can be made again, and a clean stop keeps it all.
            for i in range(n):
                if f"a{i}" not in listed:
                    assert (await _register(session, second.url, f"a{i}", root / f"a{i}"))[0] == 201
            assert second.stop() == 0

        with serve(tmp_path, state, root, tenants) as third:
            async with session.get(f"{third.url}/v1/adapters", headers=ADMIN) as resp:
                ids = {a["id"] for a in (await resp.json())["data"]}
            assert ids == {f"a{i}" for i in range(n)} | {"cust"} | set(DEMOS)  # the demo adapters: --lora-modules
