"""The shared serving envelope: which adapter shapes the shared pool serves, as a tier, not a wall.

Seed 000 (§2, §3, R4): an adapter's rank and target modules, chosen where it was trained, move
what it costs every other request by 25x, so the platform costs each adapter at registration
(:mod:`lorapage.adapters.cost`) and sorts it by an envelope: inside it the adapter is tier
``shared`` (batched with every other adapter in the pool); outside it tier ``dedicated``, served
by a deployment of its own with the adapter merged into the base, never silently shared.

The envelope is the configuration's ``shared_envelope`` rules (``MODULES:RANK``: the adapter's
modules all in the class and its highest rank at most RANK; one matching rule suffices) and, when
set, ``shared_max_cost_pct`` (its projected cost at the reference batch at most that); an adapter
must pass both. The design's envelope for its 70B, "rank<=16 attention-only, or rank<=8
all-modules", is exactly its 10% bound at batch 64 on that model (``attention:16,all:8``).

Pure: the caller raises the refusal (:func:`refusal`) where the tier cannot be served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from lorapage.adapters.cost import ATTENTION_MODULES, MLP_MODULES, AdapterCost, project_cost
from lorapage.config import EngineConfig, parse_envelope_rules
from lorapage.errors import AdapterEnvelopeError
from lorapage.model.config import MODULES, ModelConfig
from lorapage.model.moe_config import EXPERT_KINDS, ordered_kinds

# A MoE base's expert modules are MLP modules (named by kind: ``experts.gate_proj``).
MODULE_CLASSES: dict[str, tuple[str, ...]] = {
    "attention": ATTENTION_MODULES,
    "mlp": MLP_MODULES + EXPERT_KINDS,
    "all": MODULES + EXPERT_KINDS,
}
_CLASS_WORDS = {"attention": "attention-only", "mlp": "MLP-only", "all": "on any modules"}


class ServingTier(StrEnum):
    """Where an adapter's requests are served, from its shape (traffic tiers build on it)."""

    SHARED = "shared"  # the shared pool, batched with every other adapter
    DEDICATED = "dedicated"  # a deployment of its own, the adapter merged into the base weights


@dataclass(frozen=True)
class ShapeRule:
    """One ``MODULES:RANK`` rule of the envelope."""

    modules: str  # a key of MODULE_CLASSES
    max_rank: int

    def admits(self, target_modules: Sequence[str], rank: int) -> bool:
        return rank <= self.max_rank and set(target_modules) <= set(MODULE_CLASSES[self.modules])

    def describe(self) -> str:
        return f"rank<={self.max_rank} {_CLASS_WORDS[self.modules]}"


@dataclass(frozen=True)
class Envelope:
    """The shared envelope on one base: what an adapter costs there, and its tier."""

    model: ModelConfig
    rules: tuple[ShapeRule, ...]
    max_cost_pct: float | None  # None: no bound on the projected cost
    reference_batch: int
    base_bytes_per_param: int  # the model's dtype
    adapter_bytes_per_param: int  # the pool's adapter dtype

    @classmethod
    def from_config(cls, config: EngineConfig, model: ModelConfig, base_bytes: int, adapter_bytes: int) -> Envelope:
        """The envelope ``config`` declares, for ``model`` in these element sizes."""
        return cls(
            model=model,
            rules=tuple(ShapeRule(kind, rank) for kind, rank in parse_envelope_rules(config.envelope_rules)),
            max_cost_pct=config.shared_max_cost_pct,
            reference_batch=config.cost_reference_batch,
            base_bytes_per_param=base_bytes,
            adapter_bytes_per_param=adapter_bytes,
        )

    def cost(self, ranks: Mapping[tuple[int, str], int], extra_params: int = 0) -> AdapterCost:
        """The projected cost of an adapter with these ranks ((layer, module) -> r) and
        ``extra_params`` more values read per step (its PEFT variants)."""
        return project_cost(
            self.model,
            ranks,
            reference_batch=self.reference_batch,
            base_bytes_per_param=self.base_bytes_per_param,
            adapter_bytes_per_param=self.adapter_bytes_per_param,
            extra_params=extra_params,
        )

    def tier(self, ranks: Mapping[tuple[int, str], int], cost: AdapterCost) -> ServingTier:
        """``shared`` when the shape passes a rule (if any) and the cost bound (if set)."""
        modules, rank = target_modules(ranks), max(ranks.values(), default=0)
        shape_ok = not self.rules or any(rule.admits(modules, rank) for rule in self.rules)
        cost_ok = self.max_cost_pct is None or cost.projected_cost_pct <= self.max_cost_pct
        return ServingTier.SHARED if shape_ok and cost_ok else ServingTier.DEDICATED

    def allowed(self) -> str:
        """The shared tier's shapes in words: ``rank<=16 attention-only, or rank<=8 on any modules``."""
        parts = [", or ".join(rule.describe() for rule in self.rules)] if self.rules else []
        if self.max_cost_pct is not None:
            parts.append(f"a projected cost <= {self.max_cost_pct:g}% at batch {self.reference_batch}")
        return ", with ".join(parts) or "any shape"


def target_modules(ranks: Mapping[tuple[int, str], int]) -> tuple[str, ...]:
    """The modules an adapter targets, in the model's module order (an expert module by its kind,
    ``experts.gate_proj``, after them)."""
    return ordered_kinds((m for _, m in ranks), MODULES)


def describe_shape(rank: int, modules: Sequence[str], num_layers: int) -> str:
    """``rank 64 on 7 modules (q_proj, ..., down_proj) x 80 layers``: how every refusal of a
    shape (the envelope here, the pool's fit in the adapter cache) names it."""
    plural = "s" * (len(modules) != 1)
    return f"rank {rank} on {len(modules)} module{plural} ({', '.join(modules)}) x {num_layers} layers"


def refusal(
    where: str, envelope: Envelope, ranks: Mapping[tuple[int, str], int], cost: AdapterCost
) -> AdapterEnvelopeError:
    """The 400 for an adapter of tier ``dedicated`` where no dedicated deployment serves it: its
    shape, its arithmetic and the shapes the shared tier takes."""
    shape = describe_shape(max(ranks.values()), target_modules(ranks), envelope.model.num_layers)
    return AdapterEnvelopeError(
        f"adapter at {where!r} is outside the shared serving envelope: {shape} is "
        f"{format_bytes(cost.adapter_bytes)} read per decode step against {format_bytes(cost.base_bytes)} of base "
        f"weights, a projected +{cost.projected_cost_pct:.1f}% decode cost at batch {cost.reference_batch} (each row "
        f"on its own adapter; +{cost.flops_pct:.2f}% FLOPs per token). Allowed on the shared tier: "
        f"{envelope.allowed()}. Its tier is dedicated (a deployment of its own with the adapter merged), and none "
        "is configured here: use a lower rank or fewer modules, or ask the operator to widen --shared-envelope "
        "or --shared-max-cost-pct"
    )


def full_matrix_refusal(
    where: str, envelope: Envelope, matrices: Mapping[str, list[int]], cost: AdapterCost
) -> AdapterEnvelopeError:
    """The 400 for an adapter with ``modules_to_save`` (``matrices``: name -> shape, whole
    matrices of its own): their bytes, its arithmetic, and why the shared tier never takes it."""
    names = ", ".join(f"{name} {shape}" for name, shape in sorted(matrices.items()))
    full = sum(math.prod(shape) for shape in matrices.values()) * envelope.adapter_bytes_per_param
    return AdapterEnvelopeError(
        f"adapter at {where!r} saves whole matrices of its own (modules_to_save: {names}): "
        f"{format_bytes(full)}, read per decode step for its rows beside its LoRA weights, "
        f"{format_bytes(cost.adapter_bytes)} in all against {format_bytes(cost.base_bytes)} of base weights, a "
        f"projected +{cost.projected_cost_pct:.1f}% decode cost at batch {cost.reference_batch}. The shared tier "
        f"batches low-rank deltas over one base whose lm_head and embed_tokens every row shares (it takes "
        f"{envelope.allowed()}), so its tier is dedicated, and none is configured here: serve the merged checkpoint "
        "(PEFT's merge_and_unload) as a base of its own, or retrain without modules_to_save (LoRA on embed_tokens "
        "is served on the shared tier)"
    )


def format_bytes(n: float) -> str:
    """Decimal units, as the design's figures are written: ``80.0 MB``, ``1.66 GB``, ``140 GB``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            v = n / size
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{n:.0f} B"
