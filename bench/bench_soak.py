"""Soak: the real HTTP server under a mixed workload of good, hostile, slow and vanishing clients.

Starts ``lorapage serve`` as a subprocess on a free 127.0.0.1 port (the tiny model, the demo
adapters via ``--lora-modules``, a tenants file, an ``--adapter-root`` holding hostile adapters),
then runs two phases:

- clean: the well-behaved tenants alone (greedy streaming requests over three adapters and the
  base, a fixed number of them), for reference outputs and latencies;
- soak, for ``--duration`` seconds: the same well-behaved workload, beside a hostile tenant cycling
  through the hostile classes (tiny temperatures, NaN and overflowing adapters, a 3 MB prompt,
  backtracking and RE2-refused pattern keys, a key that is not UTF-8, an over-long stop string,
  another tenant's adapter), slow readers (tiny socket buffers, one event, a stall, the rest),
  clients that hang up after the first event, and the edge attacks of issue 26 (see
  :func:`edge_cases`): 130,000 empty messages from a tenant allowed one request a minute, prompts
  far over the context (the server runs a 65,536-token context), JSON nested 5,000 deep, model
  names that are not names, adapter ids with a newline or reserved, bogus keys, malformed HTTP,
  requests cut after their prefill started, non-streamed chats with 20 alternatives per token,
  a tenant flooding the queue, ``/v1/models`` in a loop over 100 registered adapters, and
  connections that send their headers a byte at a time; and the attacks of issue 38
  (:mod:`soak_isolation`): a grammar-compile flood, a ``/v1/usage`` flood, an owner-write flood
  and connections over the per-address cap; and its request-size attacks (:mod:`soak_size`):
  prompt logprobs past the 262,144-entry bound (400, and 429 from a tenant that may never run its
  512 sequences) and just under it (200s, 16 MB answers, 4 at once), a fan-out of 4 x 256 prompts
  x n 64 (429, never 503), 30 concurrent open-ended chats held to their tenant's TPM, and a
  prompt cut by ``truncate_prompt_tokens`` reported as cut. The result's ``size_attacks_last``
  says what the last of some of them measured.

    .venv/bin/python bench/bench_soak.py [--duration 180] [--quick] [--device cpu]
        [--hostile-rate 5] [--edge-rate 5] [--without hostile|slow|hangups|edge ...]

Prints a table, then, as its last line, one JSON object with the figures and their targets:
server RSS growth (VmRSS of the server process; "late" is from a third of the soak on, past
warm-up), the well-behaved tenants' p99 end-to-end latency and TTFT under soak against the clean
run, their output mismatches against it, KV pages still held once all is done, 5xx answers, the
worst loop lag and the p99 of its samples over the soak (``lorapage_event_loop_lag_samples_seconds``,
to its bucket), every hostile or edge answer that was not the one expected, tracebacks in the
server's log, and the scheduling policy's us/step in the second half of the soak against the first
(from ``lorapage_scheduler_policy_seconds``). The soak adds real work beside the good tenants (the
slow readers' long answers, the hang-ups' prefills, the flood's share of the batch), so on a small
shared CPU the latency ratio mostly prices that work; ``--without`` leaves a kind of client out to
tell which costs what.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import random
import secrets
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
from harness import machine_info, machine_line, print_json
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from soak_isolation import SERVER_FLAGS as ISOLATION_FLAGS, TENANTS as ISOLATION_TENANTS, isolation_cases, prepare
from soak_size import FIGURES as SIZE_FIGURES, TENANTS as SIZE_TENANTS, size_cases

from lorapage.testing.serve_process import ServeProcess, start_serve
from lorapage.tiny import demo_adapter_dirs
from lorapage.traces.stats import percentile

T = TypeVar("T")
GOOD_TENANTS, GOOD_WORKERS = 3, 2  # well-behaved tenants, and concurrent streams each
SLOW_READERS, DISCONNECTORS = 2, 2
MODELS = ["acme", "globex", "initech", "base"]
PROMPTS = ["Hello there", "Good morning", "Tell me something", "What is new?"]
GOOD_REQUESTS = [(m, p) for m in MODELS for p in PROMPTS]
# Seeded sampling at a high temperature: a long answer (about 160 tokens), the same whatever the batch.
SLOW = {"model": "initech", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 2.0, "seed": 7}
REQUEST_TIMEOUT_S = 120.0
TARGETS = {
    "output_mismatches": 0,
    "slow_reader_mismatches": 0,
    "hostile_unexpected": 0,
    "pages_leaked": 0,
    "server_5xx": 0,
    "client_5xx": 0,
    "client_errors": 0,
    "p99_e2e_ratio_max": 2.0,
    "rss_growth_late_mb_max": 50.0,
    "rss_growth_late_pct_max": 10.0,
    "loop_lag_max_s": 1.0,
    "loop_lag_p99_s_max": 0.1,
    "edge_unexpected": 0,
    "server_tracebacks": 0,
    "policy_drift_max": 1.2,
}
SERVER_FLAGS = [  # a context of 65,536 tokens (the prompts far over it must be cut short), a queue of 64
    # The tiny model's own context is 512: a longer one is served only when asked for (as vLLM does).
    *("--max-model-len", "65536", "--allow-long-max-model-len", "--num-pages", "8192", "--enable-chunked-prefill"),
    *("--max-num-batched-tokens", "2048", "--max-queue-len", "64", "--header-timeout", "2"),
    *ISOLATION_FLAGS,
]
EDGE_ADAPTERS = 100  # ids registered for the /v1/models loop


def good_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 1, "stream": True}


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]


@dataclass
class Tally:
    """Everything the clients saw during one phase."""

    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    answers: dict[tuple[str, str], list[Answer]] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    hostile: Counter[str] = field(default_factory=Counter)
    hostile_unexpected: list[str] = field(default_factory=list)
    edge: Counter[str] = field(default_factory=Counter)  # edge case -> answers
    edge_unexpected: list[str] = field(default_factory=list)
    slow: int = 0
    slow_mismatches: int = 0
    disconnects: int = 0
    rss_kb: list[tuple[float, int]] = field(default_factory=list)
    loop_lag: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # client-side failures: a stream cut, an error event

    async def guarded(self, who: str, call: Awaitable[T]) -> T | None:
        """``call``'s result, or ``None`` with the failure recorded (the soak goes on)."""
        try:
            return await call
        except (RuntimeError, aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError) as exc:
            self.errors.append(f"{who}: {type(exc).__name__}: {exc}"[:300])
            return None


def answer_of(events: list[dict]) -> Answer:
    text, tokens, logprobs = [], [], []
    for event in events:
        if "error" in event:
            raise RuntimeError(f"error event: {event['error']}")
        (choice,) = event["choices"]
        text.append(choice["text"])
        if choice.get("logprobs"):
            tokens += choice["logprobs"]["tokens"]
            logprobs += choice["logprobs"]["token_logprobs"]
    return Answer("".join(text), tuple(tokens), tuple(logprobs))


def sse_events(raw: bytes) -> list[dict]:
    lines = [line.removeprefix(b"data: ") for line in raw.split(b"\n") if line.strip()]
    if not lines or lines[-1] != b"[DONE]":
        raise RuntimeError("stream ended without [DONE]")
    return [json.loads(line) for line in lines[:-1]]


class Soak:
    """The server under test and what the clients need to reach it."""

    def __init__(self, url: str, pid: int, keys: dict[str, str], root: Path) -> None:
        self.url, self.pid, self.keys, self.root = url, pid, keys, root
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    async def post(self, path: str, body: dict | bytes, who: str, tally: Tally) -> tuple[int, dict]:
        """POST ``body`` (JSON bytes sent as they are); the status and the JSON answer."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**self.auth(who), "Content-Type": "application/json"}
        async with self.session.post(self.url + path, data=data, headers=headers) as resp:
            tally.statuses[resp.status] += 1
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, {}

    async def ask(self, path: str, body: dict | bytes, who: str, tally: Tally) -> tuple[int, str | None]:
        """POST ``body``; the status and the error code (``None`` for a success)."""
        status, payload = await self.post(path, body, who, tally)
        return status, payload.get("error", {}).get("code")

    async def stream(self, body: dict, who: str, tally: Tally) -> tuple[Answer, float, float]:
        """A streamed completion read promptly: its answer, TTFT and end-to-end seconds."""
        start = time.perf_counter()
        ttft = None
        async with self.session.post(self.url + "/v1/completions", json=body, headers=self.auth(who)) as resp:
            tally.statuses[resp.status] += 1
            if resp.status != 200:
                raise RuntimeError(f"{who}: {resp.status} {await resp.text()}")
            chunks = []
            async for line in resp.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - start
                chunks.append(line)
        return answer_of(sse_events(b"".join(chunks))), ttft or 0.0, time.perf_counter() - start

    async def raw(self, request: bytes, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        writer.write(request)
        await writer.drain()
        return reader, writer

    def http10(self, path: str, body: bytes, auth: bytes) -> bytes:
        return (
            f"POST {path} HTTP/1.0\r\nHost: {self.host}\r\nContent-Type: application/json\r\n".encode()
            + b"Authorization: "
            + auth
            + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    async def admin_json(self, path: str) -> dict:
        async with self.session.get(self.url + path, headers=self.auth("admin")) as resp:
            return await resp.json()

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics", headers=self.auth("admin")) as resp:
            return await resp.text()

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


# --- the server and its files ------------------------------------------------------------------


def _spoil(src: str, dst: Path, *, weights=None, patterns: dict | None = None) -> Path:
    shutil.copytree(demo_adapter_dirs()[src], dst)
    if weights is not None:
        tensors = load_file(dst / "adapter_model.safetensors")
        save_file({k: weights(k, v) for k, v in tensors.items()}, dst / "adapter_model.safetensors")
    if patterns is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg["alpha_pattern"] = patterns
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _nan_first(key: str, value):
    if key.endswith("q_proj.lora_A.weight") and ".0." in key:
        value = value.clone()
        value.view(-1)[0] = float("nan")
    return value


def write_files(tmp: Path) -> tuple[dict[str, str], Path, Path]:
    """Keys, the tenants file and the adapter root with the hostile adapters in it."""
    who = [*(f"good-{i}" for i in range(GOOD_TENANTS)), "hostile", "slow", "flaky", *EDGE_TENANTS, "admin"]
    keys = {w: f"lp-{w}-{secrets.token_hex(8)}" for w in who}

    def digest(w: str) -> str:
        return hashlib.sha256(keys[w].encode()).hexdigest()

    lines = [f'[admin]\nkey_sha256 = ["{digest("admin")}"]\n']
    for w in who[:-1]:
        adapters = '["initech"]' if w in ("hostile", "hog") else '["*"]'
        limits = EDGE_TENANTS.get(w, "")
        lines.append(f'[tenants.{w}]\nkey_sha256 = ["{digest(w)}"]\nadapters = {adapters}\n{limits}')
    tenants = tmp / "tenants.toml"
    tenants.write_text("\n".join(lines))
    root = tmp / "root"
    root.mkdir()
    _spoil("globex", root / "nan", weights=_nan_first)
    _spoil("acme", root / "overflow", weights=lambda k, v: v * 1e30 if "lora_B" in k else v)
    _spoil("globex", root / "patterned", patterns={"(a+)+$": 1, "(.*)*x": 1, "(.*)*(q_proj)": 16})
    _spoil("globex", root / "refused", patterns={r"(a)\1": 4})
    return keys, tenants, root


def start_server(tmp: Path, tenants: Path, root: Path, device: str | None) -> ServeProcess:
    modules = [f"{name}={path}" for name, path in demo_adapter_dirs().items()]
    args = ["--tenants", str(tenants), "--adapter-root", str(root), *SERVER_FLAGS, "--lora-modules", *modules]
    if device:
        args += ["--device", device]
    return start_serve(*args, under=tmp)  # its --state-dir under tmp: nothing from the user's or an earlier run


# --- clients -----------------------------------------------------------------------------------


async def good_worker(soak: Soak, who: str, offset: int, more: Callable[[], bool], tally: Tally) -> None:
    for i in itertools.count(offset):
        if not more():
            return
        model, prompt = GOOD_REQUESTS[(i * 5) % len(GOOD_REQUESTS)]
        got = await tally.guarded(who, soak.stream(good_body(model, prompt), who, tally))
        if got is None:
            continue
        answer, ttft, e2e = got
        tally.answers.setdefault((model, prompt), []).append(answer)
        tally.ttft.append(ttft)
        tally.e2e.append(e2e)


async def _register_case(soak: Soak, tally: Tally, adapter: str, then: Callable[[], Awaitable[tuple]] | None):
    body = {"id": f"soak-{adapter}", "path": str(soak.root / adapter), "tenant": "hostile"}
    status, code = await soak.ask("/v1/adapters", body, "admin", tally)
    if status != 201 or then is None:
        return status, code
    try:
        return await then()
    finally:
        async with soak.session.delete(soak.url + f"/v1/adapters/soak-{adapter}", headers=soak.auth("admin")) as r:
            tally.statuses[r.status] += 1
            if r.status != 200:
                tally.hostile_unexpected.append(f"delete soak-{adapter}: {r.status}")


def hostile_cases(soak: Soak, tally: Tally, reference: dict) -> dict[str, tuple[Callable[[], Awaitable], tuple]]:
    """Name -> (the hostile call, returning (status, code), and the (status, code) it must get)."""
    greedy = {"model": "initech", "prompt": "Hello there", "max_tokens": 48, "temperature": 0, "logprobs": 1}

    async def tiny(temperature: float):
        answer, _, _ = await soak.stream({**greedy, "temperature": temperature, "stream": True}, "hostile", tally)
        return 200, "same" if answer.tokens == reference[("initech", "Hello there")].tokens else "different"

    def ask(body: dict | bytes) -> Awaitable[tuple[int, str | None]]:
        return soak.ask("/v1/completions", body, "hostile", tally)

    async def overflow_requests():
        greedy_row = await ask({**greedy, "model": "soak-overflow"})
        sampled_row = await ask({**greedy, "model": "soak-overflow", "temperature": 1.0, "seed": 3})
        return greedy_row if greedy_row == sampled_row else (0, f"greedy {greedy_row}, sampled {sampled_row}")

    async def patterned_request():
        status, _ = await ask({**greedy, "model": "soak-patterned"})
        return status, None

    async def not_utf8():
        body = json.dumps(greedy).encode()
        reader, writer = await soak.raw(soak.http10("/v1/completions", body, b"Bearer \xff\xfe-key"))
        raw = await asyncio.wait_for(reader.read(), REQUEST_TIMEOUT_S)
        writer.close()
        status = int(raw.split(b" ", 2)[1])
        tally.statuses[status] += 1
        return status, json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"]

    # Encoded once: the client's own 3 MB json.dumps would stall its loop and inflate its timings.
    big = json.dumps({**greedy, "prompt": "lorem ipsum " * (3 * 2**20 // 12)}).encode()
    return {
        "tiny_temperature_1e-40": (lambda: tiny(1e-40), (200, "same")),
        "tiny_temperature_5e-324": (lambda: tiny(5e-324), (200, "same")),
        "nan_adapter": (lambda: _register_case(soak, tally, "nan", None), (400, "invalid_adapter")),
        "overflow_adapter": (
            lambda: _register_case(soak, tally, "overflow", overflow_requests),
            (400, "sampling_failed"),
        ),
        "3mb_prompt": (
            lambda: ask(big),
            (400, "context_length_exceeded"),
        ),
        "backtracking_keys": (lambda: _register_case(soak, tally, "patterned", patterned_request), (200, None)),
        "re2_refused_key": (lambda: _register_case(soak, tally, "refused", None), (400, "invalid_adapter")),
        "non_utf8_key": (not_utf8, (401, "invalid_api_key")),
        "long_stop": (
            lambda: ask({**greedy, "stop": ["x" * 300]}),
            (400, "invalid_request"),
        ),
        "other_tenants_adapter": (
            lambda: ask({**greedy, "model": "acme"}),
            (404, "model_not_found"),
        ),
    }


async def hostile_worker(soak: Soak, more: Callable[[], bool], tally: Tally, reference: dict, rate: float) -> None:
    """The hostile cases in turn, ``rate`` per second at most: what is measured is what each case
    does to the others, not a request flood (per-tenant quotas are what answer a flood)."""
    cases = hostile_cases(soak, tally, reference)
    start = time.monotonic()
    for n, name in enumerate(itertools.cycle(cases)):
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        if not more():
            return
        call, expected = cases[name]
        got = await tally.guarded(f"hostile {name}", call())
        tally.hostile[name] += 1
        if got is None or tuple(got) != expected:
            tally.hostile_unexpected.append(f"{name}: got {got}, expected {expected}")


async def slow_reader(soak: Soak, more: Callable[[], bool], tally: Tally, want: Answer, stall_s: float) -> None:
    """Tiny socket buffers; one event, then ``stall_s`` of reading nothing, then the rest."""
    body = json.dumps({**SLOW, "logprobs": 5, "stream": True}).encode()
    request = soak.http10("/v1/completions", body, f"Bearer {soak.keys['slow']}".encode())

    async def one() -> Answer:
        reader, writer = await soak.raw(request, rcvbuf=4096)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status = int(head.split(b" ", 2)[1])
            tally.statuses[status] += 1
            if status != 200:
                raise RuntimeError(f"slow reader: {status}")
            first = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
            await asyncio.sleep(stall_s)
            rest = await asyncio.wait_for(reader.read(), REQUEST_TIMEOUT_S)
        finally:
            writer.close()
        return answer_of(sse_events(first + rest))

    while more():
        got = await tally.guarded("slow reader", one())
        tally.slow += 1
        tally.slow_mismatches += got is None or (got.text, got.tokens) != (want.text, want.tokens)


async def disconnector(soak: Soak, more: Callable[[], bool], tally: Tally, seed: int) -> None:
    for i in itertools.count(seed * 1000):
        if not more():
            return
        await tally.guarded("hang-up", hang_up(soak, {**SLOW, "seed": i, "stream": True}, tally))
        await asyncio.sleep(0.2)  # a steady trickle of hang-ups, not a flood


async def hang_up(soak: Soak, body: dict, tally: Tally) -> None:
    resp = await soak.session.post(soak.url + "/v1/completions", json=body, headers=soak.auth("flaky"))
    tally.statuses[resp.status] += 1
    await resp.content.readline()  # the first event: it is generating
    resp.close()  # hang up mid-stream
    tally.disconnects += 1


async def watch(soak: Soak, more: Callable[[], bool], tally: Tally) -> None:
    """Server RSS every half second (a sample may land on a request's transient buffers: medians
    of many tell the trend), the loop-lag gauge every two seconds."""
    start = time.monotonic()
    for n in itertools.count():
        if not more():
            return
        tally.rss_kb.append((time.monotonic() - start, soak.rss_kb()))
        if n % 4 == 0:
            tally.loop_lag.append(metric_sum(await soak.metrics(), "lorapage_event_loop_lag_seconds"))
        await asyncio.sleep(0.5)


def metric_sum(text: str, name: str, keep: Callable[[dict], bool] = lambda labels: True) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name and keep(s.labels)
    )


def samples_by_labels(text: str, name: str) -> dict[tuple[str, ...], float]:
    """``name``'s samples by their label values (in label order)."""
    return {
        tuple(s.labels.values()): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def policy_time(text: str) -> tuple[float, float]:
    """(seconds, steps) the scheduling policy has taken so far, from its /metrics histogram."""
    name = "lorapage_scheduler_policy_seconds"
    return metric_sum(text, f"{name}_sum"), metric_sum(text, f"{name}_count")


def us_per_step(start: tuple[float, float], end: tuple[float, float]) -> float:
    steps = end[1] - start[1]
    return 1e6 * (end[0] - start[0]) / steps if steps else 0.0


# --- edge attacks (issue 26): quota before work, shares of every shared queue, bounded input ----

EDGE_TENANTS = {  # name -> its limits in the tenants file
    "hog": "",  # no limits: bounded only by its share of the queue
    "limited": "rpm = 1\n",
    "metered": "tpm = 6000\n",
    "lister": "rpm = 120\n",
    **ISOLATION_TENANTS,
    **SIZE_TENANTS,
}
FLOOD = 24  # requests the hog sends at once (its share of the queue is 64 / tenants)


async def raw_status(soak: Soak, request: bytes, tally: Tally) -> int:
    """Send ``request`` as bytes on a new connection; the status of the answer (0: closed unanswered)."""
    reader, writer = await soak.raw(request)
    try:
        got = await asyncio.wait_for(reader.read(), REQUEST_TIMEOUT_S)
    finally:
        writer.close()
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/") else 0
    tally.statuses[status] += 1
    return status


def edge_cases(soak: Soak, tally: Tally) -> dict[str, tuple[Callable[[], Awaitable], set]]:
    """Name -> (the attack, returning what it got, and the answers it may get)."""
    comp = "/v1/completions"
    empty_messages = json.dumps(
        {"model": "base", "messages": [{"role": "user", "content": ""}] * 130_000}, separators=(",", ":")
    ).encode()  # 3.8 MB, encoded once
    far_over = json.dumps({"model": "initech", "prompt": "lorem ipsum " * 75_000, "max_tokens": 8}).encode()
    nested = b'{"model": "initech", "prompt": "hi", "echo": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    logprobs_chat = {
        "model": "initech",
        "messages": [{"role": "user", "content": "Once upon a time"}],
        **{"max_tokens": 300, "temperature": 2.0, "seed": 7, "logprobs": True, "top_logprobs": 20},
    }

    async def ask(path: str, body: dict | bytes, who: str) -> tuple[int, str | None]:
        return await soak.ask(path, body, who, tally)

    async def names():
        got = {
            await ask(comp, {"model": m, "prompt": "hi", "max_tokens": 2}, "hog")
            for m in ("initech@²", "initech@" + "9" * 4301)
        }
        return got.pop() if len(got) == 1 else (0, f"{got}")

    async def ids():
        bodies = [{"id": i, "path": str(soak.root / "nan"), "tenant": "hog"} for i in ("a-priv\n", "other")]
        got = {await ask("/v1/adapters", b, "admin") for b in bodies}
        return got.pop() if len(got) == 1 else (0, f"{got}")

    async def bogus_key():
        headers = {"Authorization": f"Bearer lp-{secrets.token_hex(16)}", "Content-Type": "application/json"}
        async with soak.session.post(soak.url + comp, data=b"{}", headers=headers) as resp:
            tally.statuses[resp.status] += 1
            return resp.status, (await resp.json(content_type=None))["error"]["code"]

    async def malformed():
        return await raw_status(soak, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n", tally), None

    async def cut():
        """A long prompt of its own, hung up on shortly after it is sent (before its first token,
        mostly): the tenant pays for what was computed, so it runs out of tokens."""
        prompt = "".join(random.choice("abcdefghij ") for _ in range(4000))
        body = {"model": "base", "prompt": prompt, "max_tokens": 16}
        task = asyncio.create_task(ask(comp, body, "metered"))
        await asyncio.sleep(random.uniform(0.01, 0.08))
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "cut", None

    async def logprobs():
        status, payload = await soak.post("/v1/chat/completions", logprobs_chat, "hog", tally)
        content = payload["choices"][0]["logprobs"]["content"] if status == 200 else []
        return status, "20 each" if content and all(len(c["top_logprobs"]) == 20 for c in content) else "missing"

    async def flood():
        """The hog sends many long requests at once: past its share, 429 for it, never 503 for anyone."""
        body = {**SLOW, "max_tokens": 48}
        got = await asyncio.gather(*(ask(comp, {**body, "seed": i}, "hog") for i in range(FLOOD)))
        statuses = Counter(status for status, _ in got)
        return (429, "share") if set(statuses) == {200, 429} else (0, f"{dict(statuses)}")

    async def models():
        async with soak.session.get(soak.url + "/v1/models", headers=soak.auth("lister")) as resp:
            tally.statuses[resp.status] += 1
            listed = len((await resp.json())["data"]) if resp.status == 200 else 0
            return resp.status, "all" if resp.status != 200 or listed == len(MODELS) + EDGE_ADAPTERS else listed

    ok = (200, None)
    return {
        "130k_empty_messages": (
            lambda: ask("/v1/chat/completions", empty_messages, "limited"),
            {(400, "invalid_request"), (429, "rate_limit_exceeded")},
        ),
        "prompt_far_over_the_context": (lambda: ask(comp, far_over, "hog"), {(400, "context_length_exceeded")}),
        "json_nested_5000_deep": (lambda: ask(comp, nested, "hog"), {(400, "invalid_request")}),
        "model_names_not_names": (names, {(404, "model_not_found")}),
        "adapter_ids_newline_or_reserved": (ids, {(400, "invalid_request")}),
        "bogus_key": (bogus_key, {(401, "invalid_api_key")}),
        "malformed_http": (malformed, {(400, None)}),
        "cut_before_first_token": (cut, {("cut", None), (429, "rate_limit_exceeded"), ok}),
        "top_logprobs_20_whole": (logprobs, {(200, "20 each")}),
        "queue_flood": (flood, {(429, "share")}),
        "models_list": (models, {(200, "all"), (429, "all")}),
    }


async def edge_worker(soak: Soak, more: Callable[[], bool], tally: Tally, rate: float, only: list[str]) -> None:
    """The edge attacks in turn (``only`` these, when given), ``rate`` per second at most (a flood counts as one)."""
    every = {**edge_cases(soak, tally), **isolation_cases(soak, tally), **size_cases(soak, tally)}
    cases = {name: case for name, case in every.items() if not only or name in only}
    if not cases:
        return
    start = time.monotonic()
    for n, name in enumerate(itertools.cycle(cases)):
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        if not more():
            return
        call, expected = cases[name]
        got = await tally.guarded(f"edge {name}", call())
        tally.edge[name] += 1
        if got is None or tuple(got) not in expected:
            tally.edge_unexpected.append(f"{name}: got {got}, expected one of {sorted(map(str, expected))}")


async def _drip(writer: asyncio.StreamWriter) -> None:
    while True:
        writer.write(b"X")
        await writer.drain()
        await asyncio.sleep(0.1)


async def slow_headers(soak: Soak, more: Callable[[], bool], tally: Tally) -> None:
    """A connection that sends a header byte every 100 ms and never ends them: the server must
    close it (``--header-timeout``), again and again."""
    while more():
        reader, writer = await soak.raw(b"GET /health HTTP/1.1\r\nHost: x\r\n")

        dripping = asyncio.create_task(_drip(writer))
        try:
            closed = await asyncio.wait_for(reader.read(), 30.0) == b""
        except (ConnectionResetError, BrokenPipeError):  # closed while a byte was on its way
            closed = True
        except TimeoutError:
            closed = False
        finally:
            dripping.cancel()
            await asyncio.gather(dripping, return_exceptions=True)
            writer.close()
        tally.edge["slow_headers"] += 1
        if not closed:
            tally.edge_unexpected.append("slow_headers: the connection was still open after 30 s")


async def register_many(soak: Soak, n: int) -> None:
    """``n`` adapter ids (copies of one demo adapter) for the /v1/models loop to list."""
    root = soak.root / "many"
    shutil.copytree(demo_adapter_dirs()["globex"], root)
    for i in range(n):
        body = {"id": f"many-{i}", "path": str(root), "tenant": "lister"}
        status, code = await soak.ask("/v1/adapters", body, "admin", Tally())
        if status not in (200, 201):
            raise SystemExit(f"could not register many-{i}: {status} {code}")


def lag_buckets(text: str) -> dict[float, float]:
    """The cumulative bucket counts of ``lorapage_event_loop_lag_samples_seconds``, by upper bound."""
    return {
        float(s.labels["le"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "lorapage_event_loop_lag_samples_seconds_bucket"
    }


def lag_p99(start: dict[float, float], end: dict[float, float]) -> float:
    """The p99 of the loop-lag samples taken between two scrapes: the bucket bound it falls under."""
    total = end.get(float("inf"), 0.0) - start.get(float("inf"), 0.0)
    for bound in sorted(end):
        if total and end[bound] - start.get(bound, 0.0) >= 0.99 * total:
            return bound
    return 0.0


# --- the run -----------------------------------------------------------------------------------


def p99(values: list[float]) -> float:
    p = percentile(values, 99)
    return float("nan") if p is None else p


async def settle(soak: Soak, timeout: float = 60.0) -> dict:
    """Engine stats once nothing runs or waits (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        state = await soak.admin_json("/internal/state")
        engine, server = state["engine"], state["server"]
        idle = not engine["running"] and not engine["queue_depth"] and not server["requests_in_flight"]
        if idle or time.monotonic() > deadline:
            return engine
        await asyncio.sleep(0.2)


def _mismatches(soak: Tally, reference: dict[tuple[str, str], Answer]) -> tuple[int, float]:
    wrong, drift = 0, 0.0
    for k, answers in soak.answers.items():
        for a in answers:
            want = reference[k]
            wrong += (a.text, a.tokens) != (want.text, want.tokens)
            if a.tokens == want.tokens:
                drift = max([drift, *(abs(x - y) for x, y in zip(a.logprobs, want.logprobs))])
    return wrong, drift


async def run(args: argparse.Namespace, soak: Soak) -> dict:
    if "edge" not in args.without:
        await register_many(soak, EDGE_ADAPTERS)  # before the clean run: both phases list the same
        await prepare(soak)
    clean = Tally()
    reference = {}  # one answer to each request, alone: also warms every adapter into the pool
    for model, prompt in GOOD_REQUESTS:
        reference[(model, prompt)], _, _ = await soak.stream(good_body(model, prompt), "good-0", clean)
    want_slow, _, _ = await soak.stream({**SLOW, "logprobs": 5, "stream": True}, "slow", Tally())
    started = itertools.count()
    budget = lambda: next(started) < args.clean_requests  # noqa: E731
    await asyncio.gather(
        *(
            good_worker(soak, f"good-{t}", t * GOOD_WORKERS + w, budget, clean)
            for t in range(GOOD_TENANTS)
            for w in range(GOOD_WORKERS)
        )
    )
    clean_self, _ = _mismatches(clean, reference)
    await settle(soak)
    rss_start = soak.rss_kb()

    soaked = Tally()
    end = time.monotonic() + args.duration
    more = lambda: time.monotonic() < end  # noqa: E731
    start_text = await soak.metrics()
    policy_marks = [policy_time(start_text)]
    lag_start = lag_buckets(start_text)

    async def halfway() -> None:
        await asyncio.sleep(args.duration / 2)
        policy_marks.append(policy_time(await soak.metrics()))

    tasks = [
        *(
            good_worker(soak, f"good-{t}", t * GOOD_WORKERS + w, more, soaked)
            for t in range(GOOD_TENANTS)
            for w in range(GOOD_WORKERS)
        ),
        watch(soak, more, soaked),
        halfway(),
    ]
    if "hostile" not in args.without:
        tasks.append(hostile_worker(soak, more, soaked, reference, args.hostile_rate))
    if "slow" not in args.without:
        tasks += [slow_reader(soak, more, soaked, want_slow, args.slow_stall) for _ in range(SLOW_READERS)]
    if "hangups" not in args.without:
        tasks += [disconnector(soak, more, soaked, i) for i in range(DISCONNECTORS)]
    if "edge" not in args.without:
        tasks.append(edge_worker(soak, more, soaked, args.edge_rate, args.edge_case))
        if not args.edge_case or "slow_headers" in args.edge_case:
            tasks.append(slow_headers(soak, more, soaked))
    await asyncio.gather(*tasks)
    engine = await settle(soak)
    rss_end = soak.rss_kb()
    text = await soak.metrics()
    policy_marks.append(policy_time(text))
    first_half, second_half = (us_per_step(a, b) for a, b in zip(policy_marks, policy_marks[1:]))
    mismatches, drift = _mismatches(soaked, reference)
    third = next((kb for t, kb in soaked.rss_kb if t >= args.duration / 3), rss_start)
    rss_flat_pct = _rss_drift_pct([kb for _, kb in soaked.rss_kb])
    rejected = samples_by_labels(text, "lorapage_tenant_rejected_requests_total")
    e2e_clean, e2e_soak = p99(clean.e2e), p99(soaked.e2e)
    ttft_clean, ttft_soak = p99(clean.ttft), p99(soaked.ttft)
    return {
        "duration_s": args.duration,
        "without": args.without,
        "hostile_rate_per_s": args.hostile_rate,
        "clean_requests": len(clean.e2e),
        "clean_self_mismatches": clean_self,
        "soak_good_requests": len(soaked.e2e),
        "rss_start_mb": rss_start / 1024,
        "rss_end_mb": rss_end / 1024,
        "rss_growth_mb": (rss_end - rss_start) / 1024,
        "rss_growth_late_mb": (rss_end - third) / 1024,
        "rss_growth_late_pct": rss_flat_pct,
        # Ten samples over the soak: a plateau is warm-up, a steady climb a leak.
        "rss_trace_mb": [round(kb / 1024, 1) for _, kb in soaked.rss_kb[:: max(1, len(soaked.rss_kb) // 10)]],
        "p99_e2e_clean_s": e2e_clean,
        "p99_e2e_soak_s": e2e_soak,
        "p99_e2e_ratio": e2e_soak / e2e_clean,
        "p99_ttft_clean_s": ttft_clean,
        "p99_ttft_soak_s": ttft_soak,
        "p99_ttft_ratio": ttft_soak / ttft_clean,
        "output_mismatches": mismatches,
        "logprob_max_abs_diff": drift,
        "slow_reader_requests": soaked.slow,
        "slow_reader_mismatches": soaked.slow_mismatches,
        "disconnects": soaked.disconnects,
        "hostile_requests": sum(soaked.hostile.values()),
        "hostile_by_case": dict(soaked.hostile),
        "hostile_unexpected": len(soaked.hostile_unexpected),
        "hostile_unexpected_examples": soaked.hostile_unexpected[:5],
        "edge_requests": sum(soaked.edge.values()),
        "edge_by_case": dict(soaked.edge),
        "edge_unexpected": len(soaked.edge_unexpected),
        "edge_unexpected_examples": soaked.edge_unexpected[:5],
        "edge_rejected": {f"{t}/{r}": n for (r, t), n in rejected.items() if t in EDGE_TENANTS},
        "size_attacks_last": dict(SIZE_FIGURES),
        "pages_leaked": engine["pool_pages_kv"],
        "pool_accounting_ok": engine["pool_pages_free"] + engine["pool_pages_adapters"] == engine["pool_pages_total"],
        "client_5xx": sum(n for s, n in (clean.statuses + soaked.statuses).items() if s >= 500),
        "server_5xx": int(metric_sum(text, "lorapage_requests_total", lambda labels: labels["status"].startswith("5"))),
        "client_errors": len(clean.errors) + len(soaked.errors),
        "client_error_examples": (clean.errors + soaked.errors)[:5],
        "statuses": {str(s): n for s, n in sorted((clean.statuses + soaked.statuses).items())},
        "loop_lag_max_s": max(soaked.loop_lag, default=0.0),
        "loop_lag_p99_s": lag_p99(lag_start, lag_buckets(text)),
        "policy_us_per_step_first_half": first_half,
        "policy_us_per_step_second_half": second_half,
        "policy_us_per_step_drift": second_half / first_half if first_half else None,
    }


def _rss_drift_pct(trace_kb: list[int]) -> float:
    """How far the server's RSS moved between the middle third of the soak and the last third, in
    percent of the middle (medians: a sample may land on a request's transient buffers)."""
    third = len(trace_kb) // 3
    if third < 1:
        return 0.0
    middle, last = sorted(trace_kb[third : 2 * third]), sorted(trace_kb[2 * third :])
    mid_median, last_median = middle[len(middle) // 2], last[len(last) // 2]
    return 100.0 * (last_median - mid_median) / mid_median


def verdicts(r: dict) -> dict[str, bool]:
    t = TARGETS
    return {
        "output_mismatches": r["output_mismatches"] == t["output_mismatches"] and r["clean_self_mismatches"] == 0,
        "slow_reader_mismatches": r["slow_reader_mismatches"] == t["slow_reader_mismatches"],
        "hostile_unexpected": r["hostile_unexpected"] == t["hostile_unexpected"],
        "pages_leaked": r["pages_leaked"] == t["pages_leaked"] and r["pool_accounting_ok"],
        "client_errors": r["client_errors"] == t["client_errors"],
        "5xx": r["server_5xx"] == t["server_5xx"] and r["client_5xx"] == t["client_5xx"],
        "p99_e2e_ratio": r["p99_e2e_ratio"] <= t["p99_e2e_ratio_max"],
        "rss_growth_late_mb": r["rss_growth_late_mb"] <= t["rss_growth_late_mb_max"],
        "rss_growth_late_pct": abs(r["rss_growth_late_pct"]) <= t["rss_growth_late_pct_max"],
        "loop_lag_max_s": r["loop_lag_max_s"] <= t["loop_lag_max_s"],
        "loop_lag_p99_s": r["loop_lag_p99_s"] <= t["loop_lag_p99_s_max"],
        "edge_unexpected": r["edge_unexpected"] == t["edge_unexpected"],
        "server_tracebacks": r["server_tracebacks"] == t["server_tracebacks"],
        "policy_drift": r["policy_us_per_step_drift"] is not None
        and r["policy_us_per_step_drift"] <= t["policy_drift_max"],
    }


def print_table(r: dict, met: dict[str, bool]) -> None:
    print(machine_line())
    print(
        f"Soak: {r['duration_s']:.0f} s; {GOOD_TENANTS}x{GOOD_WORKERS} good streams, 1 hostile, {SLOW_READERS} slow, {DISCONNECTORS} hanging up"
        + (f" (without {', '.join(r['without'])})" if r["without"] else "")
    )
    rows = [
        ("good requests (clean / soak)", f"{r['clean_requests']} / {r['soak_good_requests']}", ""),
        (
            "p99 end-to-end s (clean / soak)",
            f"{r['p99_e2e_clean_s']:.3f} / {r['p99_e2e_soak_s']:.3f}",
            f"ratio {r['p99_e2e_ratio']:.2f}",
        ),
        (
            "p99 TTFT s (clean / soak)",
            f"{r['p99_ttft_clean_s']:.3f} / {r['p99_ttft_soak_s']:.3f}",
            f"ratio {r['p99_ttft_ratio']:.2f}",
        ),
        (
            "good outputs unlike the clean run",
            str(r["output_mismatches"]),
            f"logprob drift {r['logprob_max_abs_diff']:.1e}",
        ),
        ("slow readers (wrong text)", f"{r['slow_reader_requests']} ({r['slow_reader_mismatches']})", ""),
        ("hang-ups", str(r["disconnects"]), ""),
        ("hostile requests (unexpected answers)", f"{r['hostile_requests']} ({r['hostile_unexpected']})", ""),
        ("edge attacks (unexpected answers)", f"{r['edge_requests']} ({r['edge_unexpected']})", ""),
        (
            "KV pages held afterwards",
            str(r["pages_leaked"]),
            f"pool accounting {'ok' if r['pool_accounting_ok'] else 'WRONG'}",
        ),
        ("5xx (server / client)", f"{r['server_5xx']} / {r['client_5xx']}", f"client errors {r['client_errors']}"),
        (
            "server RSS MB (start -> end)",
            f"{r['rss_start_mb']:.0f} -> {r['rss_end_mb']:.0f}",
            f"after 1/3: {r['rss_growth_late_mb']:+.1f}; median drift {r['rss_growth_late_pct']:+.1f}%",
        ),
        ("loop lag s (worst / p99 of samples)", f"{r['loop_lag_max_s']:.3f} / {r['loop_lag_p99_s']:.3f}", ""),
        ("tracebacks in the server log", str(r["server_tracebacks"]), ""),
        (
            "policy us/step (1st half / 2nd half)",
            f"{r['policy_us_per_step_first_half']:.1f} / {r['policy_us_per_step_second_half']:.1f}",
            f"drift {r['policy_us_per_step_drift']:.2f}" if r["policy_us_per_step_drift"] else "",
        ),
    ]
    for name, value, note in rows:
        print(f"{name:<40} {value:>22}  {note}")
    print(f"server RSS MB over the soak: {r['rss_trace_mb']}")
    if r.get("server_traceback_example"):
        print(f"first traceback in the server log:\n{r['server_traceback_example']}")
    for example in r["hostile_unexpected_examples"] + r["edge_unexpected_examples"]:
        print(f"  unexpected: {example}")
    if r["edge_by_case"]:
        print(f"edge attacks by case: {r['edge_by_case']}; refused (tenant/reason): {r['edge_rejected']}")
    for example in r["client_error_examples"]:
        print(f"  client error: {example}")
    print("targets:", ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in met.items()))


async def amain(args: argparse.Namespace, tmp: Path) -> dict:
    keys, tenants, root = write_files(tmp)
    server = start_server(tmp, tenants, root, args.device)
    soak = Soak(server.url, server.proc.pid, keys, root)
    try:
        result = await run(args, soak)
    finally:
        await soak.session.close()
        result_code = server.stop()
    result["server_exit_code"] = result_code
    server_log = server.output()
    result["server_tracebacks"] = server_log.count("Traceback")
    first = server_log.find("Traceback")
    result["server_traceback_example"] = server_log[max(0, first - 300) : first + 2500] if first >= 0 else ""
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of soak")
    parser.add_argument("--quick", action="store_true", help="30 s of soak, fewer clean requests")
    parser.add_argument("--clean-requests", type=int, default=None, help="requests in the clean phase")
    parser.add_argument("--slow-stall", type=float, default=2.0, help="seconds a slow reader reads nothing")
    parser.add_argument("--hostile-rate", type=float, default=5.0, help="hostile requests per second, at most")
    parser.add_argument("--edge-rate", type=float, default=2.0, help="edge attacks per second, at most")
    parser.add_argument(
        "--edge-case",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this edge attack (repeatable; names as in the result's edge_by_case)",
    )
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        choices=("hostile", "slow", "hangups", "edge"),
        help="leave a kind of client out of the soak (repeatable), to see what costs the good tenants latency",
    )
    parser.add_argument("--device", default=None, help="the server's --device (default: its own)")
    args = parser.parse_args()
    if args.quick:
        args.duration = 30.0
    args.clean_requests = args.clean_requests or (96 if args.quick else 240)
    tmp = Path(tempfile.mkdtemp(prefix="lorapage-soak-"))
    try:
        result = asyncio.run(amain(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    met = verdicts(result)
    print_table(result, met)
    print_json({**result, "targets": TARGETS, "met": met, "all_met": all(met.values()), **machine_info()})


if __name__ == "__main__":
    main()
