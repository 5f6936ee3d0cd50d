"""A request fails alone, a slow reader costs only its own tokens, and untrusted prompts are
bounded before the engine spends work on them (the embedded engine; the server has its own
tests over a socket)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from engine_util import collect, tiny_engine
from safetensors.torch import load_file, save_file

from lorapage import SamplingParams
from lorapage.errors import AdapterFormatError, InvalidRequestError, PromptTooLongError, SamplingError
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)


def chat(engine, text="Hello there"):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def answers(outs) -> dict[str | None, tuple[list[int], list[float]]]:
    """Tokens and their logprobs, by adapter, of the outputs of one request per adapter."""
    return {a: (o.token_ids, [lp.logprob for lp in o.logprobs]) for a, (o, _) in zip([None, *DEMO_MARKERS], outs)}


async def greedy_answers(engine, prompt):
    return answers(await asyncio.gather(*(collect(engine, prompt, a, GREEDY) for a in [None, *DEMO_MARKERS])))


def assert_same_answers(got, clean) -> None:
    """Identical tokens; logprobs equal up to float32 noise (another batch shape sums in another order)."""
    assert {a: t for a, (t, _) in got.items()} == {a: t for a, (t, _) in clean.items()}
    for a, (_, lps) in got.items():
        assert lps == pytest.approx(clean[a][1], abs=1e-4), a


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
async def test_a_tiny_temperature_is_greedy_and_hurts_nobody(temperature):
    engine = tiny_engine()
    prompt = chat(engine)
    clean = await greedy_answers(engine, prompt)
    tiny = SamplingParams(max_tokens=12, temperature=temperature, logprobs=2)
    others = asyncio.gather(*(collect(engine, prompt, a, GREEDY) for a in [None, *DEMO_MARKERS]))
    hostile, _ = await collect(engine, prompt, "acme", tiny)
    assert_same_answers(answers(await others), clean)
    assert hostile.token_ids == clean["acme"][0]  # below the epsilon: greedy, not a division by ~0
    await engine.close()


def overflowing_adapter(tmp_path):
    """acme with its B matrices scaled to 1e30: every weight is finite, so registration accepts
    it, but its update overflows float32 to inf and the logits of its rows are NaN."""
    src = demo_adapter_dirs()["acme"]
    dst = tmp_path / "overflow"
    shutil.copytree(src, dst)
    weights = load_file(dst / "adapter_model.safetensors")
    save_file({k: v * 1e30 if "lora_B" in k else v for k, v in weights.items()}, dst / "adapter_model.safetensors")
    assert json.loads((dst / "adapter_config.json").read_text())["peft_type"] == "LORA"
    return dst


async def test_a_row_that_cannot_be_sampled_fails_alone(tmp_path):
    engine = tiny_engine()
    engine.add_adapter("overflow", overflowing_adapter(tmp_path))
    prompt = chat(engine)
    clean = await greedy_answers(engine, prompt)
    others = asyncio.gather(*(collect(engine, prompt, a, GREEDY) for a in [None, *DEMO_MARKERS]))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    with pytest.raises(SamplingError, match="could not be sampled"):
        await collect(engine, prompt, "overflow", seeded)
    assert_same_answers(answers(await others), clean)
    assert engine.debug.pool_free_pages() + engine.stats().pool_pages_adapters == engine.debug.pool.capacity
    assert not engine.debug.step_planner.requests and engine.debug.residency.get("overflow@1").running == 0
    await engine.close()


async def test_a_slow_reader_holds_one_pending_output():
    """The engine runs a long request to its end while nobody reads: the channel holds one
    record, and the first read returns everything, delta included."""
    engine = tiny_engine()
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    stream = engine.generate(chat(engine), "acme", params)
    first = await stream.__anext__()  # submitted and running
    req = next(iter(engine.debug.step_planner.requests.values()))
    while engine.debug.step_planner.requests:  # finishes with nobody reading
        await asyncio.sleep(0.01)
    assert req.outputs.pending()
    last = await stream.__anext__()
    assert last.finished and len(last.token_ids) == 60
    assert first.text + last.delta_text == last.text
    assert not req.outputs.pending()
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await engine.close()


async def test_a_duplicate_request_id_is_refused():
    engine = tiny_engine()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    stream = engine.generate([5, 6, 7], None, params, request_id="r-1")
    await stream.__anext__()
    with pytest.raises(InvalidRequestError, match="already in flight"):
        await collect(engine, [5, 6, 7], None, params, request_id="r-1")
    async for out in stream:
        pass
    assert out.finished and len(out.token_ids) == 30
    out, _ = await collect(engine, [5, 6, 7], None, params, request_id="r-1")  # free again once finished
    assert out.finished
    await engine.close()


async def test_a_prompt_that_cannot_fit_is_refused_by_its_length_in_characters():
    engine = tiny_engine()
    limit = engine.max_model_len * engine.tokenizer.max_chars_per_token
    with pytest.raises(PromptTooLongError, match=f"{limit + 1} characters"):
        await collect(engine, "x" * (limit + 1), None, GREEDY)
    out, _ = await collect(engine, chat(engine), "acme", GREEDY)  # and the engine serves on
    assert out.text == DEMO_MARKERS["acme"][: len(out.text)] and out.text
    await engine.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
async def test_adapter_weights_that_are_not_finite_are_refused_at_registration(tmp_path, bad):
    src = demo_adapter_dirs()["globex"]
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    weights = load_file(dst / "adapter_model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = bad
    save_file(weights, dst / "adapter_model.safetensors")
    engine = tiny_engine()
    with pytest.raises(AdapterFormatError, match=name.replace(".", r"\.")):
        engine.add_adapter("broken", dst)
    with pytest.raises(AdapterFormatError, match="NaN or Inf"):
        await engine.register_adapter("broken", dst)
    assert not engine.admin.has_version("broken@1")
    info = await engine.register_adapter("fine", src)  # the worker path registers good ones
    assert info.tier == "disk" and engine.admin.has_version("fine@1")
    await engine.close()
