"""What an adapter's shape costs every other request in a decode step: the design's arithmetic.

Seed 000 (§2, §6): a decode step reads the base weights once, shared by every row of the batch,
and each *distinct* adapter in the batch once, shared only by the rows that use it. Decode is
memory-bound, so extra bytes read are extra step time. The projection takes a reference batch of
``B`` rows, each on its own adapter (the worst case, and the design's definition: "at batch 64
with distinct adapters"). Per generated token:

    base bytes per token     = W_base / B        (one read of the base per step, over B rows)
    adapter bytes per token  = W_adapter         (the row's own adapter, read for it alone)

    projected_cost_pct = 100 * B * W_adapter / W_base                  (decode bytes)
    flops_pct          = 100 * P_adapter / P_base                      (per token, any batch)

with ``P_adapter = sum over targeted (layer, module) of r * (d_in + d_out)`` (LoRA's A is
``r x d_in``, B ``d_out x r``), ``P_base`` the parameters one decode step reads (every
projection, the norms and the LM head; the embedding table is gathered by row, not read), and
``W = P x bytes per element`` (adapters in the pool's adapter dtype, the base in the model's).
FLOPs are 2 per parameter per token on both sides, so their ratio has no ``B``: each row computes
its own low-rank product. With ``D <= B`` distinct adapters in a batch the extra bytes are
``D * W_adapter`` (:meth:`AdapterCost.bytes_pct_at`): a batch of 64 rows on one adapter costs one
adapter read, which is why the scheduler groups rows by adapter.

For the design's 70B (80 layers, hidden 8,192, KV 1,024, MLP 28,672, 16-bit) this gives +6.1%
for attention-only rank 8 and +154% for all-modules rank 64 at batch 128, and +77% for the latter
at batch 64 (the seed rounds the base to 140 GB and says +6%, +151% and +75.7%). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lorapage.model.config import MODULES, ModelConfig

DEFAULT_REFERENCE_BATCH = 64  # the design's: "projected +75.7% decode cost at batch 64"
ATTENTION_MODULES = MODULES[:4]
MLP_MODULES = MODULES[4:]


def adapter_params(model: ModelConfig, ranks: Mapping[tuple[int, str], int]) -> int:
    """Values an adapter holds: ``r * (d_in + d_out)`` per targeted (layer, module)."""
    dims = model.module_dims()
    return sum(r * sum(dims[m]) for (_, m), r in ranks.items())


def base_decode_params(model: ModelConfig) -> int:
    """Parameters one decode step reads: every layer's projections and norms, the final norm and
    the LM head (tied or not, it is read whole); the embedding table only by row, so not counted."""
    h = model.hidden_size
    projections = sum(d_in * d_out for d_in, d_out in model.module_dims().values())
    return model.num_layers * (projections + 2 * h) + h + model.vocab_size * h


def uniform_ranks(model: ModelConfig, rank: int, modules: Iterable[str]) -> dict[tuple[int, str], int]:
    """The ranks of an adapter of ``rank`` on ``modules`` of every layer (a shape, no file)."""
    wanted = tuple(modules)
    unknown = [m for m in wanted if m not in MODULES]
    if unknown or not wanted:
        raise ValueError(f"modules must be some of {', '.join(MODULES)}; got {', '.join(wanted) or 'none'}")
    return {(layer, m): rank for layer in range(model.num_layers) for m in wanted}


@dataclass(frozen=True)
class AdapterCost:
    """One adapter's projected cost against its base, at a reference batch."""

    adapter_params: int
    base_params: int  # read by one decode step
    adapter_bytes: int  # read once per step by every batch it is in (in the pool's adapter dtype)
    base_bytes: int  # read once per step, whatever the batch
    reference_batch: int  # rows, each on its own adapter

    @property
    def projected_cost_pct(self) -> float:
        """Extra decode bytes per token at the reference batch, in % of the base's."""
        return self.bytes_pct_at(self.reference_batch)

    @property
    def flops_pct(self) -> float:
        """Extra FLOPs per token, in % of the base's (the same at any batch)."""
        return 100.0 * self.adapter_params / self.base_params

    def bytes_pct_at(self, distinct: int) -> float:
        """Extra decode bytes of a step holding ``distinct`` adapters of this shape, in % of the base read."""
        return 100.0 * distinct * self.adapter_bytes / self.base_bytes


def project_cost(
    model: ModelConfig,
    ranks: Mapping[tuple[int, str], int],
    *,
    reference_batch: int = DEFAULT_REFERENCE_BATCH,
    base_bytes_per_param: int = 2,
    adapter_bytes_per_param: int = 2,
    extra_params: int = 0,
) -> AdapterCost:
    """The cost of an adapter with ``ranks`` ((layer, module) -> r) on ``model``; ``extra_params``
    what its PEFT variants add to a decode step's reads (``peft_variants.variant_params``)."""
    if reference_batch < 1:
        raise ValueError(f"the reference batch must be >= 1; got {reference_batch}")
    params, base = adapter_params(model, ranks) + extra_params, base_decode_params(model)
    return AdapterCost(
        adapter_params=params,
        base_params=base,
        adapter_bytes=params * adapter_bytes_per_param,
        base_bytes=base * base_bytes_per_param,
        reference_batch=reference_batch,
    )
