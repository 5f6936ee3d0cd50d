"""Who sends what: tenants with traffic weights, each owning some of N adapters whose popularity
is Zipf(alpha). The generator and the importers draw every request's tenant and model from one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def zipf_weights(n: int, alpha: float) -> np.ndarray:
    """Probabilities of ranks 1..n under Zipf(alpha): p_k proportional to k^-alpha."""
    if n < 1:
        raise ValueError(f"need at least one item; got {n}")
    if alpha < 0:
        raise ValueError(f"the Zipf exponent must be >= 0; got {alpha}")
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


def assign_owners(adapter_p: np.ndarray, tenant_w: np.ndarray) -> np.ndarray:
    """Owner (tenant index) of each adapter, so each tenant's traffic share is close to its weight.

    Greedy: adapters from the most popular down each go to the tenant furthest below its share.
    Every tenant gets at least one adapter when there are enough of them.
    """
    target = tenant_w / tenant_w.sum()
    got = np.zeros_like(target)
    owners = np.empty(len(adapter_p), dtype=np.int64)
    for i, p in enumerate(adapter_p):  # adapter_p is sorted, most popular first
        t = int(np.argmax(target - got)) if i >= len(target) else i
        owners[i] = t
        got[t] += p
    return owners


@dataclass(frozen=True, eq=False)
class Population:
    """Tenants, adapters and the draw of one request's (tenant, model)."""

    tenants: tuple[str, ...]
    tenant_weights: tuple[float, ...]  # traffic shares (normalised)
    adapters: tuple[str, ...]  # most popular first
    adapter_p: np.ndarray  # Zipf(alpha) over adapters
    owners: np.ndarray  # adapter index -> tenant index
    base_name: str = "base"
    base_fraction: float = 0.0  # requests that use the base model alone (tenant drawn by weight)

    @classmethod
    def make(
        cls,
        *,
        num_tenants: int,
        num_adapters: int,
        zipf_alpha: float,
        tenant_weights: list[float] | None = None,
        tenant_alpha: float = 1.0,
        base_name: str = "base",
        base_fraction: float = 0.0,
        tenant_prefix: str = "t",
        adapter_prefix: str = "a",
    ) -> Population:
        """``tenant_weights`` (one per tenant) or, when not given, Zipf(``tenant_alpha``) shares."""
        if tenant_weights is not None and len(tenant_weights) != num_tenants:
            raise ValueError(f"{len(tenant_weights)} tenant weights for {num_tenants} tenants")
        if not 0.0 <= base_fraction <= 1.0:
            raise ValueError(f"base_fraction must be in [0, 1]; got {base_fraction}")
        tw = np.asarray(tenant_weights, dtype=np.float64) if tenant_weights else zipf_weights(num_tenants, tenant_alpha)
        if (tw <= 0).any():
            raise ValueError("tenant weights must be > 0")
        tw = tw / tw.sum()
        p = zipf_weights(num_adapters, zipf_alpha) if num_adapters else np.zeros(0)
        td, ad = len(str(num_tenants - 1)), len(str(max(num_adapters - 1, 0)))
        return cls(
            tenants=tuple(f"{tenant_prefix}{i:0{td}d}" for i in range(num_tenants)),
            tenant_weights=tuple(float(w) for w in tw),
            adapters=tuple(f"{adapter_prefix}{i:0{ad}d}" for i in range(num_adapters)),
            adapter_p=p,
            owners=assign_owners(p, tw) if num_adapters else np.zeros(0, dtype=np.int64),
            base_name=base_name,
            base_fraction=base_fraction if num_adapters else 1.0,
        )

    def draw(self, rng: np.random.Generator, n: int) -> tuple[list[str], list[str]]:
        """``n`` requests' tenants and models."""
        use_base = rng.random(n) < self.base_fraction
        picks = rng.choice(len(self.adapters), size=n, p=self.adapter_p) if self.adapters else np.zeros(n, int)
        base_tenants = rng.choice(len(self.tenants), size=n, p=np.asarray(self.tenant_weights))
        tenants, models = [], []
        for i in range(n):
            if use_base[i]:
                tenants.append(self.tenants[base_tenants[i]])
                models.append(self.base_name)
            else:
                tenants.append(self.tenants[self.owners[picks[i]]])
                models.append(self.adapters[picks[i]])
        return tenants, models
