"""The request log (``--access-log``) over real HTTP: one JSON line per answered request, with
the adapter version, tier, tokens, TTFT and status, for answers and refusals alike; never prompt
text, output text or keys."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_harness import ADMIN_KEY, KEYS, make_engine, running_server

from lorapage.frontend.access_log import AccessLog
from lorapage.tiny import DEMO_MARKERS

SECRET_PROMPT = "my-secret-prompt-7f3a"


async def test_every_answer_is_one_line_without_text_or_keys(tmp_path):
    path = tmp_path / "access.jsonl"
    engine = make_engine()
    try:
        async with running_server(engine, access_log=AccessLog(str(path))) as srv:
            chat = {"model": "acme", "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 8}
            status, out, headers = await srv.post("/v1/chat/completions", {**chat, "temperature": 0})
            assert status == 200, out
            request_id = headers["x-request-id"]
            body = {"model": engine.base_name, "prompt": SECRET_PROMPT, "max_tokens": 4, "stream": True}
            async with srv.session.post(srv.url + "/v1/completions", json=body, headers=srv.auth("gamma")) as resp:
                assert resp.status == 200
                await resp.read()
            status, _, _ = await srv.request(
                "POST", "/v1/completions", headers={"Authorization": "Bearer wrong"}, body={"model": "acme"}
            )
            assert status == 401
            status, _, _ = await srv.post("/v1/completions", {"model": "acme", "prompt": "x", "max_tokens": -1})
            assert status == 400
            status, _, _ = await srv.request("GET", "/v1/adapters/acme", headers=srv.admin())
            assert status == 200
    finally:
        await engine.close()
    text = path.read_text()
    for secret in (SECRET_PROMPT, DEMO_MARKERS["acme"], *KEYS.values(), ADMIN_KEY, "wrong"):
        assert secret not in text, secret
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(r["method"], r["route"], r["status"]) for r in lines] == [
        ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/completions", 200),
        ("POST", "/v1/completions", 401),
        ("POST", "/v1/completions", 400),
        ("GET", "/v1/adapters/{id}", 200),
    ]
    chat_line, stream_line = lines[0], lines[1]
    assert chat_line["request_id"] == request_id and chat_line["tenant"] == "alpha" and chat_line["model"] == "acme"
    assert chat_line["adapter"] == engine.admin.catalog.resolve_version("acme")  # id@N: the version it ran on
    assert chat_line["tier"] in ("disk", "host", "pool") and chat_line["output_tokens"] > 0
    assert chat_line["prompt_tokens"] > 0 and 0 < chat_line["ttft_s"] <= chat_line["e2e_s"]
    assert stream_line["tenant"] == "gamma" and stream_line["adapter"] is None and stream_line["tier"] == "none"
    assert stream_line["output_tokens"] == 4
    assert all(r["e2e_s"] >= 0 and r["ts"].endswith("Z") for r in lines)
    assert "tenant" not in lines[3]  # a refused key: no tenant to name


@pytest.mark.parametrize("target", ["-"])
async def test_standard_output(target, capsys):
    log = AccessLog(target)
    log.write({"status": 200})
    log.close()
    assert json.loads(capsys.readouterr().out) == {"status": 200}


async def test_a_stream_the_client_cuts_is_logged_and_counted_with_the_status_it_sent(tmp_path):
    """The handler of a stream whose client went away ends cancelled, not with a response: it is
    still one line and one count, with the 200 its headers carried (and its tenant's SLOs judge it)."""
    path = tmp_path / "access.jsonl"
    engine = make_engine()
    try:
        async with running_server(engine, access_log=AccessLog(str(path))) as srv:
            body = {"model": engine.base_name, "prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with srv.session.post(srv.url + "/v1/completions", json=body, headers=srv.auth("gamma")) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the first event, then the connection is dropped
                resp.connection.transport.abort()  # type: ignore[union-attr]
            for _ in range(100):  # the server notices the cut within a step or two
                if path.read_text().strip():
                    break
                await asyncio.sleep(0.05)
            status, text, _ = await srv.request("GET", "/metrics", headers=srv.admin())
            assert status == 200
    finally:
        await engine.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert (lines[0]["route"], lines[0]["status"], lines[0]["tenant"]) == ("/v1/completions", 200, "gamma")
    assert 0 < lines[0]["output_tokens"] < 400
    assert 'lorapage_requests_total{route="/v1/completions",status="200"} 1.0' in text
