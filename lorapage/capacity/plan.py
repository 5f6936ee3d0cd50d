"""The design's sizing arithmetic for one model, adapter shape, workload and replica: pure.

Seed 001 walks it for a 7B: the adapter's values and bytes, what every adapter and every merged
copy would take, the GPU memory left for adapters once the base, the KV cache of every sequence
and working memory are counted, replicas for decode and prefill with headroom, and host RAM for
the adapters each replica owns. Seed 000 (R3) adds the resident set by Little's law: adapters
pinned by requests in flight ~ distinct arrival rate x duration, and a cache of at least twice
that. Here the distinct adapters in flight come from the popularity: with Poisson arrivals at
rate ``lambda``, adapter ``i`` (share ``p_i``) has ``Poisson(lambda p_i W)`` requests in flight,
so ``sum_i 1 - exp(-lambda p_i W)`` adapters are in flight at once. On one replica of ``R``, an
adapter's traffic split over its ``k_i`` owners, ``sum_i (k_i / R) (1 - exp(-lambda p_i W / k_i))``,
where ``k_i`` is the placement's owners, or more for an adapter with more requests in flight than
its owners take at the fleet's mean load per replica (the router spills it: ``lambda p_i W`` over
``lambda W / R``, at most ``R``).

Step times come from a simulator cost model (:mod:`lorapage.sim.costs`, the seed's by default),
with every row of a full batch on its own adapter, as the seed assumes.

A replica of ``k`` tensor-parallel devices (``Replica.tensor_parallel_size``) is priced the way
seed 003 prices its 70B on 4 devices: every device holds ``1/k`` of the base (vocabulary-parallel
embedding and lm_head included), ``1/k`` of each resident adapter (S-LoRA's shards) and ``1/k`` of
every token's KV (its KV heads), so the GPU-memory figures are one device's; what is left after
the base, the resident adapters and working memory is KV, and its tokens are the replica's (each
device holds its share of the same tokens). Step times are the cost model's at ``k`` devices
(:func:`lorapage.sim.tensor_parallel.tensor_parallel_costs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lorapage.adapters.cost import AdapterCost, adapter_params, base_decode_params
from lorapage.adapters.envelope import Envelope, ServingTier
from lorapage.model.config import ModelConfig
from lorapage.sim.costs import StepCosts


@dataclass(frozen=True)
class Workload:
    """What arrives: a request rate, mean lengths and adapter popularity."""

    rate: float  # requests/s
    prompt_mean: float  # tokens
    output_mean: float  # tokens
    adapters: int  # registered adapters
    popularity: Sequence[float]  # share of requests per adapter (the rest: the base alone)


@dataclass(frozen=True)
class Replica:
    """One replica's hardware and limits, and how the fleet places adapters."""

    device_bytes: float = 80e9
    working_bytes: float = 4e9  # activations, workspaces, allocator slack
    base_bytes: float | None = None  # the base's weights on the device; None: parameters x dtype
    host_bytes: float | None = None  # host RAM for adapters; None: only what placement needs is shown
    max_num_seqs: int = 32
    max_model_len: int = 2000
    block_size: int = 16  # tokens per KV page
    owners: int = 2  # replicas each adapter is placed on
    headroom: float = 0.3  # replicas beyond the arithmetic's
    tensor_parallel_size: int = 1  # devices per replica, each holding 1/k of the base, adapters and KV
    resident_adapters: int | None = None  # seed 003's resident set; None: the registered ones that fit


@dataclass(frozen=True)
class Plan:
    """Every figure the plan prints (bytes, counts, seconds)."""

    # the adapter
    values_per_layer: int
    adapter_values: int
    adapter_bytes: int
    cost: AdapterCost
    tier: ServingTier
    all_adapters_bytes: int
    # GPU memory (one device's: 1/k of the replica's under tensor parallelism)
    base_params: int
    base_bytes: int  # the whole base
    merged_bytes: int
    kv_bytes_per_token: int  # the whole model's
    kv_bytes: int  # on one device: every sequence's share
    left_bytes: float
    adapters_fit: int
    # seed 003's accounting, per device: the base's share, the resident adapters' shards, KV left
    tensor_parallel_size: int
    device_base_bytes: float
    device_adapter_bytes: float  # one adapter's shard
    resident_adapters: int
    device_adapters_bytes: float  # every resident adapter's shard
    device_kv_bytes_per_token: float
    kv_left_bytes: float  # after the base, the resident adapters and working memory
    kv_left_no_adapters_bytes: float
    kv_tokens: int  # tokens the KV left holds (on every device, each its share: the replica's)
    page_bytes: int
    pool_pages: int
    kv_pages: int
    adapter_pages: int  # pages one adapter takes
    pool_adapters: int  # adapters the pool holds beside every sequence's KV
    # replicas
    step_s: float  # a full decode step, every row on its own adapter
    decode_tokens_s: float
    replica_decode_tokens_s: float
    prefill_tokens_s: float
    replica_prefill_tokens_s: float
    replicas_exact: float
    replicas: int
    # host RAM
    adapters_per_replica: float
    host_bytes_per_replica: float
    host_adapters: int | None
    # Little's law
    duration_s: float
    in_flight: float
    in_flight_per_replica: float
    distinct_in_flight: float
    resident_per_replica: float
    cache_adapters: float  # 2x the resident need
    cache_fits: bool


def base_params(model: ModelConfig) -> int:
    """All the base's parameters: what a decode step reads plus an untied embedding table."""
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return base_decode_params(model) + embedding


def distinct_in_flight(rate: float, duration_s: float, popularity: Sequence[float]) -> float:
    """Adapters with a request in flight, on average: ``sum_i 1 - exp(-rate p_i W)``."""
    return sum(-math.expm1(-rate * p * duration_s) for p in popularity)


def resident_per_replica(
    rate: float, duration_s: float, popularity: Sequence[float], replicas: int, owners: int
) -> float:
    """Adapters with a request in flight on one replica, on average, each adapter on its
    ``owners`` replicas, or on as many as its in-flight requests fill at the mean load."""
    mean_load = rate * duration_s / replicas
    total = 0.0
    for p in popularity:
        in_flight = rate * p * duration_s
        k = min(replicas, max(owners, math.ceil(in_flight / mean_load - 1e-9)))
        total += k / replicas * -math.expm1(-in_flight / k)
    return total


def make_plan(
    model: ModelConfig,
    ranks: dict[tuple[int, str], int],
    *,
    base_elem: int,
    adapter_elem: int,
    kv_elem: int | None = None,
    envelope: Envelope,
    workload: Workload,
    replica: Replica,
    costs: StepCosts,
) -> Plan:
    """The seed's arithmetic for this model, adapter shape (``ranks``), workload and replica."""
    values = adapter_params(model, ranks)
    per_layer = max(sum(r * sum(model.lora_dims()[m]) for (layer, m), r in ranks.items() if layer == i)
                    for i in range(model.num_layers))  # fmt: skip
    adapter_bytes = values * adapter_elem
    cost = envelope.cost(ranks)
    params = base_params(model)
    base_bytes = params * base_elem if replica.base_bytes is None else int(replica.base_bytes)
    k = replica.tensor_parallel_size
    device_base = base_bytes / k
    kv_elem = base_elem if kv_elem is None else kv_elem  # kv_cache_dtype's (auto: the model's)
    kv_per_token = 2 * model.num_layers * model.kv_size * kv_elem
    kv_bytes = kv_per_token * replica.max_num_seqs * replica.max_model_len // k
    left = replica.device_bytes - device_base - kv_bytes - replica.working_bytes
    adapters_fit = max(0, int(left // (adapter_bytes / k)))
    held = min(workload.adapters, adapters_fit) if replica.resident_adapters is None else replica.resident_adapters
    kv_left_no_adapters = replica.device_bytes - device_base - replica.working_bytes
    kv_left = kv_left_no_adapters - held * adapter_bytes / k
    # lorapage's pool: a page is block_size tokens of K and V in every layer (in the KV dtype; a
    # rank's page its KV heads only); an adapter's rows in a layer fill whole pages of the same
    # bytes (in its own dtype; a rank's, its 1/k shard).
    layer_page_bytes = 2 * replica.block_size * model.kv_size * kv_elem // k
    page_bytes = layer_page_bytes * model.num_layers
    pool_pages = int(kv_left_no_adapters // page_bytes)
    kv_pages = replica.max_num_seqs * -(-replica.max_model_len // replica.block_size)
    adapter_pages = -(-per_layer * adapter_elem // (k * layer_page_bytes))
    rank = max(ranks.values())
    step_s = replica.max_num_seqs / costs.decode_tokens_per_s(replica.max_num_seqs, replica.max_num_seqs, rank)
    decode, prefill = workload.rate * workload.output_mean, workload.rate * workload.prompt_mean
    replica_decode = replica.max_num_seqs / step_s
    replica_prefill = 1 / (costs.prefill_token_s + costs.collective_token_s)
    exact = decode / replica_decode + prefill / replica_prefill
    replicas = math.ceil(exact * (1 + replica.headroom) - 1e-9)
    owners = min(replica.owners, replicas)
    per_replica = owners * workload.adapters / replicas
    duration = workload.prompt_mean * costs.prefill_token_s + workload.output_mean * step_s
    resident = resident_per_replica(workload.rate, duration, workload.popularity, replicas, owners)
    pool_adapters = max(0, (pool_pages - 1 - kv_pages) // adapter_pages)  # page 0 is the pool's dummy
    return Plan(
        values_per_layer=per_layer,
        adapter_values=values,
        adapter_bytes=adapter_bytes,
        cost=cost,
        tier=envelope.tier(ranks, cost),
        all_adapters_bytes=workload.adapters * adapter_bytes,
        base_params=params,
        base_bytes=base_bytes,
        merged_bytes=workload.adapters * base_bytes,
        kv_bytes_per_token=kv_per_token,
        kv_bytes=kv_bytes,
        left_bytes=left,
        adapters_fit=adapters_fit,
        tensor_parallel_size=k,
        device_base_bytes=device_base,
        device_adapter_bytes=adapter_bytes / k,
        resident_adapters=held,
        device_adapters_bytes=held * adapter_bytes / k,
        device_kv_bytes_per_token=kv_per_token / k,
        kv_left_bytes=kv_left,
        kv_left_no_adapters_bytes=kv_left_no_adapters,
        kv_tokens=max(0, int(kv_left // (kv_per_token / k))),
        page_bytes=page_bytes,
        pool_pages=pool_pages,
        kv_pages=kv_pages,
        adapter_pages=adapter_pages,
        pool_adapters=pool_adapters,
        step_s=step_s,
        decode_tokens_s=decode,
        replica_decode_tokens_s=replica_decode,
        prefill_tokens_s=prefill,
        replica_prefill_tokens_s=replica_prefill,
        replicas_exact=exact,
        replicas=replicas,
        adapters_per_replica=per_replica,
        host_bytes_per_replica=per_replica * adapter_bytes,
        host_adapters=None if replica.host_bytes is None else int(replica.host_bytes // adapter_bytes),
        duration_s=duration,
        in_flight=workload.rate * duration,
        in_flight_per_replica=workload.rate * duration / replicas,
        distinct_in_flight=distinct_in_flight(workload.rate, duration, workload.popularity),
        resident_per_replica=resident,
        cache_adapters=2 * resident,
        cache_fits=2 * resident <= pool_adapters,
    )
