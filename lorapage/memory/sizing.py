"""How many pages an auto-sized pool gets: what the configuration asks for, capped by memory.

Pure arithmetic, so it is tested without a device. The engine calls it with the device's numbers
after the weights are loaded (on CUDA: ``torch.cuda.mem_get_info``), as vLLM sizes its KV cache
from ``gpu_memory_utilization``.
"""

from __future__ import annotations

GIB = 1 << 30


def step_activation_bytes(
    tokens: int, rows: int, hidden: int, qkv: int, intermediate: int, vocab: int, elem_bytes: int
) -> int:
    """A generous bound on one step's live activations: the widest intermediates of a layer for
    ``tokens`` tokens (residual, qkv, attention output, gate_up and its product), and float32
    logits for ``rows`` sampled rows. The forward frees each layer's tensors before the next."""
    per_token = (3 * hidden + qkv + 3 * intermediate) * elem_bytes
    return tokens * per_token + rows * vocab * 4


POOL_HEADROOM_BYTES = GIB  # beside a CUDA pool: graphs, cuBLAS workspaces, allocator slack


def pages_for_memory(
    want: int,
    page_bytes: int,
    *,
    total: int,
    free: int,
    utilization: float,
    activations: int,
    headroom: int = POOL_HEADROOM_BYTES,
) -> int:
    """``want`` pages, or fewer if the pool would take the device past ``utilization`` of its
    ``total`` memory, given what is already used (``total - free``: weights and anything else on
    the device), the step's ``activations`` and ``headroom`` (CUDA graphs, cuBLAS workspaces,
    allocator slack). Raises when not even the reserved page 0 and one more fit."""
    used = total - free
    budget = int(total * utilization) - used - activations - headroom
    fits = max(0, budget // page_bytes)
    if fits < 2:
        raise ValueError(
            f"no memory left for the page pool: {total / GIB:.1f} GiB x utilization {utilization} leaves "
            f"{budget / GIB:.2f} GiB after {used / GIB:.1f} GiB in use, {activations / GIB:.2f} GiB of step "
            f"activations and {headroom / GIB:.1f} GiB headroom; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or use a smaller dtype or model"
        )
    return min(want, fits)


def lora_slots(max_loras: int, max_resident_loras: int | None, pool_pages: int, adapter_pages: int, most: int) -> int:
    """Lora slots (rows of the lookup tables): ``max_resident_loras`` when given; else as many
    adapters of ``adapter_pages`` (``max_lora_rank`` on every module) as ``pool_pages`` hold, so
    that pages, not slots, bound residency for such adapters, at least ``max_loras`` (every adapter
    of a batch is resident) and at most ``most`` (the tables grow with the slots)."""
    if max_resident_loras is not None:
        return max_resident_loras
    return max(max_loras, min(most, pool_pages // max(1, adapter_pages)))
