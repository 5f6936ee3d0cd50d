"""Adapter versions and aliases: deploy and roll back with requests in flight (each request's
tokens checked against transformers + peft on the version it started on), re-registration of
known content, deletion per version, and base pinning."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from engine_util import collect
from hf_reference import make_peft_adapter, make_random_llama, peft_greedy
from safetensors.torch import load_file, save_file
from server_harness import assert_openai_error, make_access, make_engine, make_roots, running_server

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import AdapterBaseMismatchError, ConflictError, LorapageError
from lorapage.registry.audit import AuditQuery
from lorapage.tiny import DEMO_MARKERS, TINY_BASE_DIR, demo_adapter_dirs

PROMPT = [3, 17, 42, 5, 99, 23]
TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama and two versions of one customer's adapter, with PEFT's greedy tokens."""
    root = tmp_path_factory.mktemp("versions")
    base = make_random_llama(root / "base", seed=11)
    v1 = make_peft_adapter(base, root / "v1", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=1)
    v2 = make_peft_adapter(base, root / "v2", r=4, targets=["k_proj", "o_proj", "up_proj"], seed=2)
    ref = {n: peft_greedy(base, p, PROMPT, TOKENS)[0] for n, p in (("v1", v1), ("v2", v2))}
    assert ref["v1"] != ref["v2"]
    return base, v1, v2, ref


async def test_deploy_and_rollback_with_requests_in_flight_match_peft_per_version(checkpoint, tmp_path):
    base, v1, v2, ref = checkpoint
    engine = Engine(EngineConfig(model=str(base), block_size=4, state_dir=str(tmp_path / "state")))
    first = engine.add_adapter("cust", v1)
    assert (first.name, first.version, first.current) == ("cust@1", 1, True)
    # A request starts on version 1 ...
    on_v1 = engine.generate(PROMPT, "cust", GREEDY)
    tokens_v1 = list((await on_v1.__anext__()).token_ids)
    # ... version 2 is deployed while it runs ...
    second = await engine.register_adapter("cust", v2)
    assert (second.name, second.version, second.created) == ("cust@2", 2, True)
    started_on_v2 = asyncio.ensure_future(collect(engine, PROMPT, "cust", GREEDY))
    # ... and rolled back while both run: each finishes on the version it started with.
    rolled = await engine.admin.catalog.move("cust", 1)
    assert rolled.key == "cust@1"
    async for out in on_v1:
        tokens_v1 = list(out.token_ids)
    assert tokens_v1 == ref["v1"]
    assert list((await started_on_v2)[0].token_ids) == ref["v2"]
    assert list((await collect(engine, PROMPT, "cust", GREEDY))[0].token_ids) == ref["v1"]  # the alias again
    assert list((await collect(engine, PROMPT, "cust@2", GREEDY))[0].token_ids) == ref["v2"]  # by version
    # The same content again is the same version (made current), not a new one.
    again = await engine.register_adapter("cust", v2)
    assert (again.name, again.created, again.current) == ("cust@2", False, True)
    assert [v.version for v in engine.admin.catalog.versions("cust")] == [1, 2]
    # The current version of several cannot be deleted; another one can, and its number is never reused.
    with pytest.raises(ConflictError, match="point the alias"):
        engine.admin.catalog.remove("cust@2")
    engine.admin.catalog.remove("cust@1")
    third = await engine.register_adapter("cust", v1)
    assert third.name == "cust@3"
    await engine.close()


async def test_versions_aliases_and_owners_over_http(tmp_path):
    """Registration answers 201 for new content and 200 for known content, x-adapter-version
    names the version that served, PUT .../current deploys and rolls back, DELETE works per
    version and per id."""
    root = tmp_path / "root"
    root.mkdir()
    for name in ("acme", "globex"):
        shutil.copytree(demo_adapter_dirs()[name], root / name)
    engine = make_engine(make_roots(root))
    async with running_server(engine) as srv:

        async def register(src: str, expect: int):
            status, body, _ = await srv.post(
                "/v1/adapters", {"id": "cust", "source": str(root / src), "tenant": "alpha"}, headers=srv.admin()
            )
            assert status == expect, body
            return body

        async def answer(model: str, tenant: str = "alpha"):
            body = {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}
            return await srv.post(COMP, body, tenant=tenant)

        v1 = await register("acme", 201)
        assert (v1["id"], v1["version"], v1["current"], v1["versions"]) == ("cust", 1, 1, [1])
        assert v1["digest"] and v1["source"].startswith("file://")
        status, body, headers = await answer("cust")
        assert status == 200 and body["choices"][0]["text"] == DEMO_MARKERS["acme"]
        assert (headers["x-adapter-id"], headers["x-adapter-version"]) == ("cust", "1")
        v2 = await register("globex", 201)
        assert (v2["version"], v2["current"], v2["versions"]) == (2, 2, [1, 2])
        status, body, headers = await answer("cust")
        assert body["choices"][0]["text"] == DEMO_MARKERS["globex"] and headers["x-adapter-version"] == "2"
        status, body, headers = await answer("cust@1")  # an older version, named
        assert body["choices"][0]["text"] == DEMO_MARKERS["acme"] and headers["x-adapter-version"] == "1"
        # Another tenant neither sees it nor can take the id.
        assert (await answer("cust", tenant="beta"))[0] == 404
        status, body, _ = await srv.post(
            "/v1/adapters", {"id": "cust", "source": str(root / "acme"), "tenant": "beta"}, headers=srv.admin()
        )
        assert status == 409, body
        # Rollback, then the same content again: 200, the existing version made current.
        status, body, _ = await srv.request("PUT", "/v1/adapters/cust/current", srv.admin(), {"version": 1})
        assert status == 200 and body["current"] == 1 and body["version"] == 1
        assert (await answer("cust"))[1]["choices"][0]["text"] == DEMO_MARKERS["acme"]
        again = await register("globex", 200)
        assert (again["version"], again["current"]) == (2, 2)
        status, body, _ = await srv.request("PUT", "/v1/adapters/cust/current", srv.admin(), {"version": 7})
        assert status == 404
        assert_openai_error(body, 404, "version")
        status, body, _ = await srv.request("GET", "/v1/adapters/cust/versions", srv.admin())
        assert [(v["id"], v["current"], v["servable"]) for v in body["data"]] == [
            ("cust@1", False, True),
            ("cust@2", True, True),
        ]
        status, body, _ = await srv.request("DELETE", "/v1/adapters/cust@2", srv.admin())
        assert status == 409 and "point the alias" in body["error"]["message"]
        assert (await srv.request("DELETE", "/v1/adapters/cust@1", srv.admin()))[0] == 200
        assert (await answer("cust@1"))[0] == 404
        assert (await srv.request("DELETE", "/v1/adapters/cust", srv.admin()))[0] == 200
        assert (await answer("cust"))[0] == 404
        assert (await srv.request("GET", "/v1/adapters/cust", srv.admin()))[0] == 404
    await engine.close()


def _other_base(tmp_path: Path) -> Path:
    """The tiny base with one weight nudged: same shapes and tokenizer, another digest."""
    other = tmp_path / "other-base"
    shutil.copytree(TINY_BASE_DIR, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name] + 1e-3
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    return other


async def test_versions_of_another_base_are_kept_but_refused(tmp_path):
    state = str(tmp_path / "state")
    first = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, state_dir=state))
    first.add_adapter("acme", demo_adapter_dirs()["acme"])
    trained_on = first.digest
    await first.close()
    other = _other_base(tmp_path)
    engine = Engine(EngineConfig(model=str(other), block_size=4, state_dir=state))
    assert engine.digest != trained_on
    with pytest.raises(AdapterBaseMismatchError) as exc:
        engine.admin.catalog.resolve_version("acme")
    message = exc.value.message  # both digests and the migration route, never "register it again"
    assert f"trained on base sha256:{trained_on}" in message and f"runs base sha256:{engine.digest}" in message
    assert f"POST /v1/bases/{engine.digest}/validate" in message and "lorapage base check" in message
    assert "register" not in message
    [kept] = engine.admin.catalog.versions("acme")
    assert (kept.key, kept.servable, kept.base_digest) == ("acme@1", False, trained_on)
    with pytest.raises(
        AdapterBaseMismatchError, match=f"expected_base_digest\\) was trained on base sha256:{trained_on}"
    ):
        await engine.register_adapter("globex", demo_adapter_dirs()["globex"], expected_base_digest=trained_on)
    info = await engine.register_adapter("globex", demo_adapter_dirs()["globex"], expected_base_digest=engine.digest)
    assert info.name == "globex@1"
    async with running_server(engine, make_access()) as srv:
        status, body, _ = await srv.post(COMP, {"model": "acme", "prompt": "Hi", "max_tokens": 4})
        assert status == 409, body
        assert_openai_error(body, 409, "model")
        assert body["error"]["code"] == "adapter_base_mismatch"
        status, body, _ = await srv.post(COMP, {"model": "globex", "prompt": "Hi", "max_tokens": 4})
        assert status == 200, body  # the others keep serving
    await engine.close()


async def test_a_version_restored_under_another_dtype_is_checked_again_at_load(tmp_path):
    """Loads skip the NaN/Inf scan only for bytes this process validated in its own dtype. A
    version registered under float32 whose weights overflow float16 is refused when a float16
    engine restores it from the registry and loads it, not served as Inf."""
    state = str(tmp_path / "state")
    big = tmp_path / "big"
    shutil.copytree(demo_adapter_dirs()["acme"], big)
    weights = load_file(big / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key][0, 0] = 1e6  # finite in float32, inf in float16
    save_file(weights, big / "adapter_model.safetensors")
    first = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, state_dir=state))
    first.add_adapter("big", big)
    await first.close()
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, state_dir=state, dtype="float16"))
    with pytest.raises(LorapageError, match="big@1 could not be loaded") as failed:
        await collect(engine, "Hi", "big", SamplingParams(max_tokens=2))
    assert "overflow torch.float16" in str(failed.value.__cause__)  # the detail is the operator's
    # The same engine validates a new registration in its own dtype, and refuses it at once.
    with pytest.raises(LorapageError, match="overflow torch.float16"):
        await engine.register_adapter("big2", big)
    await engine.close()


async def test_known_content_registered_from_a_new_place_is_read_from_there(checkpoint, tmp_path):
    """The files of a registered version move (its old directory is gone, as after a redeploy of
    the operator's tree): registering the same content from the new place keeps the version and
    reads it from there, after a restart too, instead of failing every load on the old path."""
    base, v1, _, ref = checkpoint
    state, old, new = tmp_path / "state", tmp_path / "old", tmp_path / "new"
    shutil.copytree(v1, old)
    engine = Engine(EngineConfig(model=str(base), block_size=4, state_dir=str(state)))
    engine.add_adapter("cust", old)
    await engine.close()
    shutil.move(old, new)
    engine = Engine(EngineConfig(model=str(base), block_size=4, state_dir=str(state)))
    again = await engine.register_adapter("cust", new)
    assert (again.name, again.created) == ("cust@1", False)
    assert list((await collect(engine, PROMPT, "cust", GREEDY))[0].token_ids) == ref["v1"]
    moved = (await engine.admin.catalog.audit(AuditQuery(adapter="cust", action="register")))[0]  # newest first
    assert json.loads(moved.before or "") == {"version": 1, "source": old.resolve().as_uri()}
    assert json.loads(moved.after or "") == {"version": 1, "source": new.resolve().as_uri()}
    await engine.close()
    engine = Engine(EngineConfig(model=str(base), block_size=4, state_dir=str(state)))  # the registry says so
    assert list((await collect(engine, PROMPT, "cust", GREEDY))[0].token_ids) == ref["v1"]
    await engine.close()
