"""No cross-tenant side channels through ``lorapage serve``, over a real socket: a tenant cannot
tell from the prefix cache that another sent a prompt (unless their operator grouped them), nor
from ``x-adapter-tier`` that another used an adapter they share. (Request ids: the front end
makes its own; the fleet's test sends two tenants' requests with one ``x-request-id``.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from server_harness import BASE, Server, make_engine, running_server

from lorapage.frontend import Access, hash_key
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.tiny import demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMP = "/v1/completions"
TENANTS = ("a1", "a2", "b", "solo")
SIDE_TOML = f"""
[tenants.a1]
key_sha256 = ["{hash_key("k-a1")}"]
adapters = ["*"]
prefix_cache_group = "family"

[tenants.a2]
key_sha256 = ["{hash_key("k-a2")}"]
adapters = ["*"]
prefix_cache_group = "family"

[tenants.b]
key_sha256 = ["{hash_key("k-b")}"]
adapters = ["*"]

[tenants.solo]  # no shared adapters: the base and `mine`, which the admin registered for it
key_sha256 = ["{hash_key("k-solo")}"]
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv() -> AsyncIterator[Server]:
    engine = make_engine()
    engine.add_adapter("mine", demo_adapter_dirs()["initech"], owner="solo")
    try:
        async with running_server(engine, Access(TenantsConfig.from_toml(SIDE_TOML))) as server:
            yield server
    finally:
        await engine.close()


async def _complete(srv: Server, tenant: str, model: str, prompt: list[int] | str = "hi"):
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    status, payload, headers = await srv.post(COMP, body, tenant=None, headers={"Authorization": f"Bearer k-{tenant}"})
    assert status == 200, payload
    return headers


async def test_a_tenant_gets_no_prefix_hit_on_another_tenants_prompt_unless_grouped(srv):
    """The attack: b sends a prompt, then a1 sends its guess of it; a hit would answer a1's first
    token ~100x sooner (78 ms against 7.9 s) and tell a1 that b sent it. Asserted on the engine's
    per-tenant hit counts, not on time."""
    hits = srv.engine.debug.step_planner.prefix_hit_tokens
    block = srv.engine.config.block_size

    async def hit_tokens(tenant: str, model: str, prompt: list[int]) -> int:
        before = hits.get(tenant, 0)
        await _complete(srv, tenant, model, prompt)
        return hits[tenant] - before

    for n, model in enumerate((BASE, "acme")):  # the base, and an adapter every tenant may use
        prompt = [(7 * i + n) % 200 + 3 for i in range(3 * block + 1)]
        assert await hit_tokens("b", model, prompt) == 0
        assert await hit_tokens("a1", model, prompt) == 0  # b's prompt, a1's right guess: no hit
        assert await hit_tokens("a1", model, prompt) == 3 * block  # its own prompt: the cache still works
        assert await hit_tokens("a2", model, prompt) == 3 * block  # a1's, shared in their group
        assert await hit_tokens("b", model, prompt) == 3 * block


async def test_adapter_tier_is_shown_only_to_the_tenant_no_other_may_use_the_adapter_beside(srv):
    """What b's x-adapter-tier said of globex (disk on its first request, gpu once a1 had warmed
    it) told b that another tenant used globex just before."""
    first = await _complete(srv, "b", "globex")
    assert first["x-adapter-tier"] == "shared"
    for tenant in ("a1", "a1", "b", "a2"):
        headers = await _complete(srv, tenant, "globex")
        assert headers["x-adapter-id"] == "globex" and headers["x-adapter-tier"] == "shared"
    assert (await _complete(srv, "b", BASE))["x-adapter-tier"] == "none"
    # An adapter only its owner may use: where it was tells its owner of nothing but its own use.
    assert (await _complete(srv, "solo", "mine"))["x-adapter-tier"] == "disk"
    assert (await _complete(srv, "solo", "mine"))["x-adapter-tier"] == "gpu"
