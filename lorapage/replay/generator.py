"""``lorapage replay gen``: a seeded synthetic trace.

Arrivals are a renewal process of Gamma gaps (coefficient of variation ``cv``: 1 is Poisson,
above 1 bursty) at ``rate`` requests/s, optionally under a diurnal ramp
``rate(t) = rate * (1 - A cos(2 pi t / P))`` (trough at t = 0, peak at P/2), made by running the
process in operational time and mapping it through the inverse of the integrated rate. Adapters
are Zipf(alpha) over N, tenants own them (:mod:`lorapage.replay.population`), prompt and output
lengths are log-normal, and a fraction of requests start with one of their tenant's shared system
prompts. The defaults are the seed design's shape: 5,000 adapters, 40 req/s at peak, prompts of
750 and outputs of 250 tokens on average, the top 50 adapters taking about 80% of requests
(alpha 1.3); ``scale`` multiplies the rate and the number of adapters.

Each part draws from its own stream of the seed, so changing one option leaves the others' draws
as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lorapage.replay.population import Population
from lorapage.traces.trace import TraceRequest

_GRID = 200_000  # points of the integrated-rate table inverted for the diurnal ramp


@dataclass(frozen=True)
class GenConfig:
    """Every option of the generator (CLI flags of the same names)."""

    seed: int = 0
    scale: float = 1.0  # multiplies rate and adapters
    rate: float = 40.0  # requests/s (the mean; the diurnal ramp's peak is rate * (1 + A))
    duration_s: float | None = 60.0  # how long the trace runs (or num_requests)
    num_requests: int | None = None
    cv: float = 1.0  # coefficient of variation of the gaps: 1 Poisson, > 1 bursty
    diurnal_amplitude: float = 0.0  # A in [0, 1): 0 is a flat rate
    diurnal_period_s: float = 86_400.0
    adapters: int = 5000
    zipf_alpha: float = 1.3
    tenants: int = 50
    tenant_weights: list[float] | None = None  # traffic shares; None: Zipf(tenant_alpha)
    tenant_alpha: float = 1.0
    base_fraction: float = 0.0  # requests to the base model alone
    base_name: str = "base"
    prompt_mean: float = 750.0
    prompt_sigma: float = 0.8  # of the log-normal
    prompt_max: int = 4000
    output_mean: float = 250.0
    output_sigma: float = 0.8
    output_max: int = 2000
    shared_fraction: float = 0.3  # requests starting with a shared system prompt of their tenant
    system_prompt_len: int = 200
    system_prompts_per_tenant: int = 2
    temperature: float | None = None

    def scaled_rate(self) -> float:
        return self.rate * self.scale

    def scaled_adapters(self) -> int:
        return max(1, round(self.adapters * self.scale)) if self.adapters else 0

    def check(self) -> None:
        if self.scaled_rate() <= 0:
            raise ValueError(f"rate * scale must be > 0; got {self.scaled_rate()}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration_s and num_requests")
        if self.cv <= 0:
            raise ValueError(f"cv must be > 0; got {self.cv}")
        if not 0 <= self.diurnal_amplitude < 1:
            raise ValueError(f"diurnal_amplitude must be in [0, 1); got {self.diurnal_amplitude}")
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"shared_fraction must be in [0, 1]; got {self.shared_fraction}")
        if min(self.prompt_mean, self.output_mean) < 1 or min(self.prompt_max, self.output_max) < 1:
            raise ValueError("prompt and output means and maxima must be >= 1")


def integrated_rate(t: np.ndarray, rate: float, amplitude: float, period_s: float) -> np.ndarray:
    """Expected arrivals by time ``t``: the integral of ``rate * (1 - A cos(2 pi s / P))``."""
    w = 2 * math.pi / period_s
    return rate * (t - amplitude * np.sin(w * t) / w)


def arrival_times(rng: np.random.Generator, cfg: GenConfig) -> np.ndarray:
    """Arrival times in seconds, sorted, starting after 0."""
    rate, amp = cfg.scaled_rate(), cfg.diurnal_amplitude
    shape = 1.0 / cfg.cv**2  # Gamma(k, 1/k): mean 1, CV 1/sqrt(k)
    if cfg.num_requests is not None:
        ops = np.cumsum(rng.gamma(shape, 1.0 / shape, size=cfg.num_requests))
    else:
        assert cfg.duration_s is not None
        horizon = float(integrated_rate(np.array(cfg.duration_s), rate, amp, cfg.diurnal_period_s))
        chunks, total = [], 0.0
        while total <= horizon:
            gaps = rng.gamma(shape, 1.0 / shape, size=max(16, int(horizon * 1.1) + 16))
            chunk = total + np.cumsum(gaps)
            chunks.append(chunk)
            total = float(chunk[-1])
        ops = np.concatenate(chunks)
        ops = ops[ops <= horizon]
    if amp == 0:
        return ops / rate
    # Map operational time through the inverse of the integrated rate (monotone since A < 1).
    t_max = float(ops[-1]) / (rate * (1 - amp)) * 1.01 + 1.0 if len(ops) else 1.0  # rate(t) >= rate (1 - A)
    grid = np.linspace(0.0, t_max, _GRID)
    return np.interp(ops, integrated_rate(grid, rate, amp, cfg.diurnal_period_s), grid)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, top: int) -> np.ndarray:
    """Integer lengths in [1, top] from a log-normal of the given mean (before clipping)."""
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, top).astype(np.int64)


def generate(cfg: GenConfig) -> list[TraceRequest]:
    """The trace ``cfg`` describes; the same config gives the same trace."""
    cfg.check()
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(5)]
    times = arrival_times(streams[0], cfg)
    n = len(times)
    population = Population.make(
        num_tenants=min(cfg.tenants, cfg.scaled_adapters()) if cfg.scaled_adapters() else cfg.tenants,
        num_adapters=cfg.scaled_adapters(),
        zipf_alpha=cfg.zipf_alpha,
        tenant_weights=cfg.tenant_weights,
        tenant_alpha=cfg.tenant_alpha,
        base_name=cfg.base_name,
        base_fraction=cfg.base_fraction,
    )
    tenants, models = population.draw(streams[1], n)
    prompts = lognormal_lengths(streams[2], n, cfg.prompt_mean, cfg.prompt_sigma, cfg.prompt_max)
    outputs = lognormal_lengths(streams[3], n, cfg.output_mean, cfg.output_sigma, cfg.output_max)
    shared = streams[4].random(n) < cfg.shared_fraction
    which = streams[4].integers(0, max(1, cfg.system_prompts_per_tenant), size=n)
    out = []
    for i in range(n):
        prefix, prefix_len, prompt_len = None, 0, int(prompts[i])
        if shared[i] and cfg.system_prompt_len > 0:
            prefix, prefix_len = f"{tenants[i]}-sys{which[i]}", cfg.system_prompt_len
            prompt_len += prefix_len  # the drawn length is what follows the system prompt
        out.append(
            TraceRequest(
                arrival_s=round(float(times[i]), 6),
                tenant=tenants[i],
                model=models[i],
                max_tokens=int(outputs[i]),
                prompt_len=prompt_len,
                system_prompt=prefix,
                system_prompt_len=prefix_len,
                output_len=int(outputs[i]),
                temperature=cfg.temperature,
            )
        )
    return out
