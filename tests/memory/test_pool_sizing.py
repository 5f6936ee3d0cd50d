"""Auto-sizing the pool from device memory (the arithmetic the engine applies on CUDA)."""

from __future__ import annotations

import pytest

from lorapage.memory.sizing import GIB, pages_for_memory, step_activation_bytes

# Llama-2-7B in bf16 on a 141 GiB H200: 8 MiB pages (32 layers x 16 tokens x 2 x 4096 x 2 bytes).
PAGE = 32 * 2 * 16 * 4096 * 2
TOTAL = 141 * GIB
WEIGHTS = int(12.6 * GIB)
ACT_7B = step_activation_bytes(4096, 64, 4096, 3 * 4096, 11008, 32000, 2)


def test_defaults_for_a_7b_model_are_capped_below_the_device():
    """The configuration asks for 17,633 pages (138 GiB); the pool gets what 90% leaves."""
    want = 1 + 64 * 256 + 32 * 39
    pages = pages_for_memory(want, PAGE, total=TOTAL, free=TOTAL - WEIGHTS, utilization=0.9, activations=ACT_7B)
    assert pages < want
    used = WEIGHTS + ACT_7B + GIB + pages * PAGE
    assert used <= 0.9 * TOTAL < used + PAGE  # as many pages as fit, and no more


def test_a_request_that_fits_is_taken_as_asked():
    assert pages_for_memory(500, PAGE, total=TOTAL, free=TOTAL - WEIGHTS, utilization=0.9, activations=ACT_7B) == 500


def test_other_processes_memory_counts_as_used():
    alone = pages_for_memory(10**6, PAGE, total=TOTAL, free=TOTAL - WEIGHTS, utilization=0.9, activations=ACT_7B)
    shared = pages_for_memory(
        10**6, PAGE, total=TOTAL, free=TOTAL - WEIGHTS - 40 * GIB, utilization=0.9, activations=ACT_7B
    )
    assert alone - shared == 40 * GIB // PAGE or alone - shared == 40 * GIB // PAGE + 1


def test_no_room_is_a_clear_error():
    with pytest.raises(ValueError, match="no memory left for the page pool.*gpu_memory_utilization"):
        pages_for_memory(100, PAGE, total=16 * GIB, free=16 * GIB - 14 * GIB, utilization=0.9, activations=ACT_7B)


def test_activation_bound_grows_with_the_step():
    assert step_activation_bytes(8192, 64, 4096, 12288, 11008, 32000, 2) > ACT_7B > 0
