"""A request's size is its work (issue 38): prompts x n sequences admitted, charged and queued
as such, prompt logprobs computed once per prompt and bounded, open-ended chats held to the
tenant's tokens per minute, truncated prompts reported as truncated; and the API's small edges
(a readable stop-strings error, prompt-logprob ranks, a context past the model's refused).
Over a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

import pytest
from server_harness import BASE, TENANTS_TOML, make_engine, read_sse, running_server, server  # noqa: F401

from lorapage.frontend import Access
from lorapage.frontend.formatter import Formatter
from lorapage.frontend.job import MAX_PROMPT_LOGPROB_ENTRIES
from lorapage.tenancy.tenants import TenantsConfig, hash_key
from lorapage.testing.serve_process import run_serve

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
LONG = [i % 250 + 5 for i in range(500)]  # 500 token ids (the tiny model's vocabulary is 261)


def comp(**kw) -> dict:
    return {"model": BASE, "prompt": "Hello there", "temperature": 0, "max_tokens": 2, **kw}


async def test_truncated_prompts_are_reported_and_charged_as_truncated(server):
    """vLLM's ``truncate_prompt_tokens``: usage counts the prompt tokens the engine computed."""
    prompt = list(range(10, 50))  # 40 token ids
    status, body, _ = await server.post(COMP, comp(prompt=prompt, truncate_prompt_tokens=7))
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 7, body["usage"]
    status, body, _ = await server.post(COMP, comp(prompt=[prompt, prompt[:5]], truncate_prompt_tokens=7))
    assert status == 200 and body["usage"]["prompt_tokens"] == 7 + 5, body
    messages = [{"role": "user", "content": "Hello there, how are you today? " * 4}]
    chat = {"model": BASE, "messages": messages, "max_tokens": 2, "truncate_prompt_tokens": 9}
    status, body, _ = await server.post(CHAT, chat)
    assert status == 200 and body["usage"]["prompt_tokens"] == 9, body


async def test_truncated_echo_echoes_what_was_computed(server):
    prompt = list(range(10, 50))
    status, body, _ = await server.post(COMP, comp(prompt=prompt, truncate_prompt_tokens=6, echo=True, logprobs=0))
    assert status == 200, body
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 + 2 and body["choices"][0]["text"].startswith("".join(tokens[:6]))


async def test_too_many_stop_strings_are_named_readably(server):
    status, body, _ = await server.post(COMP, comp(stop=[f"s{i}" for i in range(20)]))
    assert status == 400 and body["error"]["param"] == "stop", body
    message = body["error"]["message"]
    assert "at most 16" in message and "got 20" in message and '["s0", "s1"' in message, message
    assert "('s0'" not in message


async def test_prompt_logprob_alternatives_carry_their_ranks(server):
    status, body, _ = await server.post(COMP, comp(prompt_logprobs=3))
    assert status == 200, body
    rows = body["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) > 2
    for row in rows[1:]:
        ranks = sorted(entry["rank"] for entry in row.values())
        assert all(isinstance(r, int) and r >= 1 for r in ranks), row
        assert {1, 2, 3} <= set(ranks), row  # the top three, ranked 1..3 (the prompt's own token may add one)
        best = max(row.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1, row


@pytest.mark.parametrize("length", ["0", "4096"])
async def test_a_max_model_len_past_the_models_context_is_refused(length):
    """As vLLM refuses it: the tiny model has 512 positions."""
    done = run_serve("--max-model-len", length)
    err = done.stderr
    assert done.returncode == 2, err
    assert "max_model_len" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if length != "0":
        assert "512" in err and "--allow-long-max-model-len" in err, err


def tenants(**entries: str) -> Access:
    """The harness's tenants and ``entries`` (name -> its TOML lines; its key is ``key-NAME``)."""
    toml = TENANTS_TOML
    for name, lines in entries.items():
        toml += f'\n[tenants.{name}]\nkey_sha256 = ["{hash_key("key-" + name)}"]\nadapters = []\n{lines}\n'
    return Access(TenantsConfig.from_toml(toml))


async def post(srv, path: str, body: dict, tenant: str):
    async with srv.session.post(srv.url + path, json=body, headers={"Authorization": f"Bearer key-{tenant}"}) as resp:
        return resp.status, await resp.json(), resp.headers


async def test_a_request_holds_a_concurrency_slot_per_sequence():
    """Finding 2: prompts x n sequences, each a slot of max_concurrency (and of a tenant's share
    of the queue), checked before the prompts are tokenized."""
    engine = make_engine(max_queue_len=64)  # 5 tenants: a share of 12 sequences each
    try:
        access = tenants(capped="max_concurrency = 4", shared="")
        async with running_server(engine, access) as srv:
            prompts = ["Hello", "Hi there"]
            status, body, headers = await post(srv, COMP, comp(prompt=prompts, n=4), "capped")
            assert status == 429 and "Retry-After" not in headers, body  # 8 sequences never fit 4
            message = body["error"]["message"]
            assert "8 sequences" in message and "2 prompts x n 4" in message and "max_concurrency" in message
            status, body, _ = await post(srv, COMP, comp(prompt=prompts, n=2), "capped")
            assert status == 200 and len(body["choices"]) == 4, body
            status, body, _ = await post(srv, COMP, comp(prompt=["a", "b", "c"], n=5), "shared")
            assert status == 429 and "15 sequences" in body["error"]["message"], body  # over its share of 12
            # Four sequences in flight fill the cap: one more waits (Retry-After), and gets in after.
            long = comp(prompt=prompts, n=2, max_tokens=400, ignore_eos=True, stream=True)
            hdrs = {"Authorization": "Bearer key-capped"}
            async with srv.session.post(srv.url + COMP, json=long, headers=hdrs) as resp:
                assert resp.status == 200
                events = read_sse(resp)
                await anext(events)
                status, body, headers = await post(srv, COMP, comp(), "capped")
                assert status == 429 and "Retry-After" in headers, body
                assert "concurrent sequences" in body["error"]["message"], body
            for _ in range(200):  # the stream's four slots come back once it is cut
                status, body, _ = await post(srv, COMP, comp(), "capped")
                if status == 200:
                    break
                await asyncio.sleep(0.05)
            assert status == 200, body
    finally:
        await engine.close()


async def test_prompt_logprob_rows_are_charged_and_bounded():
    """Finding 1: each prompt-logprob row the answer carries is a token of its tenant's TPM,
    and an answer past the bound is refused (400 naming it) before the engine computes it."""
    engine = make_engine()
    try:
        async with running_server(engine, tenants(metered="tpm = 1000")) as srv:
            prompt = list(range(10, 110))  # 100 tokens
            small = comp(prompt=prompt, n=4, prompt_logprobs=1, max_tokens=1)
            status, body, _ = await post(srv, COMP, small, "metered")
            assert status == 200 and len(body["choices"]) == 4, body
            # 100 prompt tokens + 16 copies of 100 rows + 16 tokens: over the 1,000-token burst for good.
            status, body, headers = await post(srv, COMP, {**small, "n": 16}, "metered")
            assert status == 429 and "Retry-After" not in headers and "1716" in body["error"]["message"], body
            computed = engine.debug.step_planner.prompt_tokens_computed
            big = comp(prompt=LONG, n=32, prompt_logprobs=20, max_tokens=1)  # 336,000 entries
            status, body, _ = await post(srv, COMP, big, "metered")
            assert status == 400 and body["error"]["param"] == "prompt_logprobs", body
            message = body["error"]["message"]
            assert f"{MAX_PROMPT_LOGPROB_ENTRIES:,}" in message and "336,000" in message, message
            echo = comp(prompt=[LONG] * 8, n=16, echo=True, logprobs=5, max_tokens=0)
            status, body, _ = await post(srv, COMP, echo, "alpha")
            assert status == 400 and body["error"]["param"] == "echo", body
            assert engine.debug.step_planner.prompt_tokens_computed == computed  # refused before any work
    finally:
        await engine.close()


async def test_a_large_answer_is_built_off_the_event_loop(server, monkeypatch):
    """Finding 1: an answer of many logprobs is formatted and encoded on a prompt worker (in its
    tenant's turn), one copy of each prompt's rows formatted for all its choices."""
    threads: list[str] = []
    formatted: list[int] = []
    encode, rows = Formatter.encode, Formatter._prompt_logprobs

    def spy_encode(self, outs):
        threads.append(threading.current_thread().name)
        return encode(self, outs)

    def spy_rows(self, out):
        got = rows(self, out)
        formatted.append(id(got))
        return got

    monkeypatch.setattr(Formatter, "encode", spy_encode)
    monkeypatch.setattr(Formatter, "_prompt_logprobs", spy_rows)
    prompt = LONG[:300]
    status, body, _ = await server.post(COMP, comp(prompt=prompt, n=3, prompt_logprobs=5, echo=True, logprobs=2))
    assert status == 200, body
    assert threads and threads[-1].startswith("lorapage-prompt"), threads
    assert len(formatted) == 3 and len(set(formatted)) == 1  # one list for the prompt's three choices
    for choice in body["choices"]:
        assert len(choice["prompt_logprobs"]) == 300
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == 300 + 2 and lp["token_logprobs"][0] is None
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and choice["text"][offsets[-1] :] == lp["tokens"][-1]
    status, body, _ = await server.post(COMP, comp())
    assert status == 200 and threads[-1] == threading.main_thread().name  # a small answer stays on the loop


async def test_open_ended_chats_cannot_outrun_their_tenants_tpm():
    """Finding 7: concurrent chats without max_tokens together generate no more than the TPM
    bucket holds (each reserves what it may use), not each its default_max_tokens past it."""
    engine = make_engine()
    try:
        async with running_server(engine, tenants(chatty="tpm = 1500\ndefault_max_tokens = 50")) as srv:
            body = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
            answers = await asyncio.gather(*(post(srv, CHAT, body, "chatty") for _ in range(8)))
            served = [got for status, got, _ in answers if status == 200]
            refused = [got for status, got, _ in answers if status == 429]
            assert served and len(served) + len(refused) == 8, answers
            generated = sum(got["usage"]["total_tokens"] for got in served)
            assert generated <= 1500, generated  # 8 x ~490 tokens before
    finally:
        await engine.close()


async def test_a_long_max_model_len_is_served_when_allowed():
    engine = make_engine(max_model_len=1024, allow_long_max_model_len=True)
    try:
        assert engine.max_model_len == 1024
    finally:
        await engine.close()
    with pytest.raises(ValueError, match="--allow-long-max-model-len"):
        make_engine(max_model_len=1024)
