"""The shared HTTP cases (tests/front_end_cases.py) against ``lorapage serve``'s app over a real
socket; tests/fleet/test_fleet_ray.py runs the same table against the fleet's ingress. Health while
shutting down is asked of both here (the fleet's ingress with no replicas: nothing reaches one)."""

from __future__ import annotations

import pytest
from front_end_cases import answers, mismatches, replica_less_ingress, while_closing
from server_harness import make_access, make_engine, server  # noqa: F401  (the module-scoped fixture)

from lorapage.frontend.run import start
from lorapage.serve.app import create_app

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_the_shared_http_cases(server):  # noqa: F811
    assert mismatches(await answers(server.url)) == {}


@pytest.mark.parametrize("front_end", ["serve", "fleet"])
async def test_health_answers_503_while_shutting_down(front_end: str):
    """A load balancer stops sending requests to a front end that drains (the fleet's ingress once
    answered 200 to the end)."""
    engine = None
    if front_end == "serve":
        engine = make_engine()
        app = create_app(engine, make_access())
    else:
        pytest.importorskip("ray")
        app = replica_less_ingress().app
    runner, port = await start(app, ("127.0.0.1", 0))
    try:
        got = await while_closing(app, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
        if engine is not None:
            await engine.close()
    assert got == {"health": 503, "ping": 503, "health after": 503}
