"""Importing Triton the way this process can run it: compiled on CUDA, interpreted without it.

A leaf module: the Triton kernel modules and the backend choice both import it, and it imports
nothing of lorapage, so no module needs a deferred import to break a cycle.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def import_triton() -> ModuleType:
    """``import triton``; on a machine without CUDA, first switch Triton to its interpreter.

    Triton decorates its own standard library when it is imported, so TRITON_INTERPRET must be
    set before the first import, not just before our kernels are decorated. Without CUDA nothing
    in this process could run a compiled Triton kernel anyway, so the switch changes nothing else.
    """
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    return triton


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (on CPU tensors) in this process."""
    knobs = getattr(import_triton(), "knobs", None)  # triton < 3.4 has no knobs: read the variable
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
