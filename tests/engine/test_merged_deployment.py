"""Dedicated merged deployments: the merge equals PEFT's ``merge_and_unload``; ``lorapage serve
--merge`` answers as PEFT does on the unmerged adapter (an adapter outside the shared envelope
included); the equivalence check refuses a wrong merge with its numbers; ``max_adapter_tokens``
bounds an adapter's requests on the shared pool, never the base's."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import aiohttp
import pytest
import torch
from hf_reference import make_peft_adapter, make_random_llama, peft_greedy
from server_harness import assert_openai_error, make_engine, running_server

from lorapage.adapters.peft_format import load_adapter_tensors, read_adapter_spec
from lorapage.config import EngineConfig
from lorapage.engine import Engine
from lorapage.engine.merge_check import GreedyRun, compare, merge_and_check
from lorapage.errors import AdapterEnvelopeError, ConflictError
from lorapage.kernels.linear_cpu import linear_cpu, pack_weight
from lorapage.model.config import MODULES, ModelConfig
from lorapage.model.llama import LlamaModel
from lorapage.model.loader import load_state_dict
from lorapage.model.merge import merge_adapter, merged_weight, module_rows
from lorapage.model.tokenizer import Tokenizer
from lorapage.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 61]
TOKENS = 12
RANK = 32  # over the shared envelope all:16 (the design's narrow one): tier dedicated
KEY = "merge-test-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama and a rank-32 adapter on every module (rsLoRA, one alpha_pattern entry)."""
    root = tmp_path_factory.mktemp("merged")
    base = make_random_llama(root / "base", seed=3)
    adapter = make_peft_adapter(
        base,
        root / "wide",
        r=RANK,
        targets=list(MODULES),
        seed=4,
        alpha=48,
        use_rslora=True,
        alpha_pattern={"v_proj": 12},
    )
    return base, adapter


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed-for-onednn"])
def test_merged_weights_equal_peft_merge_and_unload(checkpoint, packed):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = checkpoint
    mc = ModelConfig.from_dir(base)
    model = LlamaModel(mc, load_state_dict(base, torch.float32), torch.device("cpu"), torch.float32, 64)
    if packed:  # the cpu backend's layout: merged by unpacking, editing and packing again
        model.pack_weights(pack_weight, linear_cpu)
    untouched = {k: model.layers[0][k].clone() for k in ("in_norm", "post_norm")}
    spec = read_adapter_spec(adapter, mc, RANK)
    merge_adapter(model, load_adapter_tensors(spec, torch.float32), spec.scales)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    reference = peft.merge_and_unload().state_dict()
    for layer in range(mc.num_layers):
        for module in MODULES:
            key, start, end = module_rows(model, module)
            group = "self_attn" if module in MODULES[:4] else "mlp"
            want = reference[f"model.layers.{layer}.{group}.{module}.weight"]
            # Both sum W + scale * B @ A in float32; only the order of the scale's product differs
            # (a few units of float32 roundoff on entries of magnitude <= ~1).
            torch.testing.assert_close(model.dense_weight(layer, key)[start:end], want, rtol=0, atol=1e-6)
    for k, before in untouched.items():
        assert torch.equal(model.layers[0][k], before)


def test_a_16_bit_merge_rounds_once_from_float32():
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(*s, generator=g) for s in ((48, 32), (4, 32), (48, 4)))
    got = merged_weight(w.to(torch.bfloat16), a.to(torch.bfloat16), b.to(torch.bfloat16), 0.5)
    exact = w.to(torch.bfloat16).float() + 0.5 * (b.to(torch.bfloat16).float() @ a.to(torch.bfloat16).float())
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact.to(torch.bfloat16))


def test_compare_states_its_numbers():
    runs = [GreedyRun((1, 2, 3), (-0.5, -1.0, -2.0)), GreedyRun((4, 5), (-0.1, -0.2))]
    assert compare("x@1", runs, runs, 1e-3).passed
    off = [runs[0], GreedyRun((4, 5), (-0.1, -0.2 + 2e-3))]
    check = compare("x@1", runs, off, 1e-3)
    assert not check.passed and check.mismatched_prompts == 0 and check.max_abs_dlogprob == pytest.approx(2e-3)
    flipped = [GreedyRun((1, 9, 7), (-0.5, -1.0, -2.0)), runs[1]]
    check = compare("x@1", runs, flipped, 1e-3)
    assert not check.passed and check.mismatched_prompts == 1
    assert "prompt 0, token 1: 2 unmerged vs 9 merged" in check.line() and "FAILED" in check.line()
    # The unmerged path had 9 within 5e-4 of its own choice at token 1: rounding may order them either way.
    tied = [GreedyRun((1, 2, 3), (-0.5, -1.0, -2.0), ({1: -0.5}, {2: -1.0, 9: -1.0005}, {3: -2.0})), runs[1]]
    check = compare("x@1", tied, flipped, 1e-3)
    assert check.passed and check.near_ties == 1 and "but for 1 near-tie" in check.line()
    assert not compare("x@1", tied, flipped, 1e-4).passed  # the same gap, over a tighter tolerance


async def test_the_check_refuses_a_wrong_merge(checkpoint):
    base, adapter = checkpoint

    def doubled(model, tensors, scales):  # a merge with the wrong scale: what the check is for
        merge_adapter(model, tensors, {k: 2 * v for k, v in scales.items()})

    engine = Engine(EngineConfig(model=str(base), shared_envelope="", max_num_seqs=8))
    try:
        engine.add_adapter("wide", adapter)
        check = await merge_and_check(engine, "wide", merge=doubled)
        assert not check.passed and check.max_abs_dlogprob > 1e-3
        assert "FAILED" in check.line() and "wide@1" in check.line()
        assert engine.stats().merged_deployment["passed"] is False
    finally:
        await engine.close()


def test_the_shared_pool_refuses_the_wide_adapter(checkpoint):
    base, adapter = checkpoint
    engine = Engine(EngineConfig(model=str(base), max_num_seqs=8, shared_envelope="all:16"))
    with pytest.raises(AdapterEnvelopeError):
        engine.add_adapter("wide", adapter)
    asyncio.run(engine.close())


async def _serve(*args: str) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorapage.cli",
        "serve",
        "--port",
        "0",
        "--state-dir",
        ":memory:",
        "--api-key",
        KEY,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,  # the check's log line comes on stderr
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=180)).decode()
        if not line:
            raise AssertionError(f"lorapage serve exited early with {await proc.wait()}: {''.join(lines)}")
        lines.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            return proc, m.group(1), lines


async def test_serve_merge_answers_as_peft_on_the_unmerged_adapter(checkpoint):
    base, adapter = checkpoint
    want_ids, want_lps = peft_greedy(base, adapter, PROMPT, TOKENS)
    proc, url, lines = await _serve("--model", str(base), "--merge", f"wide={adapter}", "--max-num-seqs", "8")
    try:
        assert any("merge equivalence check of wide@1 passed" in line for line in lines), lines
        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = {"model": "wide", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 0}
            async with session.post(url + "/v1/completions", json={**body, "ignore_eos": True}) as resp:
                assert resp.status == 200, await resp.text()
                choice = (await resp.json())["choices"][0]
            assert choice["text"] == Tokenizer.from_dir(base).backend.decode(want_ids)
            got_lps = choice["logprobs"]["token_logprobs"]
            assert max(abs(g - w) for g, w in zip(got_lps, want_lps, strict=True)) < 1e-3
            async with session.get(url + "/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["wide"]
            async with session.post(url + "/v1/completions", json={**body, "model": base.name}) as resp:
                status, err = resp.status, await resp.json()
            assert_openai_error(err, 404, "model")
            assert status == 404 and "dedicated deployment of adapter 'wide'" in err["error"]["message"]
            async with session.post(url + "/v1/completions", json={**body, "model": "acme"}) as resp:
                assert resp.status == 404  # not registered here: the usual 404
            async with session.get(url + "/internal/state") as resp:
                merged = (await resp.json())["engine"]["merged_deployment"]
            assert merged["passed"] and merged["adapter"] == "wide@1" and merged["mismatched_prompts"] == 0
            assert merged["prompts"] == 8 and merged["max_abs_dlogprob"] <= merged["tolerance"] == 1e-3
            assert merged["tokens"] == 8 * 16
    finally:
        proc.terminate()
        await proc.wait()


@pytest.mark.parametrize(
    "flags, words",
    [
        # No merge is equal to the LoRA path to the last bit: a tolerance of 0 fails, with the numbers.
        (("--merge-check-tolerance", "0"), ("check of wide@1 FAILED", "8 prompts", "max |d logprob|", "tolerance 0")),
        (("--merge-check-prompts", "{bad}"), ("--merge-check-prompts", "prompts.jsonl:2")),
    ],
)
def test_serve_merge_refuses_to_start_in_one_line(checkpoint, tmp_path, flags, words):
    base, adapter = checkpoint
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('"fine"\n{"prompt": 3}\n')
    done = subprocess.run(
        [sys.executable, "-m", "lorapage.cli", "serve", "--port", "0", "--state-dir", ":memory:", "--api-key", KEY,
         "--model", str(base), "--merge", f"wide={adapter}", *(f.format(bad=bad) for f in flags)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lorapage serve: --merge") and all(w in last for w in words), last
    assert "listening" not in done.stdout


async def test_max_adapter_tokens_refuses_long_adapter_requests_only():
    engine = make_engine(max_adapter_tokens=8)
    try:
        async with running_server(engine) as srv:
            status, body, _ = await srv.post("/v1/completions", {"model": "acme", "prompt": "hi", "max_tokens": 9})
            assert_openai_error(body, 400, "max_tokens")
            err = body["error"]
            assert status == 400 and err["code"] == "adapter_tokens_over_shared_limit"
            assert "limit of 8 tokens" in err["message"] and "lorapage serve --merge acme" in err["message"]
            status, body, _ = await srv.post("/v1/completions", {"model": "acme", "prompt": "hi", "max_tokens": 8})
            assert status == 200 and body["usage"]["completion_tokens"] <= 8
            base = engine.base_name
            status, body, _ = await srv.post(
                "/v1/completions", {"model": base, "prompt": "hi", "max_tokens": 40, "ignore_eos": True}
            )
            assert status == 200 and body["usage"]["completion_tokens"] == 40  # the base is not bounded
            chat = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            status, body, _ = await srv.post("/v1/chat/completions", chat)  # no max_tokens: the bound is its budget
            assert status == 200 and body["usage"]["completion_tokens"] == 8, body
            assert body["choices"][0]["finish_reason"] == "length"
    finally:
        await engine.close()


def test_max_adapter_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_adapter_tokens"):
        EngineConfig(max_adapter_tokens=0)


def test_the_flags_exist():
    from lorapage.serve.cli import build_parser

    text = build_parser().format_help()
    assert "--merge ADAPTER[=DIR]" in text and "--merge-check-prompts" in text and "--max-adapter-tokens" in text
    assert "--merge-check-tolerance" in text


async def test_a_merge_never_reuses_blocks_the_base_cached_before_it():
    engine = make_engine()  # prefix caching on: the base's blocks of this prompt are cached first
    prompt = "The same long prompt, long enough to fill two blocks of the prefix cache for sure: " * 2
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    try:
        await engine.run_to_end(prompt, None, greedy)
        unmerged = await engine.run_to_end(prompt, "acme", greedy)
        await engine.merge_into_base("acme")
        hits = sum(engine.debug.step_planner.prefix_hit_tokens.values())
        merged = await engine.run_to_end(prompt, "acme", greedy)
        assert (
            sum(engine.debug.step_planner.prefix_hit_tokens.values()) == hits and merged.token_ids == unmerged.token_ids
        )
        assert merged.logprobs is not None and unmerged.logprobs is not None
        assert max(abs(a.logprob - b.logprob) for a, b in zip(merged.logprobs, unmerged.logprobs)) < 1e-3
    finally:
        await engine.close()


async def test_no_merge_under_requests_in_flight():
    engine = make_engine()
    try:
        stream = engine.generate("hello", "acme", SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()  # running now
        with pytest.raises(ConflictError, match="in flight"):
            await engine.merge_into_base("acme")
        await stream.aclose()
        assert engine.merged_adapter is None
    finally:
        await engine.close()
