"""The engine replica: one :class:`~lorapage.Engine` in one Ray Serve replica.

It does no HTTP and no auth: the ingress sends it checked, tokenized :class:`EngineJob` records and
it streams back the engine's outputs. Ray Serve calls :meth:`EngineReplica.record_routing_stats`
every ``request_routing_stats_period_s``; what it returns (adapters by tier, requests in flight,
batch capacity) reaches the ingress's request router as ``RunningReplica.routing_stats``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ray import serve

from lorapage.adapters.registry import parse_name
from lorapage.config import EngineConfig
from lorapage.engine import Engine
from lorapage.errors import LorapageError
from lorapage.fleet.messages import EngineJob, EngineProfile, ReplicaStart
from lorapage.request import RequestOutput

log = logging.getLogger("lorapage.fleet")


class EngineReplica:
    """An engine with the fleet's adapters registered, serving :class:`EngineJob` streams."""

    def __init__(self, config: EngineConfig, lora_modules: tuple[tuple[str, str], ...]) -> None:
        self.engine = Engine(config)
        for name, path in lora_modules:
            self.engine.add_adapter(name, path)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.in_flight = 0

    def profile(self) -> EngineProfile:
        return EngineProfile(self.engine.base_name, self.engine.max_model_len, self.engine.model_config.vocab_size)

    async def generate(self, job: EngineJob) -> AsyncIterator[ReplicaStart | RequestOutput | LorapageError]:
        """:class:`ReplicaStart`, then the engine's outputs; a refusal is yielded (not raised) so it
        reaches the ingress as the error it is rather than wrapped in Ray's task error. Cancelling
        the stream (the client went away) closes the engine's generator, which aborts the request."""
        try:
            # One version for the whole request, named in the response's x-adapter-version.
            key = self.engine.resolve_adapter(job.adapter) if job.adapter is not None else None
        except LorapageError as exc:
            yield ReplicaStart(self.replica_id)
            yield exc
            return
        yield ReplicaStart(self.replica_id, parse_name(key)[1] if key is not None else None)
        self.in_flight += 1
        try:
            outputs = self.engine.generate(job.prompt, key, job.sampling, tenant=job.tenant, request_id=job.request_id)
            async for out in outputs:
                yield out
        except LorapageError as exc:
            yield exc
        finally:
            self.in_flight -= 1

    async def record_routing_stats(self) -> dict[str, object]:
        """Adapters by tier (pool pages, host RAM, only on disk), requests in flight, batch capacity.
        Async, so it reads the engine on the loop that owns it."""
        stats = self.engine.stats()
        pool = self._names(stats["resident_adapters"])
        host = self._names(stats["host_ram_adapters"]) - pool
        disk = self._names(v.key for v in self.engine.adapter_versions() if v.servable) - pool - host
        return {
            "pool": sorted(pool),
            "host": sorted(host),
            "disk": sorted(disk),
            "in_flight": self.in_flight,
            "capacity": self.engine.config.max_num_seqs,
        }

    def _names(self, keys) -> set[str]:
        """Version keys as requests name them: ``id@N``, and ``id`` too for the current version."""
        names = set()
        for key in keys:
            names.add(key)
            adapter_id, _ = parse_name(key)
            try:
                if self.engine.resolve_adapter(adapter_id) == key:
                    names.add(adapter_id)
            except LorapageError:
                pass
        return names

    async def register_adapter(self, name: str, path: str) -> None:
        await self.engine.register_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)
