"""A dedicated deployment's replica: the base with one adapter version merged into its weights.

Each replica builds its own :class:`~lorapage.Engine` (the shared envelope off: an adapter
outside it is exactly what a dedicated deployment is for), mirrors the one version it serves from
the fleet's registry (the record the ingress passes; no weights read), and in its constructor runs
:func:`~lorapage.engine.merge_check.merge_and_check`: the stored prompts greedily through the
LoRA path, the merge (:meth:`Engine.merge_into_base`), the same prompts on the plain base path,
tokens and logprobs compared. Ray Serve reports the deployment running only once every replica's
constructor has returned, so by then each replica has its verdict; the ingress reads it
(:meth:`MergedReplica.status`) before it routes a request here. A replica whose check failed
refuses every request (fail closed), whatever the ingress does.

It serves :class:`~lorapage.fleet.messages.EngineJob` streams as an engine replica does, for
its one version only; it does not heartbeat (it mirrors nothing after its start), and answers the
ingress's ``GET /v1/usage`` with its own ledger.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from lorapage.config import EngineConfig
from lorapage.engine import Engine
from lorapage.engine.merge_check import merge_and_check
from lorapage.errors import LorapageError, ServiceUnavailableError
from lorapage.fleet.messages import EngineJob, IdState, ReplicaStart
from lorapage.request import RequestOutput
from lorapage.sources import AdapterRoots
from lorapage.usage.ledger import Key, Usage


@dataclass(frozen=True)
class MergedStatus:
    """What a merged replica found at its start: its check's outcome (``MergeCheck.as_json``),
    or the error that stopped the merge."""

    replica_id: str
    adapter: str  # the version key, id@N
    check: dict | None
    error: str | None

    @property
    def passed(self) -> bool:
        return self.error is None and self.check is not None and bool(self.check["passed"])

    def reason(self) -> str:
        """Why it does not serve (for the adapter's promotion state)."""
        if self.error is not None:
            return f"the merge failed: {self.error}"
        if self.check is None:
            return "no equivalence check ran"
        return f"merge equivalence check failed: {self.check.get('first_mismatch') or 'logprobs out of tolerance'}"


class MergedReplica:
    """One engine holding the base with ``state``'s version merged in, checked before it serves."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self,
        config: EngineConfig,
        adapter_roots: AdapterRoots | None,
        state: IdState,
        prompts: tuple[str, ...],
        tolerance: float | None = None,
    ) -> None:
        self._cache_dir = tempfile.mkdtemp(prefix="lorapage-merged-cache-")
        own = dataclasses.replace(
            config,
            state_dir=None,
            adapter_cache_dir=config.adapter_cache_dir or self._cache_dir,
            shared_envelope="",  # the dedicated tier serves what the shared envelope refuses
            shared_max_cost_pct=None,
            max_adapter_tokens=None,  # the bound of adapter traffic on the shared pool, not here
        )
        self.engine = Engine(own, adapter_roots=adapter_roots)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        (row,) = state.versions
        self.key = row.key
        self.engine.admin.catalog.mirror(state.adapter_id, state.owner, row.version, [row])
        check, error = None, None
        try:
            check = (await merge_and_check(self.engine, self.key, prompts, tolerance=tolerance)).as_json()
        except LorapageError as exc:
            error = exc.message
        self._status = MergedStatus(self.replica_id, self.key, check, error)

    def __del__(self) -> None:
        shutil.rmtree(getattr(self, "_cache_dir", ""), ignore_errors=True)

    def status(self) -> MergedStatus:
        """The check's outcome on this replica."""
        return self._status

    async def usage_rows(self, since_hour: int | None) -> tuple[str, list[tuple[Key, Usage]]]:
        """This replica's id and usage ledger (``Engine.usage_rows``), which the ingress adds to
        the engine replicas' for ``GET /v1/usage``. Async: read on the loop that owns the ledger."""
        return self.replica_id, self.engine.usage_rows(since_hour=since_hour)

    async def generate(self, job: EngineJob) -> AsyncIterator[ReplicaStart | RequestOutput | LorapageError]:
        """As :meth:`EngineReplica.generate <lorapage.fleet.replica.EngineReplica.generate>`, for its
        one version (the engine refuses any other, 404); refused while its check has not passed."""
        yield ReplicaStart(self.replica_id, int(self.key.rpartition("@")[2]))
        if not self._status.passed:
            yield ServiceUnavailableError(
                f"the dedicated deployment of {self.key} does not serve: {self._status.reason()}", retry_after=1
            )
            return
        try:
            async for out in self.engine.generate(
                job.prompt, job.adapter, job.sampling, tenant=job.tenant, request_id=job.request_id,
                prefix_group=job.prefix_group,
            ):  # fmt: skip
                yield out
        except LorapageError as exc:
            yield exc
