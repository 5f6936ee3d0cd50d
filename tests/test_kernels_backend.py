"""Kernel backend selection: auto / torch / triton, chosen once, Triton imported only when chosen."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lorapage.kernels import KernelOps, select_backend
from lorapage.kernels.backend import TORCH_OPS
from lorapage.kernels.triton_import import triton_available

OPS = ("lora_shrink", "lora_expand", "write_kv", "paged_decode_attention", "prefill_attention")


def test_torch_and_auto_on_cpu_use_the_pytorch_ops() -> None:
    assert select_backend("torch", torch.device("cpu")) is TORCH_OPS
    assert select_backend("auto", torch.device("cpu")) is TORCH_OPS
    assert TORCH_OPS.name == "torch"  # what each op computes: tests/test_lora_torch.py and the kernel tests


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="kernel_backend"):
        select_backend("cutlass", torch.device("cpu"))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_backend_has_every_op() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = select_backend("triton", device)
    assert isinstance(ops, KernelOps) and ops.name == "triton"
    assert all(callable(getattr(ops, op)) for op in OPS)


@pytest.mark.gpu
def test_auto_on_cuda_is_triton() -> None:
    assert select_backend("auto", torch.device("cuda")).name == "triton"


def test_torch_backend_never_imports_triton() -> None:
    code = (
        "import sys, torch; from lorapage.kernels import select_backend; "
        "select_backend('torch', torch.device('cpu')); select_backend('auto', torch.device('cpu')); "
        "assert 'triton' not in sys.modules, 'triton was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
