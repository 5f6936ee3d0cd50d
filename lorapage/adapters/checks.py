"""Registration's checks: an adapter directory read and held against the base, the shared envelope and the pool.

A version is registered (:meth:`~lorapage.adapters.cache.AdapterCache.add`) only once these
accepted it: its config, tensor names and shapes fit the base model, every weight is finite, its
shape is inside the shared serving envelope (:mod:`lorapage.adapters.envelope`) and its pages fit
the pool beside one full-length sequence. :meth:`AdapterChecks.validate` touches no engine state,
so it may run in any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorapage.adapters.cost import AdapterCost
from lorapage.adapters.envelope import Envelope, ServingTier, describe_shape, full_matrix_refusal, refusal
from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.loader import AdapterLoader
from lorapage.adapters.peft_format import AdapterSpec, load_adapter_tensors, read_adapter_spec
from lorapage.adapters.peft_variants import full_matrix_params, variant_params
from lorapage.errors import AdapterFormatError
from lorapage.memory.pool import PagePool
from lorapage.model.config import ModelConfig


@dataclass(frozen=True)
class AdapterInfo:
    """What callers (the server's admin routes, ``engine.admin.info``) see of an adapter."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    num_params: int
    num_pages: int
    tier: str  # gpu | ram | disk | remote
    # The version this entry serves (filled in by the engine from the catalog).
    adapter_id: str = ""
    version: int = 0
    digest: str = ""
    source: str = ""
    current: bool = False
    created: bool = True  # False: a registration of content an existing version already had
    pinned: bool = False  # pinned resident by an admin (AdapterCache.pin)
    cost: AdapterCost | None = None  # projected cost against the base (lorapage.adapters.cost)
    serving_tier: str = ServingTier.SHARED.value  # from its shape (lorapage.adapters.envelope)
    status: str = "available"  # resident | loading | failed (its last load) | available (loads on demand)
    kept_hot: bool = False  # kept resident for its traffic (tier hot, within the pins' bounds)
    traffic_tier: str = "cold"  # cold | warm | hot, from its hourly traffic (lorapage.adapters.tiers)


class AdapterChecks:
    """What an adapter must be to register on this engine: the base ``model``, the ``pool`` it
    pages into (beside ``sequence_pages`` KV pages of one full-length sequence), ranks up to
    ``max_lora_rank``, shapes inside the shared ``envelope``."""

    def __init__(
        self,
        model: ModelConfig,
        pool: PagePool,
        loader: AdapterLoader,
        max_lora_rank: int,
        envelope: Envelope,
        sequence_pages: int = 0,
        layout_model: ModelConfig | None = None,
    ) -> None:
        self.model, self.pool, self.loader = model, pool, loader
        self.layout_model = layout_model or model  # a tensor-parallel rank's shard of the model
        self.max_lora_rank, self.envelope = max_lora_rank, envelope
        self.sequence_pages = sequence_pages  # KV pages of one full-length sequence: an adapter must fit beside it

    def validate(self, path: str, *, envelope: bool = True) -> tuple[AdapterSpec, AdapterLayout, str]:
        """Read and check an adapter directory: config, tensor names and shapes against the base,
        every weight finite, a shape inside the shared serving envelope (not with ``envelope``
        False: a fleet registers tier ``dedicated`` too, served once promoted) and a size the pool
        can hold; with the content digest of the bytes checked (loads verify against it, so what
        they use is what was checked). Touches no engine state, so it may run in any thread."""
        spec = read_adapter_spec(path, self.model, self.max_lora_rank)
        if envelope:
            self.check_envelope(spec)
        layout = self.plan(spec)
        weights, digest = self.loader.read_verified(spec)
        load_adapter_tensors(spec, self.loader.dtype, weights)  # refuses NaN / Inf weights now, not at a request
        self.loader.finite_digests.add(digest)
        return spec, layout, digest

    def check_envelope(self, spec: AdapterSpec) -> AdapterCost:
        """The adapter's projected cost; refused (400, with that cost and the allowed shapes) when
        its shape is outside the shared envelope. Its tier is then ``dedicated``, which only a
        dedicated deployment serves, and none exists yet: it is never shared silently."""
        cost = self.cost_of(spec)
        if spec.variants.full_matrices:
            raise full_matrix_refusal(str(spec.path), self.envelope, spec.variants.full_matrices, cost)
        if self.envelope.tier(spec.ranks, cost) is ServingTier.DEDICATED:
            raise refusal(str(spec.path), self.envelope, spec.ranks, cost)
        return cost

    def cost_of(self, spec: AdapterSpec) -> AdapterCost:
        """An adapter's projected cost, its PEFT variants included: DoRA / lora_bias vectors, the
        embedding LoRA's B, and any whole matrix (``modules_to_save``) it would read for its rows."""
        v = spec.variants
        return self.envelope.cost(spec.ranks, variant_params(v, self.model) + full_matrix_params(v))

    def tier_of(self, spec: AdapterSpec, cost: AdapterCost) -> ServingTier:
        """The envelope's tier, and ``dedicated`` for any adapter with a whole matrix of its own: the
        shared pool batches low-rank deltas over one base, whose lm_head and embed_tokens every row shares."""
        return ServingTier.DEDICATED if spec.variants.full_matrices else self.envelope.tier(spec.ranks, cost)

    def plan(self, spec: AdapterSpec) -> AdapterLayout:
        """The adapter's page layout, refused when its pages cannot fit in the pool beside one
        full-length sequence's KV blocks: it could never serve a request here."""
        layout = AdapterLayout.plan(spec, self.layout_model, self.pool.adapter_page_size, self.pool.scaled_adapters)
        if layout.num_pages + self.sequence_pages > self.pool.capacity:
            page_bytes = self.pool.page_size * self.pool.storage.element_size()
            shape = describe_shape(spec.max_rank, spec.target_modules, self.model.num_layers)
            raise AdapterFormatError(
                f"adapter at {str(spec.path)!r} does not fit this server's pool: {shape} "
                f"(max_lora_rank {self.max_lora_rank}) needs "
                f"{layout.num_pages} pages of {page_bytes} bytes per layer; with {self.sequence_pages} pages for one "
                f"full-length sequence that is {layout.num_pages + self.sequence_pages}, and the pool has "
                f"{self.pool.capacity} pages. Use a lower rank or fewer modules, or ask the operator for a larger "
                "pool (--num-pages) or a shorter --max-model-len"
            )
        return layout

    def spec_info(self, name: str, spec: AdapterSpec) -> AdapterInfo:
        """What ``spec``'s shape says of version ``name``, registered here or not (one outside the
        envelope, which the cache never holds: tier ``dedicated``, status ``dedicated``)."""
        cost = self.cost_of(spec)
        return AdapterInfo(
            name=name,
            path=str(spec.path),
            rank=spec.max_rank,
            target_modules=spec.target_modules,
            size_bytes=spec.size_bytes,
            num_params=spec.num_params(self.model),
            num_pages=0,
            tier="disk",
            cost=cost,
            serving_tier=self.tier_of(spec, cost).value,
            status="dedicated",
        )
