"""vLLM's extra routes on a real server: /tokenize, /detokenize, /tokenizer_info (and lm-eval's
remote tokenizer over them), /version, /ping, /v1/load_lora_adapter and /v1/unload_lora_adapter,
and the 404 of an unknown route naming the nearest one."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from server_harness import (  # noqa: F401 (server: the module's fixture)
    BASE,
    KEYS,
    assert_openai_error,
    expected_text,
    server,
)

from lorapage.errors import QuotaExceededError
from lorapage.frontend.app import STATE
from lorapage.frontend.tokenization import KEYLESS_IN_FLIGHT, KeylessShare
from lorapage.tiny import demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}]


# -- /tokenize, /detokenize, /tokenizer_info ---------------------------------------------------------


async def test_tokenize_a_prompt_as_the_tokenizer_does(server):
    tokenizer = server.engine.tokenizer
    status, got, _ = await server.post("/tokenize", {"model": "acme", "prompt": "Hello there"})
    assert status == 200, got
    want = tokenizer.encode("Hello there", add_special_tokens=True)
    assert got == {"count": len(want), "max_model_len": server.engine.max_model_len, "tokens": want}
    assert want[0] == tokenizer.bos_token_id  # the tiny tokenizer adds BOS, as its config says

    status, bare, _ = await server.post(
        "/tokenize", {"prompt": "Hello there", "add_special_tokens": False, "return_token_strs": True}
    )
    assert status == 200 and bare["tokens"] == want[1:]
    assert bare["token_strs"] == [tokenizer.backend.id_to_token(i) for i in want[1:]]


async def test_tokenize_a_chat_through_the_template(server):
    tokenizer = server.engine.tokenizer
    for generation_prompt in (True, False):
        body = {"model": BASE, "messages": CHAT, "add_generation_prompt": generation_prompt}
        status, got, _ = await server.post("/tokenize", body)
        assert status == 200, got
        text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
        assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert text.endswith("<|assistant|>") == generation_prompt
    # The chat request of the same messages is charged exactly those tokens.
    status, chat, _ = await server.post("/v1/chat/completions", {"model": BASE, "messages": CHAT, "max_tokens": 2})
    assert status == 200 and chat["usage"]["prompt_tokens"] == len(tokenizer.encode(text + "<|assistant|>", False))


async def test_detokenize_round_trips_and_keeps_special_tokens(server):
    status, got, _ = await server.post("/tokenize", {"prompt": "Grüße, world"})
    status, text, _ = await server.post("/detokenize", {"model": "acme", "tokens": got["tokens"]})
    assert status == 200 and text == {"prompt": "<|startoftext|>Grüße, world"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"model": BASE}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "prompts": "x"}, 400, "prompts"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 7*7 }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x" * 600}, 400, "prompt"),  # past the 512-token context
        ("/tokenize", {"model": "initech", "prompt": "hi"}, 404, "model"),  # beta's adapter
        ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1] * 513}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)
async def test_tokenizer_routes_refuse_bad_input_clearly(server, path, body, status, param):
    got_status, got, _ = await server.post(path, body)
    assert got_status == status, got
    assert_openai_error(got, status, param)


async def test_tokenizer_routes_take_a_tenant_key_and_count_against_its_rate(server):
    bodies = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [104, 105]}, "/tokenizer_info": None}
    for path, method in [("/tokenize", "POST"), ("/detokenize", "POST"), ("/tokenizer_info", "GET")]:
        status, got, _ = await server.request(method, path, headers=server.admin(), body=bodies[path])
        assert status == 401 and "admin key only opens admin routes" in got["error"]["message"]
        wrong = {"Authorization": "Bearer not-a-key"}
        assert (await server.request(method, path, headers=wrong, body=bodies[path]))[0] == 401
    # gamma may send two requests a minute: a third tokenizer request is a 429 like any other.
    assert (await server.post("/tokenize", {"prompt": "hi"}, tenant="gamma"))[0] == 200
    assert (await server.post("/detokenize", {"tokens": [104, 105]}, tenant="gamma"))[0] == 200
    status, got, headers = await server.request("GET", "/tokenizer_info", headers=server.auth("gamma"))
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert_openai_error(got, 429)


async def test_without_a_key_only_the_base_tokenizer_answers(server):
    """vLLM's tokenizer routes answer without a key (lm-eval probes them so): the base model's
    tokenizer, which every tenant shares; naming a model takes a key (which adapters exist is a
    tenant's question), and key-less callers hold few requests at once, together."""
    tokenizer = server.engine.tokenizer
    status, got, _ = await server.request("POST", "/tokenize", body={"prompt": "Hello", "add_special_tokens": False})
    assert status == 200 and got["tokens"] == tokenizer.encode("Hello", add_special_tokens=False)
    status, got, _ = await server.request("POST", "/detokenize", body={"tokens": got["tokens"]})
    assert status == 200 and got == {"prompt": "Hello"}
    status, info, _ = await server.request("GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == "<|endoftext|>"
    for model in ("acme", "initech", "nope", BASE):  # owned, another tenant's, unknown, the base: all alike
        status, got, _ = await server.request("POST", "/tokenize", body={"model": model, "prompt": "hi"})
        assert status == 401 and "only the base model's tokenizer" in got["error"]["message"], model
    bodies = [{"prompt": "x" * 20_000}] * (KEYLESS_IN_FLIGHT * 4)
    answers = await asyncio.gather(*(server.request("POST", "/tokenize", body=b) for b in bodies))
    for status, got, _ in answers:  # longer than the context (400), or past the share (429)
        assert status in (400, 429), got
        assert_openai_error(got, status)
    assert (await server.request("POST", "/tokenize", body={"prompt": "hi"}))[0] == 200  # the share came back


async def test_keyless_callers_share_a_few_requests_at_once():
    share = KeylessShare(limit=2)
    share.admit()
    share.admit()
    with pytest.raises(QuotaExceededError, match="without an API key"):
        share.admit()
    share.release()
    share.admit()


async def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(server):
    status, info, _ = await server.request("GET", "/tokenizer_info", headers=server.auth())
    tokenizer = server.engine.tokenizer
    assert status == 200
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] == "<|startoftext|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == server.engine.max_model_len


async def test_lm_eval_remote_tokenizer_and_generation_run_offline(server):
    """lm-eval's local-completions model finds the remote tokenizer by itself ("auto": it probes
    /tokenizer_info and /tokenize), tokenizes through it and generates: no Hugging Face download."""
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is in the dev extra")
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    key, tokenizer = KEYS["alpha"], server.engine.tokenizer

    def run() -> tuple[bool, list[str], object]:
        found = utils.check_remote_tokenizer_support(server.url + "/v1/completions", auth_token=key)
        remote = utils.RemoteTokenizer(server.url, auth_token=key)
        assert remote.eos_token_id == tokenizer.eos_token_id and remote.bos_token_id == tokenizer.bos_token_id
        assert remote.encode("Hello there") == tokenizer.encode("Hello there", add_special_tokens=False)
        assert remote.decode(tokenizer.encode("Hello", False)) == "Hello"
        specials = {k: remote.tokenizer_info[k] for k in ("bos_token", "eos_token")}  # lm-eval passes none itself
        assert remote.apply_chat_template(CHAT, **specials) == tokenizer.apply_chat_template(CHAT)
        lm = completions.LocalCompletionsAPI(
            base_url=server.url + "/v1/completions",
            model="acme",
            auth_token=key,
            header={"Authorization": f"Bearer {key}"},
            max_length=server.engine.max_model_len,
            max_gen_toks=48,
        )
        requests = [
            Instance("generate_until", None, ("Hello there", {"until": ["\n\n"], "max_gen_toks": 48}), idx)
            for idx in range(2)
        ]
        return found, lm.generate_until(requests, disable_tqdm=True), lm.tokenizer_backend

    found, outputs, backend = await asyncio.to_thread(run)
    assert found and backend == "remote"
    assert outputs == [expected_text("acme")] * 2


# -- /version, /ping -----------------------------------------------------------------------------


async def test_version_and_ping_take_no_key(server):
    from lorapage.cli import version

    status, got, _ = await server.request("GET", "/version")
    assert status == 200 and got == {"version": version()}
    for method in ("GET", "POST"):
        status, got, _ = await server.request(method, "/ping")
        assert status == 200 and got == ""
    status, got, _ = await server.request("PUT", "/ping")
    assert status == 405 and "GET" in got["error"]["message"] and "POST" in got["error"]["message"]


# -- unknown routes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "near"),
    [
        ("POST", "/v1/adapter", "POST /v1/adapters"),
        ("POST", "/v1/chat/completion", "POST /v1/chat/completions"),
        ("POST", "/chat/completions", "POST /v1/chat/completions"),
        ("GET", "/v1/adapters/acme/version", "GET /v1/adapters/{id}/versions"),
        ("POST", "/v1/tokenize", "POST /tokenize"),
        ("POST", "/v1/response", "POST /v1/responses"),
        ("POST", "/v1/load_lora", "POST /v1/load_lora_adapter"),
        ("GET", "/tokenizer-info", "GET /tokenizer_info"),
        ("POST", "/v1/embeddings", None),
        ("GET", "/" + "x" * 5000, None),
    ],
)
async def test_unknown_route_names_the_nearest_one(server, method, path, near):
    status, got, _ = await server.request(method, path, headers=server.auth())
    assert status == 404
    assert_openai_error(got, 404)
    message = got["error"]["message"]
    assert message.startswith(f"no route {method} {path[:128]}")
    if near is None:
        assert "did you mean" not in message
    else:
        assert f"did you mean {near}?" in message


# -- /v1/load_lora_adapter, /v1/unload_lora_adapter --------------------------------------------------


def _adapter_copy(server, name: str) -> Path:
    """A copy of a demo adapter under the server's adapter root (where registration may read)."""
    dst = Path(tempfile.mkdtemp(dir=server.adapter_root)) / name
    shutil.copytree(demo_adapter_dirs()[name], dst)
    return dst


async def _complete(server, model: str, tenant: str = "alpha"):
    body = {"model": model, "prompt": "Hello there", "temperature": 0, "max_tokens": 48}
    return await server.post("/v1/completions", body, tenant=tenant)


async def test_load_lora_adapter_registers_for_a_tenant_and_unload_deletes(server):
    path = _adapter_copy(server, "globex")
    body = {"lora_name": "vllm-style", "lora_path": str(path), "tenant": "alpha"}
    status, got, headers = await server.post("/v1/load_lora_adapter", body, tenant=None, headers=server.admin())
    assert status == 200 and got == "Success: LoRA adapter 'vllm-style' added successfully."
    assert headers["Content-Type"].startswith("text/plain")
    status, got, _ = await _complete(server, "vllm-style")
    assert status == 200 and got["choices"][0]["text"] == expected_text("globex")
    assert (await _complete(server, "vllm-style", tenant="beta"))[0] == 404  # alpha's own
    _, described, _ = await server.request("GET", "/v1/adapters/vllm-style", headers=server.admin())
    assert described["owner"] == "alpha" and described["versions"] == [1]

    # A second load of the name is refused as vLLM refuses it; load_inplace makes a new version.
    status, got, _ = await server.post("/v1/load_lora_adapter", body, tenant=None, headers=server.admin())
    assert status == 400 and "has already been loaded" in got["error"]["message"]
    assert_openai_error(got, 400, "lora_name")
    inplace = {**body, "lora_path": str(_adapter_copy(server, "acme")), "load_inplace": True}
    status, got, _ = await server.post("/v1/load_lora_adapter", inplace, tenant=None, headers=server.admin())
    assert status == 200, got
    _, described, _ = await server.request("GET", "/v1/adapters/vllm-style", headers=server.admin())
    assert described["versions"] == [1, 2] and described["current"] == 2
    assert (await _complete(server, "vllm-style"))[1]["choices"][0]["text"] == expected_text("acme")
    # Another tenant cannot take the id over (the registration's ownership rule).
    status, got, _ = await server.post(
        "/v1/load_lora_adapter", {**inplace, "tenant": "beta"}, tenant=None, headers=server.admin()
    )
    assert status == 409, got

    status, got, _ = await server.post(
        "/v1/unload_lora_adapter", {"lora_name": "vllm-style"}, tenant=None, headers=server.admin()
    )
    assert status == 200 and got == "Success: LoRA adapter 'vllm-style' removed successfully."
    assert (await _complete(server, "vllm-style"))[0] == 404
    status, got, _ = await server.post(
        "/v1/unload_lora_adapter", {"lora_name": "vllm-style"}, tenant=None, headers=server.admin()
    )
    assert status == 404 and got["error"]["message"] == "The lora adapter 'vllm-style' cannot be found."


async def test_unload_drains_requests_in_flight(server):
    path = _adapter_copy(server, "acme")
    body = {"lora_name": "draining", "lora_path": str(path), "tenant": "alpha"}
    assert (await server.post("/v1/load_lora_adapter", body, tenant=None, headers=server.admin()))[0] == 200
    release, original = asyncio.Event(), server.engine.generate

    async def gated(*args, **kwargs):  # holds the request before its first output until released
        await release.wait()
        async for out in original(*args, **kwargs):
            yield out

    server.engine.generate = gated
    try:
        running = asyncio.ensure_future(_complete(server, "draining"))
        state = server.app[STATE]
        while state.in_flight.get("draining@1", 0) == 0:
            await asyncio.sleep(0.01)
        unload = asyncio.ensure_future(
            server.post("/v1/unload_lora_adapter", {"lora_name": "draining"}, tenant=None, headers=server.admin())
        )
        while "draining@1" not in state.draining:
            await asyncio.sleep(0.01)
        assert (await _complete(server, "draining"))[0] == 404  # new requests no longer see it
        release.set()
        status, done, _ = await asyncio.wait_for(running, 30)
        assert status == 200 and done["choices"][0]["text"] == expected_text("acme")
        status, got, _ = await asyncio.wait_for(unload, 30)
        assert status == 200, got
    finally:
        server.engine.generate = original
        release.set()
    assert (await server.request("GET", "/v1/adapters/draining", headers=server.admin()))[0] == 404


async def test_load_lora_adapter_without_a_tenant_is_shared_and_fails_closed(server):
    """No owner: like a --lora-modules adapter, only tenants whose `adapters` list opens it may use
    it (none of this server's tenants lists it), and it is read only from shared roots."""
    body = {"lora_name": "shared-one", "lora_path": str(_adapter_copy(server, "acme"))}
    assert (await server.post("/v1/load_lora_adapter", body, tenant=None, headers=server.admin()))[0] == 200
    _, described, _ = await server.request("GET", "/v1/adapters/shared-one", headers=server.admin())
    assert described["owner"] is None
    assert (await _complete(server, "shared-one"))[0] == 404
    outside = {"lora_name": "outside", "lora_path": str(demo_adapter_dirs()["acme"].parent.parent)}
    status, got, _ = await server.post("/v1/load_lora_adapter", outside, tenant=None, headers=server.admin())
    assert status in (400, 403) and got["error"]["param"] == "lora_path", got
    hub = {"lora_name": "hub", "lora_path": "hf://someorg/some-lora"}
    status, got, _ = await server.post("/v1/load_lora_adapter", hub, tenant=None, headers=server.admin())
    assert status == 403 and "name the tenant" in got["error"]["message"], got
    await server.post("/v1/unload_lora_adapter", {"lora_name": "shared-one"}, tenant=None, headers=server.admin())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/tmp"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "a b", "lora_path": "/tmp"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "/tmp"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp", "tenant": "nobody"}, "tenant"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp", "base_model_name": "other"}, None),
        ("/v1/unload_lora_adapter", {"lora_name": "acme", "lora_int_id": 3}, "lora_int_id"),
        ("/v1/unload_lora_adapter", {}, "lora_name"),
    ],
)
async def test_lora_routes_refuse_bad_bodies(server, path, body, param):
    status, got, _ = await server.post(path, body, tenant=None, headers=server.admin())
    assert status == 400, got
    assert_openai_error(got, 400, param)


async def test_lora_routes_take_the_admin_key_only(server):
    body = {"lora_name": "acme"}
    status, got, _ = await server.post("/v1/unload_lora_adapter", body)  # alpha's key
    assert status == 403, got
    status, got, _ = await server.post("/v1/unload_lora_adapter", body, tenant=None)
    assert status == 401, got
    assert (await _complete(server, "acme"))[0] == 200  # still there


async def test_routes_answer_json_on_the_wire(server):
    """Every JSON answer of these routes parses whole (no Python reprs, no HTML)."""
    for method, path, body in [("POST", "/tokenize", {"prompt": "x"}), ("GET", "/tokenizer_info", None)]:
        async with server.session.request(method, server.url + path, json=body, headers=server.auth()) as resp:
            assert resp.headers["Content-Type"].startswith("application/json")
            json.loads(await resp.text())
