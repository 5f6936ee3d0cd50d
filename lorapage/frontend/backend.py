"""Where the front end's requests go, as a Protocol: an engine in this process, or the fleet's replicas.

The one HTTP front end (:mod:`lorapage.frontend.app`: routes, auth, quotas, error mapping, health,
SSE, metrics, the request log) is written once; what differs between ``lorapage serve`` and the
fleet's ingress is only where a resolved request runs and what the served bases are. That is this
interface, with two implementations: :class:`lorapage.serve.engine_backend.EngineBackend` (the
engines of ``lorapage serve``, one per base) and :class:`lorapage.fleet.backend.FleetBackend`
(deployment handles to the engine replicas, the fleet's registry, the dedicated deployments).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from lorapage.frontend.auth import Access
from lorapage.frontend.metrics import ServerMetrics
from lorapage.frontend.models_view import ModelsView
from lorapage.model.tokenizer import Tokenizer
from lorapage.request import TokenStream
from lorapage.tenancy.slo import SloTracker
from lorapage.usage.ledger import Key, Usage

if TYPE_CHECKING:
    from lorapage.frontend.generation import Job
    from lorapage.frontend.loop_lag import LoopLagMonitor


class Backend(Protocol):
    """The served bases and where each resolved request runs."""

    tokenizer: Tokenizer  # every base's (they share one: prompts are tokenized before a base is chosen)
    base_name: str  # the primary base's name: a model named nothing else runs on it
    max_model_len: int
    vocab_size: int
    queue_len: int  # requests the engines queue together (a tenant's default share of concurrency)
    tool_call_parser: str  # EngineConfig.tool_call_parser: how the model writes tool calls ("auto": its template's)
    reasoning_parser: str  # EngineConfig.reasoning_parser ("none", "qwen3")

    def server_metrics(self, loop_lag: LoopLagMonitor, slo: SloTracker) -> ServerMetrics:
        """The Prometheus registry ``/metrics`` renders: the front end's series and the engines'."""
        ...

    def models(self, access: Access, started: int, draining: Collection[str]) -> ModelsView:
        """The per-tenant ``/v1/models`` view over the served bases and versions."""
        ...

    def version(self, name: str) -> str:
        """The version key (``id@N``) ``name`` (``id``, ``id@N``, ``id@channel``) serves now;
        AdapterNotFoundError when none, a 409 when its base is not served here."""
        ...

    def base_named(self, model: str) -> str | None:
        """The served base ``model`` names (a base's name or ``NAME:adapter``), if any."""
        ...

    def base_of(self, key: str) -> str | None:
        """The name of the base version ``key`` runs on (None: the primary)."""
        ...

    def max_adapter_tokens(self, adapter: str | None) -> int | None:
        """The bound on a request's adapter tokens (None: none, e.g. a version served merged)."""
        ...

    def outputs(self, job: Job, headers: dict[str, str]) -> TokenStream:
        """The engine outputs of every prompt of ``job``, as one stream; once it has ended,
        ``job.prompt_computed`` holds what the engines computed. ``headers``: filled with what the
        answer should carry besides :func:`~lorapage.frontend.generation.adapter_headers`'."""
        ...

    def record_rejected(self, tenant: str, tokens: int, reason: str) -> None:
        """Count a request refused for ``tenant``'s quota (``rpm``, ``tpm``, ``concurrency``) or a full queue."""
        ...

    def overload_retry_after(self, admissions_per_s: float) -> int | None:
        """The ``Retry-After`` of a 503 for a full queue (None: the refusal's own)."""
        ...

    def finished(self, job: Job) -> None:
        """``job`` ended (answered, refused or cut): what the backend learns from its traffic."""
        ...

    def offer_prompt(self, adapter: str, prompt: list[int]) -> None:
        """A prompt of ``adapter``'s traffic, for its stored check prompts when its owner opted in."""
        ...

    async def usage_rows(self, since_hour: int | None) -> list[tuple[Key, Usage]]:
        """Every engine's usage ledger, summed by (hour, tenant, adapter version)."""
        ...

    def after_request(self) -> None:
        """Called after every answer (an admin change may need mirroring)."""
        ...

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' VTC shares (from the tenants file)."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort an engine request still running at shutdown (its id: ``Job.engine_ids``)."""
        ...

    async def start(self) -> None:
        """Before the first request: background work the backend runs."""
        ...

    async def stop(self) -> None:
        """After the last request: that work stopped, what it held written."""
        ...
