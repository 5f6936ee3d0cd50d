"""Logprobs a trainer can use: each sampled token's logprob under the model (``raw_logprobs``)
and under the exact distribution it was drawn from (``processed_logprobs``: after temperature,
top-k and top-p), on a version pushed from memory, equal to transformers + PEFT's on the same
weights within 1e-4 in float32; and a reference model's prompt logprobs (the base, adapter off)
in the same batch."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from hf_reference import make_peft_adapter, make_random_llama, peft_prompt_logprobs
from safetensors.torch import load_file

from lorapage import Engine, EngineConfig, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 9, 17, 33, 60, 2, 8]
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    base = make_random_llama(root / "base", hidden=64, layers=2)
    adapter = make_peft_adapter(base, root / "adapter", r=16, targets=TARGETS, seed=3)
    return base, adapter


def reference_logits(base, adapter, ids: list[int]) -> torch.Tensor:
    """Teacher-forced next-token logits [len(ids), vocab] from transformers + PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' own warpers, in the order generation applies them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = logits[None]
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        x = warper(None, x)
    return x[0]


async def test_sampled_logprobs_raw_and_processed_match_peft(checkpoint):
    base, adapter = checkpoint
    engine = Engine(EngineConfig(model=str(base), dtype="float32", max_lora_rank=16))
    try:
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        config = json.loads((adapter / "adapter_config.json").read_text())
        pushed = await engine.admin.push("policy", tensors, config)
        temperature, top_k, top_p = 0.8, 40, 0.9
        outs = {}
        for mode in ("raw_logprobs", "processed_logprobs", "processed_logits"):
            sampling = SamplingParams(
                max_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p, seed=11, logprobs=0,
                logprobs_mode=mode, ignore_eos=True,
            )  # fmt: skip
            streamed = [o async for o in engine.generate(PROMPT, pushed.key, sampling)]
            outs[mode] = streamed[-1]
            assert len(streamed) > 1  # streamed, each token's logprob as it came
        tokens = outs["raw_logprobs"].token_ids
        moved = 0
        assert outs["processed_logprobs"].token_ids == tokens  # the same seed draws the same rollout
        logits = reference_logits(base, adapter, PROMPT + tokens)[len(PROMPT) - 1 : -1]
        for k, token in enumerate(tokens):
            raw = torch.log_softmax(logits[k], -1)[token]
            scaled = warped(logits[k], temperature, top_k, top_p)
            processed = torch.log_softmax(scaled, -1)[token]
            assert outs["raw_logprobs"].logprobs[k].logprob == pytest.approx(float(raw), abs=TOL)
            assert outs["processed_logprobs"].logprobs[k].logprob == pytest.approx(float(processed), abs=TOL)
            assert outs["processed_logits"].logprobs[k].logprob == pytest.approx(float(scaled[token]), abs=TOL)
            moved += abs(float(processed) - float(raw)) > 1e-3
        assert moved  # the filters moved the mass: the two modes differ
    finally:
        await engine.close()


async def test_greedy_processed_logprobs_are_the_raw_ones(checkpoint):
    base, adapter = checkpoint
    engine = Engine(EngineConfig(model=str(base), dtype="float32", max_lora_rank=16))
    try:
        engine.add_adapter("policy", adapter)
        got = {}
        for mode in ("raw_logprobs", "processed_logprobs"):
            sampling = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, logprobs_mode=mode)
            got[mode] = [o async for o in engine.generate(PROMPT, "policy", sampling)][-1]
        assert [x.logprob for x in got["raw_logprobs"].logprobs] == [
            x.logprob for x in got["processed_logprobs"].logprobs
        ]
    finally:
        await engine.close()


async def test_reference_prompt_logprobs_with_the_base_in_the_same_batch(checkpoint):
    base, adapter = checkpoint
    engine = Engine(EngineConfig(model=str(base), dtype="float32", max_lora_rank=16))
    try:
        engine.add_adapter("policy", adapter)
        rollout = SamplingParams(max_tokens=4, temperature=1.0, seed=2, logprobs=0)
        scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

        async def run(adapter, sampling):
            return [o async for o in engine.generate(PROMPT, adapter, sampling)]

        _, ref_outs = await asyncio.gather(run("policy", rollout), run(None, scoring))  # one batch
        ref = peft_prompt_logprobs(base, None, PROMPT)
        got = ref_outs[-1].prompt_logprobs
        for k in range(1, len(PROMPT)):
            assert got[k].logprob == pytest.approx(float(ref[k - 1, PROMPT[k]]), abs=TOL)
    finally:
        await engine.close()


def test_logprobs_mode_is_checked():
    with pytest.raises(Exception, match="logprobs_mode"):
        SamplingParams(logprobs_mode="final_logprobs")


async def test_the_engine_setting_is_the_default_a_request_may_override(checkpoint):
    base, adapter = checkpoint
    engine = Engine(
        EngineConfig(model=str(base), dtype="float32", max_lora_rank=16, logprobs_mode="processed_logprobs")
    )
    try:
        engine.add_adapter("policy", adapter)
        got = {}
        for mode in (None, "processed_logprobs", "raw_logprobs"):
            sampling = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, seed=4, logprobs=0, logprobs_mode=mode)
            got[mode] = [x.logprob for x in [o async for o in engine.generate(PROMPT, "policy", sampling)][-1].logprobs]
        assert got[None] == got["processed_logprobs"] != got["raw_logprobs"]
    finally:
        await engine.close()
