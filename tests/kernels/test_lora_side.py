"""The LoRA side thread (kernels/lora_side.py): each update runs on its own thread over a zeroed
delta, one at a time, and an update's error is raised on the thread that waits for it."""

from __future__ import annotations

import threading

import pytest
import torch

from lorapage.kernels.lora_side import LoraSide


def test_an_update_runs_on_the_side_thread_over_a_zeroed_delta():
    side = LoraSide()
    seen: list[tuple[str, float]] = []

    def fn(out: torch.Tensor) -> None:
        seen.append((threading.current_thread().name, float(out.abs().sum())))
        out += torch.arange(out.numel(), dtype=out.dtype).view(out.shape)

    try:
        for rows, cols in ((3, 5), (2, 4), (4, 6)):  # a smaller delta reuses the buffer's garbage
            delta = side.start(rows, cols, fn)
            side.finish()
            assert torch.equal(delta, torch.arange(rows * cols, dtype=torch.float32).view(rows, cols))
        assert [name for name, _ in seen] == ["lorapage-lora-side"] * 3
        assert [total for _, total in seen] == [0.0] * 3  # zeroed before each update
    finally:
        side.close()


def test_an_updates_error_is_raised_by_finish_and_the_thread_goes_on():
    side = LoraSide()

    def broken(out: torch.Tensor) -> None:
        raise RuntimeError("kernel refused")

    try:
        side.start(2, 2, broken)
        with pytest.raises(RuntimeError, match="kernel refused"):
            side.finish()
        delta = side.start(2, 2, lambda out: out.fill_(1.0))
        side.finish()
        assert torch.equal(delta, torch.ones(2, 2))
    finally:
        side.close()


def test_one_update_at_a_time_and_close_ends_the_thread():
    side = LoraSide()
    ran_on: list[threading.Thread] = []
    side.start(1, 1, lambda out: ran_on.append(threading.current_thread()))
    with pytest.raises(AssertionError, match="one update at a time"):
        side.start(1, 1, lambda out: None)
    side.finish()
    assert ran_on[0].is_alive()
    side.close()
    assert not ran_on[0].is_alive()
