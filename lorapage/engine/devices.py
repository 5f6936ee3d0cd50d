"""The engine's device and dtype, from the config's names."""

from __future__ import annotations

import torch

# Keyed by lorapage.config.DTYPE_NAMES.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device for ``EngineConfig.device``; a CUDA device always carries its index, so the
    forward thread and graph capture can be bound to it (a new thread starts on cuda:0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device={name!r} but no CUDA device is available; use 'auto' or 'cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def bind_thread(device: torch.device) -> None:
    """Make ``device`` current in a worker thread: Triton launches on the thread's current device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
