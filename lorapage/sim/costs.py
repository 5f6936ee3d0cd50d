"""What a step and an adapter load cost on a virtual clock: a GPU model with published constants
and a CPU model calibrated from this machine's engine (sources in ``docs/fleet.md``).

A step's cost is linear in what it does: a fixed part, each prefill token, each decode row, and
the LoRA path (a fixed part once any adapter is in the batch, plus each distinct adapter scaled by
its rank over 16). Copies of adapters into the pool run on the device between steps, so their
seconds are added to the next step. Fetches (object store -> disk -> host RAM) run off the device
and only delay the request that needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What one step computes."""

    prefill_tokens: int  # prompt (and recompute) tokens of the requests admitted in it
    decode_rows: int  # running requests that each decode one token
    adapter_ranks: Sequence[int]  # rank of each distinct adapter in the batch
    copy_s: float = 0.0  # adapter copies into the pool done on the device before it


@dataclass(frozen=True)
class LoadCosts:
    """Seconds to bring one adapter (of rank 16) up a tier; scaled by rank / 16."""

    remote_s: float  # object store -> local disk (tier "remote")
    disk_s: float  # local disk -> host RAM (tier "disk")
    copy_s: float  # host RAM -> pool pages over PCIe (tier "ram"); on the device

    def scaled(self, rank: int) -> LoadCosts:
        f = rank / 16
        return LoadCosts(self.remote_s * f, self.disk_s * f, self.copy_s * f)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a step as a linear function of its :class:`StepShape`, plus load costs."""

    name: str
    step_s: float  # fixed per step (weights read once, launches)
    prefill_token_s: float  # per prompt token
    decode_row_s: float  # per decoding request
    lora_step_s: float  # once per step with any adapter in the batch
    lora_adapter_s: float  # per distinct adapter of rank 16 (scaled by rank / 16)
    loads: LoadCosts
    # Tensor parallelism's collectives (lorapage.sim.tensor_parallel): per step, and per token of
    # the step (prefill tokens and decode rows alike); 0 on one device.
    collective_step_s: float = 0.0
    collective_token_s: float = 0.0

    def time(self, shape: StepShape) -> float:
        lora = self.lora_step_s + self.lora_adapter_s * sum(shape.adapter_ranks) / 16 if shape.adapter_ranks else 0.0
        tokens = shape.prefill_tokens + shape.decode_rows
        return (
            self.step_s
            + self.prefill_token_s * shape.prefill_tokens
            + self.decode_row_s * shape.decode_rows
            + lora
            + shape.copy_s
            + self.collective_step_s
            + self.collective_token_s * tokens
        )

    def decode_tokens_per_s(self, rows: int, distinct: int, rank: int = 16) -> float:
        """Decode throughput of a full batch of ``rows`` requests over ``distinct`` adapters."""
        return rows / self.time(StepShape(0, rows, [rank] * distinct))


# 7B-class base (Llama-2-7B shape) in fp16 on one 80 GB data-centre GPU, rank-16 adapters on every
# linear layer (80 MB). The seed design's figures (seeds/001: 32 requests at 40 ms per step merged,
# 50 ms unmerged; 8,000 prefill tokens/s; 0.4 s object store, 40 ms disk, 8 ms host -> GPU) set the
# sizes; Punica's ~2 ms per step for the batched LoRA path sets the fixed LoRA part. docs/fleet.md
# has the arithmetic and the sources.
GPU_7B = StepCosts(
    name="gpu-7b",
    step_s=0.030,
    prefill_token_s=1 / 8000,
    decode_row_s=0.3125e-3,  # 30 ms + 32 rows -> 40 ms merged
    lora_step_s=2e-3,
    lora_adapter_s=0.25e-3,  # 32 distinct rank-16 adapters: 2 + 8 = 10 ms -> 50 ms unmerged
    loads=LoadCosts(remote_s=0.4, disk_s=0.040, copy_s=0.008),
)


def cpu_costs(step_s: float, prefill_token_s: float, load_s: float) -> StepCosts:
    """A CPU model from what this machine's engine measured: seconds per decode step, per prompt
    token, and to load an adapter from disk. The tiny model's LoRA path and host -> pool copy cost
    little next to Python's per-step overhead, so they are folded into ``step_s``."""
    return StepCosts(
        name="cpu-calibrated",
        step_s=step_s,
        prefill_token_s=prefill_token_s,
        decode_row_s=0.0,
        lora_step_s=0.0,
        lora_adapter_s=0.0,
        loads=LoadCosts(remote_s=0.0, disk_s=load_s, copy_s=0.0),
    )


COSTS = {"gpu-7b": GPU_7B}
