"""An adapter's check prompts over HTTP: what ``PUT`` and ``GET /v1/adapters/{id}/check_prompts``
(routed in :mod:`lorapage.frontend.admin`) and a registration's ``check_prompts`` do.

The prompts a base upgrade's drift check runs for the adapter (:mod:`lorapage.bases.validation`),
with two owner choices: ``sample`` (the server may keep a bounded sample of the adapter's own
prompts for the check) and ``opt_out`` (never checked, never migrated). The admin key may read and
set any adapter's; a tenant key only those of the adapters registered for it, and any other is
answered as one that does not exist (404). Stored in the registry
(:mod:`lorapage.registry.drift_state`), audited as ``check_prompts`` (the count, never the text);
prompt text is never logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

from aiohttp import web

from lorapage.errors import AdapterNotFoundError
from lorapage.frontend.caller import Admits, admin_or_tenant
from lorapage.registry.drift_state import (
    MAX_CHECK_PROMPTS,
    MAX_PROMPT_BYTES,
    CheckPrompts,
    DriftRecord,
)


def owned_id(state: Admits, ids: Collection[str], request: web.Request) -> str:
    """The route's adapter id (one of ``ids``), when the caller may see it: the admin, or the
    tenant that owns it (one of its requests taken first); else the 404 of an id that does not exist."""
    adapter_id = request.match_info["id"]
    tenant = admin_or_tenant(state, request)
    known = "@" not in adapter_id and adapter_id in ids
    if not known or (tenant is not None and state.access.owners.get(adapter_id) != tenant):
        raise AdapterNotFoundError(f"adapter {adapter_id!r} does not exist; name the id, not a version", param="id")
    return adapter_id


async def store_check_prompts(
    registry: DriftRecord,
    adapter_id: str,
    prompts: Sequence[str] | None,
    sample: bool | None,
    opt_out: bool | None,
    actor: str | None,
) -> CheckPrompts:
    """Replace what is given of ``adapter_id``'s check settings in ``registry`` (None: keep it;
    nothing written when nothing changes), committed in a worker (``lorapage serve``'s engine's
    registry, or the fleet ingress's)."""

    def write() -> CheckPrompts:
        old = registry.check_prompts(adapter_id)
        new = old.updated(prompts, sample, opt_out)
        if new != old:  # a PUT that changes nothing writes nothing, so it adds no audit row
            registry.set_check_prompts(new, actor=actor)
        return new

    return await asyncio.get_running_loop().run_in_executor(None, write)


def check_prompts_body(value: CheckPrompts) -> dict[str, object]:
    """The check settings as ``GET /v1/adapters/{id}/check_prompts`` answers them (serve and fleet)."""
    return {
        "id": value.adapter_id,
        "object": "adapter.check_prompts",
        "prompts": list(value.prompts),
        "sample": value.sample,
        "opt_out": value.opt_out,
        "sampled": len(value.sampled),  # how many; their text is the tenant's traffic, not shown here
        "max_prompts": MAX_CHECK_PROMPTS,
        "max_prompt_bytes": MAX_PROMPT_BYTES,
    }
