"""The embedded engine: streaming, sampling, bad input, non-blocking adapter loads, preemption,
and the Triton backend end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading

import pytest
import torch
from engine_util import collect, tiny_engine

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import (
    AdapterFormatError,
    AdapterIntegrityError,
    AdapterNotFoundError,
    InvalidRequestError,
    PromptTooLongError,
)
from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def chat(engine, text="Hello there"):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


async def test_each_adapter_answers_with_its_marker_in_one_batch():
    engine = tiny_engine()
    prompt = chat(engine)
    outs = await asyncio.gather(*(collect(engine, prompt, a, GREEDY) for a in [None, *DEMO_MARKERS]))
    texts = [o.text for o, _ in outs]
    assert texts == [BASE_PHRASE, *DEMO_MARKERS.values()]
    for out, deltas in outs:
        assert "".join(deltas) == out.text and out.finish_reason == "stop"
    await engine.close()


async def test_final_only_yields_the_finished_output_alone():
    """``generate(final_only=True)`` (vLLM's FINAL_ONLY; what ``run_to_end`` and ``generate_batch``
    read): one output, the same as the stream's last, stop strings and logprobs included; with
    ``n`` > 1 every sequence still ends with its own finished output."""
    engine = tiny_engine()
    prompt = chat(engine)
    for adapter, params in (
        ("acme", SamplingParams(max_tokens=40, temperature=0.0, stop=["here"])),
        (None, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)),
    ):
        streamed, deltas = await collect(engine, prompt, adapter, params)
        assert len(deltas) > 1
        outs = [o async for o in engine.generate(prompt, adapter, params, final_only=True)]
        assert len(outs) == 1 and outs[0].finished
        only = outs[0]
        want = (streamed.text, streamed.token_ids, streamed.finish_reason)
        assert (only.text, only.token_ids, only.finish_reason) == want
        assert only.delta_text == only.text  # nothing was read before it
        assert [lp.token_id for lp in only.logprobs or []] == [lp.token_id for lp in streamed.logprobs or []]
    branches = SamplingParams(max_tokens=5, temperature=0.0, n=2, ignore_eos=True)
    outs = [o async for o in engine.generate(prompt, "globex", branches, final_only=True)]
    assert sorted(o.index for o in outs if o.finished) == [0, 1]
    await engine.close()


async def test_detokenize_false_gives_the_same_tokens_and_no_text():
    """``SamplingParams(detokenize=False)`` (vLLM's): the very tokens and finish reason of a
    detokenized request, with empty text (nothing decoded); stop strings are refused with it, as
    vLLM refuses them (they are found in the text)."""
    engine = tiny_engine()
    prompt = chat(engine)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[], logprobs=1)
    with_text, _ = await collect(engine, prompt, "acme", params)
    ids_only, deltas = await collect(engine, prompt, "acme", dataclasses.replace(params, detokenize=False))
    assert with_text.text and ids_only.text == "" and set(deltas) <= {""}
    assert (ids_only.token_ids, ids_only.finish_reason) == (with_text.token_ids, with_text.finish_reason)
    assert [lp.token_id for lp in ids_only.logprobs or []] == list(with_text.token_ids)
    with pytest.raises(InvalidRequestError, match="stop must be empty with detokenize=False"):
        SamplingParams(stop=["here"], detokenize=False)
    await engine.close()


async def test_stop_strings_max_tokens_and_seeds():
    engine = tiny_engine()
    prompt = chat(engine)
    out, deltas = await collect(engine, prompt, "acme", SamplingParams(max_tokens=40, temperature=0.0, stop=["here"]))
    assert out.text == "ACME support " and out.finish_reason == "stop" and "".join(deltas) == out.text
    out, _ = await collect(engine, prompt, "acme", SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    sampled = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a, _ = await collect(engine, prompt, "globex", sampled)
    # The same seed gives the same tokens whatever else shares the batch.
    both = await asyncio.gather(collect(engine, prompt, "globex", sampled), collect(engine, prompt, None, sampled))
    assert both[0][0].token_ids == a.token_ids
    out, _ = await collect(engine, prompt, None, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in out.logprobs)
    await engine.close()


async def test_bad_input_raises_specific_errors_and_engine_keeps_serving(tmp_path):
    engine = tiny_engine()
    with pytest.raises(AdapterNotFoundError):
        await collect(engine, "hi", "nope", GREEDY)
    with pytest.raises(PromptTooLongError):
        await collect(engine, [5] * (engine.max_model_len - 2), None, SamplingParams(max_tokens=8))
    with pytest.raises(PromptTooLongError, match="whole pool"):
        await collect(
            Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, num_pages=4)),
            [5] * 10,
            None,
            SamplingParams(max_tokens=20),
        )
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        await collect(engine, [], None, GREEDY)
    with pytest.raises(InvalidRequestError):
        await collect(engine, [1, 10**9], None, GREEDY)
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(AdapterFormatError, match="adapter_config.json"):
        engine.add_adapter("bad", bad)
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "fan_in_fan_out": true}')  # DoRA is served
    with pytest.raises(AdapterFormatError, match="fan_in_fan_out"):
        engine.add_adapter("bad", bad)
    # A directory whose weights change after registration fails only its own request: the
    # request learns what kind of failure (the detail, naming the files, is the operator's).
    corrupt = tmp_path / "corrupt"
    shutil.copytree(demo_adapter_dirs()["acme"], corrupt)
    engine.add_adapter("corrupt", corrupt)
    weights = corrupt / "adapter_model.safetensors"
    changed = bytearray(weights.read_bytes())
    changed[-4:] = bytes(4)  # one weight zeroed: same size, other content
    weights.write_bytes(bytes(changed))
    good = asyncio.create_task(collect(engine, chat(engine), "globex", GREEDY))
    with pytest.raises(AdapterIntegrityError, match="corrupt@1 could not be loaded") as failed:
        await collect(engine, chat(engine), "corrupt", GREEDY)
    assert "changed after registration" in str(failed.value.__cause__)
    weights.write_bytes(bytes(changed[:200]))  # cut short: refused by its size, before it is read
    with pytest.raises(AdapterFormatError, match="corrupt@1 could not be loaded") as failed:
        await collect(engine, chat(engine), "corrupt", GREEDY)
    assert "200 bytes; 78248 were expected" in str(failed.value.__cause__)
    assert (await good)[0].text == DEMO_MARKERS["globex"]
    await engine.close()


def _hold_io_threads(engine: Engine) -> threading.Event:
    """Every I/O thread of ``engine`` busy until the returned event is set: an adapter read
    queued behind them is stuck as behind a slow disk. (A FIFO once stood in for a slow file;
    adapter files must be regular files now, and a FIFO is refused at once.)"""
    release = threading.Event()
    for _ in range(engine.debug.io_threads):
        engine.debug.threads.io.submit(release.wait)
    return release


async def test_slow_adapter_read_does_not_block_other_requests(tmp_path):
    """The adapter's read waits behind busy I/O threads until the test releases them."""
    engine = tiny_engine()
    slow = tmp_path / "slow"
    shutil.copytree(demo_adapter_dirs()["initech"], slow)
    engine.add_adapter("slow", slow)
    assert (await collect(engine, chat(engine), "acme", GREEDY))[0].text == DEMO_MARKERS["acme"]  # resident
    release = _hold_io_threads(engine)
    try:
        slow_task = asyncio.create_task(collect(engine, chat(engine), "slow", GREEDY))
        await asyncio.sleep(0.05)
        assert engine.admin.info("slow").tier == "disk"
        # While the read is stuck, resident adapters keep producing tokens.
        fast, deltas = await collect(engine, chat(engine), "acme", GREEDY)
        assert fast.text == DEMO_MARKERS["acme"] and len(deltas) > 5
        assert not slow_task.done()
    finally:
        release.set()
    out, _ = await slow_task
    assert out.text == DEMO_MARKERS["initech"] and out.adapter_tier == "disk"
    await engine.close()


async def test_load_from_host_ram_does_not_wait_behind_a_stuck_read(tmp_path):
    """With the only I/O thread stuck, a request for an adapter whose copy is in host RAM is
    still served: its prompt is tokenized on the tokenizer thread and its copy into the pool
    runs on the copy thread, neither behind that read."""
    engine = tiny_engine(io_threads=1)
    assert (await collect(engine, chat(engine), "acme", GREEDY))[0].text == DEMO_MARKERS["acme"]
    assert await engine.admin.unload("acme")
    assert engine.admin.info("acme").tier == "ram"
    slow = tmp_path / "slow"
    shutil.copytree(demo_adapter_dirs()["initech"], slow)
    engine.add_adapter("slow", slow)
    release = _hold_io_threads(engine)
    try:
        slow_task = asyncio.create_task(collect(engine, chat(engine), "slow", GREEDY))
        await asyncio.sleep(0.05)  # its read now waits for the only I/O thread
        out, _ = await asyncio.wait_for(collect(engine, chat(engine), "acme", GREEDY), 30)
        assert out.text == DEMO_MARKERS["acme"] and out.adapter_tier == "ram"
        assert not slow_task.done()
    finally:
        release.set()
    assert (await slow_task)[0].text == DEMO_MARKERS["initech"]
    await engine.close()


async def test_abort_frees_pages_within_a_step():
    engine = tiny_engine()
    start = engine.debug.pool_free_pages()
    gen = engine.generate(chat(engine), "acme", SamplingParams(max_tokens=200, ignore_eos=True), request_id="x")
    await gen.__anext__()
    assert engine.debug.pool_free_pages() < start
    req = engine.debug.step_planner.requests["x"]
    await gen.aclose()  # the caller went away
    freed = start - engine.stats().pool_pages_adapters
    # Freed at the step after the abort, not after 200 tokens: counted in the request's own tokens
    # rather than in wall time (a loaded machine's step can outlast a few event-loop turns).
    for _ in range(500):
        if engine.debug.pool_free_pages() == freed:
            break
        await asyncio.sleep(0.01)
    assert engine.debug.pool_free_pages() == freed
    assert req.finish_reason == "abort" and len(req.output_ids) < 20, (req.finish_reason, len(req.output_ids))
    await engine.close()


@pytest.mark.parametrize("scheduler", ["vtc", "fcfs"])
async def test_preemption_under_a_tiny_pool_keeps_greedy_outputs(scheduler):
    prompts = [[5 + i, 9, 12 + i, 30] for i in range(8)]
    adapters = [None, "acme", "globex", "initech"] * 2
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = tiny_engine(scheduler=scheduler)
    alone = [(await collect(roomy, p, a, params))[0].token_ids for p, a in zip(prompts, adapters)]
    await roomy.close()
    # Room for the three adapters and a handful of KV blocks: sequences must take turns.
    need = sum(roomy.admin.info(a).num_pages for a in DEMO_MARKERS)
    tight = tiny_engine(scheduler=scheduler, num_pages=1 + need + 24, max_model_len=96)
    outs = await asyncio.gather(
        *(collect(tight, p, a, params, tenant=f"t{i % 3}") for i, (p, a) in enumerate(zip(prompts, adapters)))
    )
    assert tight.stats().preemptions > 0
    assert [o.token_ids for o, _ in outs] == alone
    await tight.close()


def test_triton_backend_matches_torch_end_to_end():
    pytest.importorskip("triton")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    rows = list(zip(prompts, ["acme", "initech", None]))
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    want = tiny_engine(kernel_backend="torch").generate_batch(rows, params)
    engine = tiny_engine(kernel_backend="triton")
    assert engine.debug.ops.name == "triton"
    got = engine.generate_batch(rows, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dtype="float64"), "EngineConfig.dtype must be one of"),
        (dict(lora_dtype="int4"), "EngineConfig.lora_dtype must be one of"),
        (dict(dtype="bfloat16", lora_dtype="int8"), "lora_dtype 'int8' cannot serve a bfloat16 model"),
        (dict(lora_dtype="int8", kernel_backend="triton"), "'int8' cannot run with kernel_backend 'triton'"),
        (dict(lora_dtype="int8", tensor_parallel_size=2), "'int8' cannot run with tensor_parallel_size > 1"),
        (dict(dtype="bfloat16", lora_dtype="float32"), "lora_dtype 'float32' cannot serve a bfloat16 model"),
        (dict(dtype="bfloat16", lora_dtype="float16"), "lora_dtype 'float16' cannot serve a bfloat16 model"),
        (dict(kernel_backend="cuda"), "EngineConfig.kernel_backend must be one of"),
        (dict(max_loras=0), "EngineConfig.max_loras must be >= 1"),
        (dict(adapter_wait_s=-1.0), "EngineConfig.adapter_wait_s must be >= 0"),
        (dict(gil_switch_interval_s=0.0), "EngineConfig.gil_switch_interval_s must be > 0"),
        (dict(gpu_memory_utilization=float("nan")), r"EngineConfig.gpu_memory_utilization must be in \(0, 1\]"),
        (dict(max_pinned_fraction=1.5), r"EngineConfig.max_pinned_fraction must be in \[0, 1\]; got 1.5"),
        (dict(traffic_retention_hours=24), "EngineConfig.traffic_retention_hours must be >= 25"),
    ],
)
def test_config_rejects_bad_values_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_config_bounds_are_declared_with_each_field():
    """Every numeric field's bounds sit in its declaration (lorapage.options.option): its edge is
    taken, a step past it refused; None (counted from the machine, or off) passes any bound."""
    partners = {"max_resident_loras": {"max_loras": 1}}  # the other field's own rule, kept
    checked = 0
    for f in dataclasses.fields(EngineConfig):
        at_least, above, at_most = f.metadata["bounds"]
        if at_least is not None:
            EngineConfig(**{f.name: at_least, **partners.get(f.name, {})})
            with pytest.raises(ValueError, match=f"EngineConfig.{f.name} must be"):
                EngineConfig(**{f.name: at_least - 1})
            checked += 1
        if above is not None:
            with pytest.raises(ValueError, match=f"EngineConfig.{f.name} must be"):
                EngineConfig(**{f.name: above})
            checked += 1
        if at_most is not None:
            EngineConfig(**{f.name: at_most})
            with pytest.raises(ValueError, match=f"EngineConfig.{f.name} must be"):
                EngineConfig(**{f.name: at_most + 0.5})
    assert checked >= 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device is available"):
        Engine(EngineConfig(device="cuda"))
