"""Kernel backend selection: auto / torch / cpu / triton, chosen once, Triton imported only when chosen."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorapage.kernels import KernelOps, select_backend
from lorapage.kernels.backend import CPU_OPS, TORCH_OPS
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.triton_import import triton_available

OPS = ("lora_shrink", "lora_expand", "write_kv", "paged_decode_attention", "prefill_attention")


def test_torch_on_cpu_uses_the_pytorch_ops_and_auto_the_c_kernels() -> None:
    assert select_backend("torch", torch.device("cpu")) is TORCH_OPS
    assert TORCH_OPS.name == "torch"  # what each op computes: tests/kernels/test_lora_torch.py and the kernel tests
    # Where torch runs on OpenMP with its own libgomp (the Linux wheels) and a C compiler is
    # present, the C kernels must build: a broken build would otherwise fall back unnoticed.
    if shutil.which(os.environ.get("CC", "cc")) and (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists():
        assert cpu_kernels() is not None
    want = CPU_OPS if cpu_kernels() is not None else TORCH_OPS
    assert select_backend("auto", torch.device("cpu")) is want
    # The C kernels take float32 only: another dtype gets the PyTorch ops, and asking for them is refused.
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16) is TORCH_OPS
    with pytest.raises(ValueError, match="runs float32 on the CPU"):
        select_backend("cpu", torch.device("cpu"), torch.bfloat16)


def test_without_a_compiler_cpu_falls_back_to_torch(tmp_path) -> None:
    code = (
        "import torch, pytest; from lorapage.kernels import select_backend; "
        "assert select_backend('auto', torch.device('cpu')).name == 'torch'\n"
        "with pytest.raises(ValueError, match='did not build'): select_backend('cpu', torch.device('cpu'))"
    )
    env = os.environ | {"CC": str(tmp_path / "no-such-cc"), "LORAPAGE_KERNEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "CPU LoRA kernels unavailable (no C compiler found" in done.stderr


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
