"""--lora-dtype int8 under a float32 model (issue 40, item 4): the engine against transformers + PEFT
on what int8 pages hold, and what it refuses.

Each adapter's weights are quantized at load, one float32 scale per rank row (kernels/lora_int8.py).
PEFT loads a copy whose A and B are those dequantized values (and nothing else changed), in
float32 as the engine computes: greedy tokens identical, logprobs within 1e-4, on the C kernels
and on the torch backend, in one heterogeneous batch with the base. The kernels' distance to the
unquantized weights is bounded in tests/kernels/test_lora_int8.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import make_peft_adapter, make_random_llama, peft_greedy
from test_parity import ADAPTERS, WIDE, _prompts

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import AdapterFormatError
from lorapage.kernels.cpu_build import cpu_kernels
from lorapage.kernels.lora_int8 import dequantize_pair

MAX_TOKENS = 5
NAMES = ("attn_r4", "rslora_r16", "pattern_r64", "qko_r8")


def _dequantized(adapter: Path, out: Path) -> Path:
    """A copy of a PEFT adapter directory whose A and B are what int8 pages hold of them."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    weights = load_file(adapter / "adapter_model.safetensors")
    for key in [k for k in weights if "lora_A" in k]:
        b_key = key.replace("lora_A", "lora_B")
        weights[key], weights[b_key] = dequantize_pair(weights[key], weights[b_key])
    save_file(weights, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer base, four adapters (ranks 4-64, rsLoRA, rank and alpha patterns), and PEFT's greedy
    tokens and logprobs of one prompt each (and one for the base) on their dequantized copies."""
    root = tmp_path_factory.mktemp("int8")
    base = make_random_llama(root / "base", layers=2)
    adapters = {}
    for i, name in enumerate(NAMES):
        r, targets, kw = ADAPTERS[name]
        adapters[name] = make_peft_adapter(base, root / name, r=r, targets=targets, seed=i + 1, **kw)
    rows = [*NAMES, None]
    prompts = _prompts(len(rows), seed=9)
    refs = [
        peft_greedy(base, _dequantized(adapters[a], root / f"{a}_dq") if a else None, p, MAX_TOKENS)
        for a, p in zip(rows, prompts)
    ]
    return base, adapters, list(zip(prompts, rows)), refs


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_int8_pages_match_peft_on_the_dequantized_weights(checkpoint, backend):
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("the C kernels did not build here")
    base, adapters, batch, refs = checkpoint
    config = dict(model=str(base), max_lora_rank=64, shared_envelope=WIDE, max_loras=8, block_size=4)
    engine = Engine(EngineConfig(**config, lora_dtype="int8", kernel_backend=backend))
    assert engine.debug.pool.adapter_storage.dtype == torch.int8
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    outs = engine.generate_batch(batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0))
    for (_, adapter), out, (tokens, logprobs) in zip(batch, outs, refs):
        assert out.token_ids == tokens, f"adapter {adapter}"
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=1e-4), f"adapter {adapter}"


def test_int8_pages_refuse_what_they_cannot_hold(checkpoint, tmp_path):
    """PEFT variant data (DoRA here) has no int8 pages: refused at registration, naming the way out."""
    base, _, _, _ = checkpoint
    dora = make_peft_adapter(base, tmp_path / "dora", r=4, targets=["q_proj", "v_proj"], seed=1, use_dora=True)
    engine = Engine(EngineConfig(model=str(base), lora_dtype="int8"))
    with pytest.raises(AdapterFormatError, match="int8 adapter pages .* not PEFT variant data .* bfloat16"):
        engine.add_adapter("dora", dora)


def test_the_triton_backend_refuses_int8_pages(monkeypatch):
    """On CUDA, kernel_backend auto picks triton, which has no int8 kernels: a one-line error naming it."""
    import dataclasses

    from lorapage.kernels import backend

    monkeypatch.setattr(backend, "_select", lambda *a: dataclasses.replace(backend.TORCH_OPS, name="triton"))
    with pytest.raises(ValueError, match="the triton backend cannot read int8 adapter pages"):
        backend.select_backend("auto", torch.device("cpu"), torch.float32, torch.int8)
    assert backend.select_backend("auto", torch.device("cpu"), torch.float32, torch.bfloat16).name == "triton"
