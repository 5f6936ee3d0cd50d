"""``lorapage serve``'s admin operations: the :class:`~lorapage.server.admin_ops.AdminOps` of the
engines in this process.

Every change goes through the primary engine's :class:`~lorapage.engine.admin.AdapterAdmin` (its
registry is the server's; the other bases' engines mirror it after each request,
:meth:`~lorapage.server.engines.Engines.sync`); a registration goes to the engine of the base the
version is bound to (:meth:`~lorapage.server.engines.Engines.register`); pins, loads and unloads
act on the primary's pool (:meth:`~lorapage.server.engines.Engines.on_primary`). A version is
described from the engine of the base it runs on, with its last 24 hours of traffic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from lorapage.adapters.audit import AliasMove, AuditEntry, AuditQuery
from lorapage.adapters.drift_state import CheckPrompts
from lorapage.server.admin import cost_fields
from lorapage.server.check_prompts import store_check_prompts
from lorapage.server.engine_backend import EngineBackend
from lorapage.server.registration import Registration
from lorapage.server.responses import AdapterOut, AdapterVersionOut, TrafficOut
from lorapage.server.state import RouteState

TRAFFIC_HOURS = 24  # GET /v1/adapters/{id} shows this many hours of traffic (the one in progress included)


class LocalAdmin:
    """The admin operations over ``local``'s engines; ``state``: the front end's (requests in flight)."""

    def __init__(self, local: EngineBackend, state: RouteState[Any]) -> None:
        self.local, self.state = local, state
        self.engines, self.admin = local.engines, local.engine.admin
        self.catalog = self.admin.catalog
        self.base_name = local.engine.base_name
        self.roots = self.catalog.roots
        self.samples_traffic = True  # opted-in adapters' prompts are sampled (server/prompt_sampler.py)

    def ids(self) -> list[str]:
        return self.catalog.ids()

    def listed(self) -> list[str]:
        return [info.name for info in self.admin.served()]

    async def describe(self, names: Sequence[str]) -> list[AdapterOut]:
        return [self._describe(name) for name in names]

    def _describe(self, name: str) -> AdapterOut:
        """``name`` (``id``: its current version, or ``id@N``) as the admin routes show it."""
        engine, name = self.engines.serving(name)  # the engine of the base it runs on
        info = engine.admin.info(name)
        versions = self.catalog.versions(info.adapter_id)
        current = next((v.version for v in versions if v.current), None)
        state = self.state
        return AdapterOut(
            id=info.adapter_id,
            owner=state.access.owners.get(info.adapter_id),
            parent=engine.base_name,
            path=info.path,
            rank=info.rank,
            target_modules=list(info.target_modules),
            size_bytes=info.size_bytes,
            num_params=info.num_params,
            tier=info.tier,
            in_flight=state.in_flight.get(info.name, 0),
            pinned=info.pinned,
            version=info.version,
            current=current,
            digest=info.digest,
            source=info.source,
            base_digest=engine.digest,
            versions=[v.version for v in versions],
            traffic_tier=info.traffic_tier,
            kept_hot=info.kept_hot,
            status="draining" if info.name in state.draining else info.status,
            **cost_fields(info),
        )

    async def traffic(self, out: AdapterOut) -> TrafficOut | None:
        rows = await self.admin.traffic(out.id, TRAFFIC_HOURS)
        first_hour = int(self.admin.wall_clock() // 3600) - TRAFFIC_HOURS + 1
        return TrafficOut.of([r for r in rows if r.version == out.version], first_hour)

    def versions(self, adapter_id: str) -> list[AdapterVersionOut]:
        return [
            AdapterVersionOut(
                id=v.key,
                adapter_id=v.adapter_id,
                version=v.version,
                digest=v.digest,
                source=v.source,
                base_digest=v.base_digest,
                created=v.created,
                current=v.current,
                servable=v.servable,
                in_flight=self.state.in_flight.get(v.key, 0),
                projected_cost_pct=v.projected_cost_pct,
            )
            for v in sorted(self.catalog.versions(adapter_id), key=lambda v: v.version)
        ]

    async def register(self, reg: Registration, source: str, actor: str) -> tuple[str, bool]:
        return await self.engines.register(
            reg.id,
            source,
            owner=reg.owner,
            sha256=reg.sha256,
            expected_base_digest=reg.expected_base_digest,
            activate=reg.activate,
            actor=actor,
        )

    async def deploy(self, adapter_id: str, version: int, channel: str, actor: str) -> str:
        info = await self.catalog.deploy(adapter_id, version, channel=channel, actor=actor)
        return f"{adapter_id}@{channel}" if channel else info.key

    async def rollback(self, adapter_id: str, version: int | None, channel: str, actor: str) -> str:
        info = await self.catalog.rollback(adapter_id, version, channel=channel, actor=actor)
        return f"{adapter_id}@{channel}" if channel else info.key

    async def remove_channel(self, adapter_id: str, channel: str, actor: str) -> None:
        await self.catalog.remove_channel(adapter_id, channel, actor=actor)

    def removable(self, name: str) -> list[str]:
        return self.catalog.removable(name)

    async def remove(self, name: str, actor: str) -> None:
        self.catalog.remove(name, actor=actor)

    async def pin(self, name: str, actor: str) -> str:
        return (await self.admin.pin(self.engines.on_primary(name, "pin"), actor=actor)).name

    async def unpin(self, name: str, actor: str) -> str:
        return (await self.admin.unpin(self.engines.on_primary(name, "unpin"), actor=actor)).name

    async def load(self, name: str, actor: str) -> str:
        adapter = self.engines.on_primary(name, "load")
        await self.admin.load(adapter, actor=actor)
        return adapter

    async def unload(self, name: str, actor: str) -> str:
        adapter = self.engines.on_primary(name, "unload")
        await self.admin.unload(adapter, actor=actor)
        return adapter

    async def store_check_prompts(
        self, adapter_id: str, prompts: Sequence[str] | None, sample: bool | None, opt_out: bool | None, actor: str
    ) -> CheckPrompts:
        stored = await store_check_prompts(self.catalog.drift_record, adapter_id, prompts, sample, opt_out, actor)
        self.local.sampler.set_enabled(adapter_id, stored.sample)  # sampled from its traffic from now on, or not
        return stored

    async def check_prompts(self, adapter_id: str) -> CheckPrompts:
        return await asyncio.to_thread(self.catalog.drift_record.check_prompts, adapter_id)

    async def audit(self, query: AuditQuery) -> list[AuditEntry]:
        return await self.catalog.audit(query)

    async def history(self, adapter_id: str, limit: int) -> list[AliasMove]:
        return await self.catalog.history(adapter_id, limit)

    def current(self, adapter_id: str) -> int | None:
        return next((v.version for v in self.catalog.versions(adapter_id) if v.current), None)

    def channels(self, adapter_id: str) -> dict[str, int]:
        return self.catalog.channels(adapter_id)

    def internal_state(self) -> dict[str, Any]:
        state = self.state
        server = {
            "requests_in_flight": len(state.request_ids),
            "in_flight_by_adapter": {k or "none": v for k, v in state.in_flight.items()},
            "draining_adapters": sorted(state.draining),
            "closing": state.closing,
        }
        body: dict[str, Any] = {"engine": self.local.engine.stats(), "server": server}
        if self.engines.several:  # every base's engine, the primary's included
            body["bases"] = {e.base_name: e.stats() for e in self.engines.engines}
        return body
