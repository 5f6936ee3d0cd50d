"""The soak's "request size" attacks of issue 38 (findings 1, 2, 7 and 14: a request's size is
its work), beside the isolation attacks of :mod:`soak_isolation`: each one from a tenant with an
ordinary quota (the review's: rpm 60, tpm 200,000, max_concurrency 4, or room for the sequences
the attack needs), and what it must get.

- ``prompt_logprobs_over_the_bound``: a completion of 32 prompts x 500 tokens, n 16,
  ``prompt_logprobs`` 20, ``echo`` with ``logprobs`` 5, ``max_tokens`` 1 (millions of logprob
  entries, 32 times the 495 MB answer the review measured): from a tenant that may run its 512
  sequences, refused 400 before anything is computed, ``param`` ``prompt_logprobs`` or ``echo``;
  from one with ``max_concurrency`` 4, 429 without ``Retry-After`` (the size refused first).
- ``prompt_logprobs_under_the_bound``: 1 prompt x 500 tokens, n 24, ``prompt_logprobs`` 20,
  ``max_tokens`` 1 (500 x 24 x 21 = 252,000 entries, under the 262,144 bound), 4 at once from a
  tenant with ``max_concurrency`` 32, each sent again after its ``Retry-After`` while the others
  hold its slots: each answered 200 in the end with its 24 choices' prompt logprobs (16 MB each;
  the prompt computed once per request, the answers built off the event loop), never 503.
- ``fan_out``: 4 concurrent requests of 256 prompts x n 64 (16,384 sequences each) from a tenant
  with ``max_concurrency`` 4: 429 without ``Retry-After`` (more sequences than it may ever run);
  and from a tenant without ``max_concurrency``: 429 (past its share of the queue, or for now while
  the others hold it); never 503.
- ``open_ended_chats``: 30 concurrent chats without ``max_tokens`` (``ignore_eos``) from a tenant
  with tpm 20,000 (its burst 2,000, so a chat takes seconds, not minutes): 200s and/or 429s, and
  all of them together generate at most what its bucket held plus its refill over the attack.
- ``truncate_prompt_tokens``: a prompt of thousands of tokens with ``truncate_prompt_tokens`` 64:
  200 and ``usage.prompt_tokens`` 64.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

# The soak run (bench_soak.Soak: its URL, keys and HTTP session) and its tally of answers; typed
# loosely so this module, which bench_soak imports, imports no script back.
Soak = Any
Tally = Any

CHAT_TPM, CHAT_BURST = 20_000, 2_000
TENANTS = {  # name -> its limits in the tenants file: the review's hostile tenant's quota
    "sizer": "rpm = 60\nmax_concurrency = 4\ntpm = 200000\n",
    # The same, with room for one request of 24 sequences (the prompt-logprob branches) at a time:
    # the soak's queue holds 64, so more would have it refused 503 (queue full).
    "brancher": "rpm = 60\nmax_concurrency = 32\ntpm = 200000\n",
    # Room for the 512 sequences of the request over the prompt-logprob bound: the bound refuses it.
    "bulk": "rpm = 60\nmax_concurrency = 512\ntpm = 200000\n",
    "fanner": "rpm = 60\ntpm = 200000\n",  # no max_concurrency: its share of the server's queue
    # tpm 20,000 as in the review, its burst 2,000: a chat of the whole 20,000 takes two minutes on
    # a small CPU (past the client's timeout, and the other attacks' turns); the bound is the same.
    "talker": f"rpm = 60\ntpm = {CHAT_TPM}\ntpm_burst = {CHAT_BURST}\n",
}
PROMPT_TOKENS = 500  # token ids, so the counts are exact whatever the tokenizer
UNDER_N = 24  # 500 x 24 x (1 + 20) = 252,000 entries, under the bound of 262,144
FAN_PROMPTS, FAN_N = 256, 64
CHATS = 30
TRUNCATE = 64
FIGURES: dict[str, str] = {}  # case -> what its last run measured, for the soak's JSON


def _prompt(salt: int) -> list[int]:
    return [10 + (salt * 31 + i * 7) % 200 for i in range(PROMPT_TOKENS)]


def size_cases(soak: Soak, tally: Tally) -> dict[str, tuple[Callable[[], Awaitable], set]]:
    """Name -> (the attack, returning what it got, and the answers it may get)."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    # Encoded once (the client's own json.dumps of large bodies would stall its loop).
    over = json.dumps(
        {
            "model": "base",
            "prompt": [_prompt(i) for i in range(32)],
            **{"n": 16, "prompt_logprobs": 20, "echo": True, "logprobs": 5, "max_tokens": 1},
        }
    ).encode()
    under = json.dumps(
        {"model": "base", "prompt": _prompt(99), "n": UNDER_N, "prompt_logprobs": 20, "max_tokens": 1}
    ).encode()
    fan = json.dumps({"model": "base", "prompt": ["hi"] * FAN_PROMPTS, "n": FAN_N, "max_tokens": 1}).encode()
    long_prompt = "lorem ipsum dolor sit amet " * 800
    waits: Counter[str] = Counter()  # tenant -> 429s with Retry-After that ``patiently`` waited out

    async def send(path: str, body: bytes, who: str) -> tuple[int, bytes, str | None]:
        """POST ``body``: the status, the raw answer and its Retry-After."""
        headers = {**soak.auth(who), "Content-Type": "application/json"}
        async with soak.session.post(soak.url + path, data=body, headers=headers) as resp:
            raw = await resp.read()
            tally.statuses[resp.status] += 1
            return resp.status, raw, resp.headers.get("Retry-After")

    async def patiently(body: bytes, who: str) -> tuple[int, bytes, str | None]:
        """``send``, again after its Retry-After while it is refused for now (a few times)."""
        for _ in range(8):
            status, raw, retry = await send(comp, body, who)
            if status != 429 or retry is None:
                break
            waits[who] += 1
            await asyncio.sleep(float(retry))
        return status, raw, retry

    async def over_the_bound():
        (ordinary, _, retry), (status, raw, _) = await asyncio.gather(
            send(comp, over, "sizer"), send(comp, over, "bulk")
        )
        if (ordinary, retry) != (429, None):  # 512 sequences: more than max_concurrency 4 will ever run
            return 0, f"the ordinary tenant got {ordinary} (Retry-After: {retry})"
        return status, json.loads(raw).get("error", {}).get("param") if status == 400 else raw[:300]

    async def under_the_bound():
        start, waited = time.monotonic(), waits["brancher"]
        got = await asyncio.gather(*(patiently(under, "brancher") for _ in range(4)))
        sizes = ", ".join(f"{status}: {len(raw) / 2**20:.1f} MB" for status, raw, _ in got)
        FIGURES["prompt_logprobs_under_the_bound"] = (
            f"{sizes} in {time.monotonic() - start:.1f} s, {waits['brancher'] - waited} 429s waited out"
        )
        # The answers are megabytes each: counted on their bytes, not decoded on the client's loop.
        wrong = [
            (status, retry) for status, raw, retry in got if status != 200 or raw.count(b'"prompt_logprobs"') != UNDER_N
        ]
        return (200, "each whole") if not wrong else (0, f"{wrong}")

    async def fan_out():
        bounded = asyncio.gather(*(send(comp, fan, "sizer") for _ in range(4)))
        shared = asyncio.gather(*(send(comp, fan, "fanner") for _ in range(4)))
        got_bounded, got_shared = await asyncio.gather(bounded, shared)
        # The shared one may also be refused for now (Retry-After) when its share is held by the others.
        seen = {(status, retry) for status, _, retry in got_bounded} | {(s, "any") for s, _, _ in got_shared}
        return (429, "refused") if seen == {(429, None), (429, "any")} else (0, f"{seen}")

    async def open_ended():
        body = {"model": "base", "messages": [{"role": "user", "content": "Tell me a story"}], "ignore_eos": True}
        start = time.monotonic()
        got = await asyncio.gather(*(soak.post(chat, body, "talker", tally) for _ in range(CHATS)))
        seconds = time.monotonic() - start
        statuses = Counter(status for status, _ in got)
        generated = sum(payload["usage"]["completion_tokens"] for status, payload in got if status == 200)
        bound = CHAT_BURST + CHAT_TPM / 60 * seconds  # what the bucket held, and its refill
        FIGURES["open_ended_chats"] = f"{dict(statuses)}; {generated} tokens in {seconds:.1f} s (at most {bound:.0f})"
        if not set(statuses) <= {200, 429} or generated > bound:
            return 0, FIGURES["open_ended_chats"]
        return "within tpm", None

    async def truncated():
        body = {"model": "base", "prompt": long_prompt, "truncate_prompt_tokens": TRUNCATE, "max_tokens": 4}
        status, payload = await soak.post(comp, body, "sizer", tally)
        return status, payload.get("usage", {}).get("prompt_tokens")

    return {
        "prompt_logprobs_over_the_bound": (over_the_bound, {(400, "prompt_logprobs"), (400, "echo")}),
        "prompt_logprobs_under_the_bound": (under_the_bound, {(200, "each whole")}),
        "fan_out": (fan_out, {(429, "refused")}),
        "open_ended_chats": (open_ended, {("within tpm", None)}),
        "truncate_prompt_tokens": (truncated, {(200, TRUNCATE)}),
    }
