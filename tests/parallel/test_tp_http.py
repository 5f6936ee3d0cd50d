"""``lorapage serve --tensor-parallel-size 2`` as a real server (gloo on this CPU) against TP=1.

Three servers start at once, each a child process on a free 127.0.0.1 port (``--port 0``): one
at TP=1 and two at TP=2, so two process groups rendezvous and step on one host at the same time
(each in a private FileStore directory; gloo's own sockets on ports the kernel picks; docs/parallel.md).
The same greedy requests, the base and two demo adapters, sent at once to each (one mixed batch
on each server, the two TP=2 groups all-reducing side by side), answer the same tokens everywhere;
the adapters answer their own phrases (their shards reached the worker rank). SIGTERM stops each
server cleanly and takes its worker rank with it.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lorapage.testing.serve_process import ServeProcess, start_serve

pytestmark = pytest.mark.slow  # three servers and two worker ranks start: ~16 CPU-seconds

KEY = "tp-test-key"
MODELS = ("base", "acme", "globex")  # the tiny model and two demo adapters
PROMPT = "Hello, who is this?"


def _start(tp: int, under: Path) -> ServeProcess:
    return start_serve(
        "--tensor-parallel-size", str(tp), "--api-key", KEY, "--num-threads", "1", under=under, timeout_s=120
    )


def _complete(url: str, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid`` (a server's worker rank, multiprocessing's resource
    tracker), with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = cmdline.replace("\0", " ")
    return found


def _all_gone(pids: list[int], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_tp2_servers_answer_as_tp1_two_groups_side_by_side(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        started = list(pool.map(lambda tp: _start(tp, tmp_path), (1, 2, 2)))
    one, *twos = started
    try:
        assert len({s.url for s in started}) == 3
        workers = {s.url: _children(s.proc.pid) for s in twos}
        with ThreadPoolExecutor(len(started) * len(MODELS)) as pool:
            answers = dict(
                zip(
                    [(s.url, m) for s in started for m in MODELS],
                    pool.map(lambda sm: _complete(*sm), [(s.url, m) for s in started for m in MODELS]),
                    strict=True,
                )
            )
        for model in MODELS:
            want = answers[one.url, model]
            assert want["tokens"], model
            for two in twos:
                assert answers[two.url, model] == want, (model, two.url)
        # The adapters changed the answer (their pages on the worker rank hold their shards).
        texts = {m: answers[twos[0].url, m]["text"] for m in MODELS}
        assert len(set(texts.values())) == len(MODELS), texts
    finally:
        codes = [s.stop() for s in started]
    assert codes == [0, 0, 0], [s.output()[-2000:] for s in started]
    for url, children in workers.items():
        ranks = [pid for pid, cmd in children.items() if "spawn_main" in cmd]
        assert len(ranks) == 1, (url, children)  # one worker rank per TP=2 server, its own
        assert _all_gone(list(children)), (url, children)
