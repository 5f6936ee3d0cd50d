"""A replica of ``k`` tensor-parallel devices in the simulator: its step costs and its pool.

The step-time model (stated, not measured on a multi-GPU machine here):

    step(k) = step(1) / k + 2 L (latency + 2 (k - 1) / k x tokens x hidden x bytes / bus bandwidth)

Every device part of a step divides by ``k``: each rank reads ``1/k`` of the base's weights,
does ``1/k`` of the FLOPs and, with S-LoRA's shards, reads ``1/k`` of each adapter in the batch;
an adapter's copy into the pool moves ``1/k`` of it to each device, over its own link. What does
not divide is the collectives: Megatron's split needs two all-reduces per layer (after ``o_proj``
and after ``down_proj``; the LoRA of a row-parallel projection rides in the same one), each of a
``[tokens, hidden]`` activation. A ring all-reduce moves ``2 (k - 1) / k`` of it through each
device (NCCL's "bus bandwidth" convention), after a fixed latency. Host-side overhead that does
not shrink with ``k`` (Python, launches) is left out: the model is an optimistic bound on what
``k`` devices buy, and the collective term is what it charges for them.

Pool capacity per rank (:func:`tensor_parallel_fleet`): a rank's KV page is ``1/k`` as wide (its
KV heads) and an adapter ``1/k`` as big, so the memory one device held ``N`` pages in holds ``kN``
(more still, since the base's shard frees room: ``lorapage plan`` counts that from device bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lorapage.sim.costs import LoadCosts, StepCosts
from lorapage.sim.fleet import SimFleetConfig

ALL_REDUCES_PER_LAYER = 2  # after o_proj and after down_proj (Megatron's split)


@dataclass(frozen=True)
class Interconnect:
    """What one all-reduce costs between the devices of a replica."""

    name: str
    latency_s: float  # fixed cost of one all-reduce (launch and synchronisation)
    bus_bytes_per_s: float  # ring all-reduce bus bandwidth per device

    def transfer_s(self, nbytes: float, k: int) -> float:
        """The bandwidth part of one all-reduce of ``nbytes`` over ``k`` devices (a ring's)."""
        return 2 * (k - 1) / k * nbytes / self.bus_bytes_per_s

    def all_reduce_s(self, nbytes: float, k: int) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``k`` devices (0 on one)."""
        return 0.0 if k == 1 else self.latency_s + self.transfer_s(nbytes, k)


# Assumed figures for 8 data-centre GPUs on NVLink: ~10 us for a small all-reduce, ~300 GB/s of bus
# bandwidth for large ones. Not measured in this project (no multi-GPU run has fed it).
NVLINK = Interconnect(name="nvlink", latency_s=10e-6, bus_bytes_per_s=300e9)


@dataclass(frozen=True)
class ModelShape:
    """What the collectives' sizes depend on: the decoder's layers and width, and the
    activations' bytes per value."""

    layers: int
    hidden: int
    elem_bytes: int


SEED_7B_SHAPE = ModelShape(layers=32, hidden=4096, elem_bytes=2)  # the gpu-7b costs' model (Llama-2-7B, fp16)


def tensor_parallel_costs(
    costs: StepCosts, k: int, shape: ModelShape = SEED_7B_SHAPE, link: Interconnect = NVLINK
) -> StepCosts:
    """``costs`` of one device, as a replica of ``k`` tensor-parallel devices (the module's model)."""
    if k < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {k}")
    if k == 1:
        return costs
    reduces = ALL_REDUCES_PER_LAYER * shape.layers
    per_token_bytes = shape.hidden * shape.elem_bytes
    return StepCosts(
        name=f"{costs.name}-tp{k}",
        step_s=costs.step_s / k,
        prefill_token_s=costs.prefill_token_s / k,
        decode_row_s=costs.decode_row_s / k,
        lora_step_s=costs.lora_step_s / k,
        lora_adapter_s=costs.lora_adapter_s / k,
        loads=LoadCosts(remote_s=costs.loads.remote_s, disk_s=costs.loads.disk_s, copy_s=costs.loads.copy_s / k),
        collective_step_s=costs.collective_step_s + reduces * link.latency_s,
        collective_token_s=costs.collective_token_s + reduces * link.transfer_s(per_token_bytes, k),
    )


def tensor_parallel_fleet(
    config: SimFleetConfig,
    k: int,
    shape: ModelShape = SEED_7B_SHAPE,
    link: Interconnect = NVLINK,
    *,
    scale_slots: bool = True,
) -> SimFleetConfig:
    """``config``'s fleet with every replica on ``k`` tensor-parallel devices: its step costs as
    :func:`tensor_parallel_costs`, ``k`` times the KV pages and (``scale_slots``; not where the
    operator set ``max_resident_loras``) ``k`` times the lora slots in the same memory per device."""
    if k == 1:
        return config
    residency = config.residency
    if scale_slots:
        residency = replace(residency, max_resident_loras=residency.max_resident_loras * k)
    return replace(
        config,
        costs=tensor_parallel_costs(config.costs, k, shape, link),
        engine=replace(config.engine, num_kv_pages=config.engine.num_kv_pages * k),
        residency=residency,
    )
