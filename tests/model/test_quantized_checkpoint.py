"""Pre-quantized checkpoints (compressed-tensors, written by its own API) against transformers +
compressed-tensors + PEFT on the same checkpoint and adapter: the engine detects the scheme from
config.json and serves the checkpoint's own values and scales.

Bounds: fp8 weights are exact in float32, and lorapage's ``(x @ q.T) * s`` is transformers'
``x @ (q * s).T`` reordered: float32 sums only (1e-4, as every float32 comparison in tests/model).
int8 runs bfloat16 activations into torch's kernel, and w8a8 quantizes each token's activations
as vLLM does (absmax / 127; compressed-tensors' own fake quantization divides by 127.5): their
references round the same way (hooks, tests/ct_checkpoints.py), which leaves float32 sums, and a
rounding those sums can tip (2^-8 of one element, or one int8 step of one activation): 1e-2.
Measured on this CPU: 1.4e-6 (int8) and under 1e-6 (w8a8); against compressed-tensors' unmodified
W8A8 reference the tokens agree and logprobs differ by 0.03 (the two activation roundings)."""

from __future__ import annotations

import functools

import pytest
import torch
from ct_checkpoints import compress_checkpoint, quantize_activations_like_w8a8, round_like_the_int8_kernel
from hf_reference import make_peft_adapter, make_random_llama

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.kernels.linear_fp8 import Fp8Rows, pack_fp8
from lorapage.kernels.linear_int8 import Int8Rows, dequantize
from lorapage.kernels.linear_w8a8_fbgemm import linear_w8a8_fbgemm

pytest.importorskip("compressed_tensors")

PROMPTS = [[5, 9, 17, 33, 60, 2, 8], [100, 3, 41]]
TOKENS = 4
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    src = make_random_llama(root / "float", seed=3)
    return {
        "float": src,
        "adapter": make_peft_adapter(src, root / "adapter", r=8, targets=MODULES, seed=4),
        "int8": compress_checkpoint(src, root / "int8"),
        "int8-packed": compress_checkpoint(src, root / "int8-packed", fmt="pack-quantized"),
        "w8a8": compress_checkpoint(src, root / "w8a8", activations=True),
        "fp8": compress_checkpoint(src, root / "fp8", weight_type="float"),
        # per-tensor scales, and an lm_head quantized too (dequantized at load, as transformers does)
        "fp8-tensor": compress_checkpoint(src, root / "fp8-tensor", weight_type="float", strategy="tensor", ignore=()),
        "int8-partial": compress_checkpoint(src, root / "int8-partial", ignore=("lm_head", "re:.*down_proj")),
    }


def reference(model_dir, adapter_dir, prepare=None):
    """Per prompt, greedy tokens and logprobs from transformers (decompressing the checkpoint) + PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base(torch.tensor([[0]]))  # compressed-tensors decompresses on the first forward (a packed weight too)
    model = PeftModel.from_pretrained(base, adapter_dir)
    if prepare is not None:
        prepare(model)
    out = []
    for prompt in PROMPTS:
        ids, tokens, lps = list(prompt), [], []
        with torch.no_grad():
            for _ in range(TOKENS):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                tokens.append(int(lp.argmax()))
                lps.append(float(lp.max()))
                ids.append(tokens[-1])
        out.append((tokens, lps))
    return out


def served(model_dir, adapter_dir, **config):
    engine = Engine(EngineConfig(model=str(model_dir), num_threads=1, max_lora_rank=16, allow_unbound=True, **config))
    engine.add_adapter("a", str(adapter_dir))
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=0)
    return engine, engine.generate_batch([(p, "a") for p in PROMPTS], params)


@pytest.mark.parametrize(
    "kind, rows, tol",
    [
        ("int8", Int8Rows, 1e-2),
        ("int8-packed", Int8Rows, 1e-2),
        ("w8a8", Int8Rows, 1e-2),
        ("fp8", Fp8Rows, 1e-4),
        ("fp8-tensor", Fp8Rows, 1e-4),
    ],
)
def test_a_compressed_checkpoint_gives_transformers_tokens(ckpts, kind, rows, tol):
    engine, outs = served(ckpts[kind], ckpts["adapter"])
    assert isinstance(engine.debug.runner.ctx.model.layers[0]["qkv"], rows)
    prepare = {"int8": round_like_the_int8_kernel, "w8a8": quantize_activations_like_w8a8}.get(kind[:4])
    if engine.debug.runner.ctx.ops.linear is linear_w8a8_fbgemm:  # this CPU has no int8 dot products
        prepare = functools.partial(quantize_activations_like_w8a8, fbgemm=True)
    for (tokens, lps), out in zip(reference(ckpts[kind], ckpts["adapter"], prepare), outs, strict=True):
        assert out.token_ids == tokens
        assert [x.logprob for x in out.logprobs] == pytest.approx(lps, abs=tol)


def test_the_checkpoint_values_and_scales_are_served_as_they_are(ckpts):
    """The engine's fused q/k/v rows are the checkpoint's int8 values and float32 scales, not a
    dequantized weight quantized again (packed and plain formats alike)."""
    from safetensors.torch import load_file

    state = load_file(str(ckpts["int8"] / "model.safetensors"))
    for kind in ("int8", "int8-packed"):
        qkv = Engine(EngineConfig(model=str(ckpts[kind]), num_threads=1)).debug.runner.ctx.model.layers[1]["qkv"]
        names = [f"model.layers.1.self_attn.{m}_proj" for m in "qkv"]
        assert torch.equal(qkv.as_subclass(torch.Tensor), torch.cat([state[n + ".weight"] for n in names]))
        assert torch.equal(qkv.scales, torch.cat([state[n + ".weight_scale"].reshape(-1) for n in names]))
        assert qkv.scales.dtype == torch.float32  # not bfloat16 values: applied after the kernel


def test_bfloat16_scales_go_into_the_kernel_as_they_are(ckpts, tmp_path):
    """A bf16 model's checkpoint stores bfloat16 scales: they are the kernel's own, unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpts["int8"], tmp_path / "bf16", dirs_exist_ok=True)
    state = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    state = {k: t.bfloat16() if k.endswith("weight_scale") else t for k, t in state.items()}
    save_file(state, str(tmp_path / "bf16" / "model.safetensors"), metadata={"format": "pt"})
    down = Engine(EngineConfig(model=str(tmp_path / "bf16"), num_threads=1)).debug.runner.ctx.model.layers[0]["down"]
    assert down.scales.dtype == torch.bfloat16
    assert torch.equal(down.scales, state["model.layers.0.mlp.down_proj.weight_scale"].reshape(-1))


def test_quantizing_at_load_matches_the_compressed_fp8_checkpoint(ckpts):
    """``quantization fp8`` on the float checkpoint rounds each weight as compressed-tensors does:
    the same tokens and logprobs as the engine serving its fp8 checkpoint."""
    _, at_load = served(ckpts["float"], ckpts["adapter"], quantization="fp8")
    _, stored = served(ckpts["fp8"], ckpts["adapter"])
    assert [o.token_ids for o in at_load] == [o.token_ids for o in stored]
    for a, b in zip(at_load, stored, strict=True):
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)
    engine = Engine(EngineConfig(model=str(ckpts["float"]), quantization="fp8", num_threads=1))
    w = engine.debug.runner.ctx.model.layers[0]["down"]
    assert isinstance(w, Fp8Rows) and torch.equal(dequantize(w), dequantize(pack_fp8(dequantize(w))))


@pytest.mark.parametrize(
    "kind, config, message",
    [
        ("int8", dict(quantization="fp8"), "disagrees with the checkpoint, which is already quantized int8"),
        ("int8", dict(dtype="bfloat16"), "serve it with dtype float32"),
        ("int8-partial", {}, "leaves model.layers.0.mlp.down_proj .* unquantized"),
        ("fp8", dict(tensor_parallel_size=2), "tensor_parallel_size > 1"),
    ],
)
def test_a_checkpoint_the_engine_cannot_serve_as_asked_is_refused(ckpts, kind, config, message):
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model=str(ckpts[kind]), num_threads=1, **config))


def test_the_merge_check_on_a_w8a8_checkpoint_takes_its_schemes_tolerance(ckpts):
    """The dedicated tier on a pre-quantized base: the merged weight (the checkpoint's rows
    dequantized, ``scale B A`` added, quantized again) is compared with the LoRA path at the
    tolerance of the checkpoint's scheme, which the config does not name. (This random adapter
    moves the weights far more than a trained one: whether it passes is the check's verdict.)"""
    import asyncio

    from lorapage.engine.merge_check import QUANTIZED_TOLERANCES, merge_and_check

    engine, _ = served(ckpts["w8a8"], ckpts["adapter"])
    assert engine.config.quantization is None
    check = asyncio.run(merge_and_check(engine, "a", max_tokens=2))
    assert check.tolerance == QUANTIZED_TOLERANCES["w8a8"] and check.prompts > 0
    assert isinstance(engine.debug.runner.ctx.model.layers[0]["qkv"], Int8Rows)
