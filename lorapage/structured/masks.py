"""Token bitmasks of constrained rows: filled by llguidance on the host, applied on the device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

_SHIFTS = torch.arange(32, dtype=torch.int32)


class MaskSource(Protocol):
    def fill_mask(self, row_ptr: int, row_bytes: int) -> None: ...


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def fill_bitmask(sources: Sequence[MaskSource], bitmask: Tensor) -> None:
    """Row j of ``bitmask`` (a contiguous int32 CPU tensor) := the allowed tokens of ``sources[j]``."""
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
    row_bytes = bitmask.shape[1] * 4
    for j, source in enumerate(sources):
        source.fill_mask(bitmask[j].data_ptr(), row_bytes)


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """``logits[j, t] = -inf`` wherever bit ``t % 32`` of ``bitmask[j, t // 32]`` is 0, in place:
    ``logits.masked_fill_(((bitmask[:, t // 32] >> (t % 32)) & 1) == 0, -inf)`` for every t.
    ``logits`` [n, V] on any device; ``bitmask`` [n, ceil(V / 32)] int32 (copied to that device)."""
    n, vocab = logits.shape
    assert bitmask.shape == (n, bitmask_words(vocab)) and bitmask.dtype == torch.int32
    words = bitmask.to(logits.device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1  # [n, words, 32]
    allowed = bits.view(n, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
