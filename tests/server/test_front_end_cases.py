"""The shared HTTP cases (tests/front_end_cases.py) against ``lorapage serve``'s app over a real
socket; tests/fleet/test_fleet_ray.py runs the same table against the fleet's ingress."""

from __future__ import annotations

import pytest
from front_end_cases import answers, mismatches
from server_harness import server  # noqa: F401  (the module-scoped fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_the_shared_http_cases(server):  # noqa: F811
    assert mismatches(await answers(server.url)) == {}
