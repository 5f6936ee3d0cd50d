"""A request's size is its work (issue 38): prompts x n sequences admitted, charged and queued
as such, prompt logprobs computed once per prompt and bounded, open-ended chats held to the
tenant's tokens per minute, truncated prompts reported as truncated; and the API's small edges
(a readable stop-strings error, prompt-logprob ranks, a context past the model's refused).
Over a real server on 127.0.0.1."""

from __future__ import annotations

import pytest
from server_harness import BASE, server  # noqa: F401

from lorapage.testing.serve_process import run_serve

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


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
