"""The prepared device check runs end to end on CPU (tiny shapes, Triton interpreter).

On a GPU machine the real ``bench/gpu_check.sh`` is what runs this suite, so this is skipped there.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lorapage.kernels.triton_import import triton_available

ROOT = Path(__file__).resolve().parents[2]
FIGURES = (
    "base_gemm_us",
    "lora_all_distinct_us",
    "lora_all_one_us",
    "ratio_distinct_vs_one_all",
    "fraction_of_base_attention",
    "fraction_of_base_all",
    "fraction_of_copy_bandwidth",
    "target_ratio",
    "target_fraction_attention",
    "target_fraction_all",
    "prefill_attention_speedup",
    "prefill_attention_rel_err",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real check")
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_gpu_check_script_runs_tiny(tmp_path: Path) -> None:
    env = dict(os.environ, GPU_CHECK_TINY="1", OUT=str(tmp_path))
    run = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    summary = lines[max(i for i, line in enumerate(lines) if line.startswith("gpu_check on")) :]
    assert len(summary) == 10, "the summary table must come last"
    assert "fp8 / bf16 weights" in summary[-3] and "requests agree" in summary[-3]
    assert "kernel tests" in summary[1] and "3 passed, 0 failed" in summary[1]
    assert "TP=2 CUDA graphs" in summary[-2] and "skipped" in summary[-2]  # the tiny run uses no second GPU
    assert "bench_kernels.py" in summary[-1] and " ok " in summary[-1]
    bench_lines = (tmp_path / "bench_kernels.log").read_text().strip().splitlines()
    figures = json.loads(bench_lines[-1])  # every bench ends with one JSON object
    assert figures["bench"] == "kernels" and all(key in figures for key in FIGURES)


def test_kernel_tests_need_no_pytest_asyncio() -> None:
    """The device image that runs ``tests/test_kernels_*.py`` has no pytest-asyncio, where an
    ``async def`` test fails outright: those files keep their tests synchronous."""
    import ast

    for path in sorted((ROOT / "tests").glob("test_kernels_*.py")):
        tree = ast.parse(path.read_text())
        async_tests = [n.name for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name.startswith("test_")]
        assert not async_tests, f"{path.name}: {async_tests}"
