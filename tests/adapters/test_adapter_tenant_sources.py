"""Sources are tied to tenants (issue 26, case 5): ``--adapter-root TENANT=DIR`` gives a tenant
roots of its own, no registration for one tenant reaches another's directory (named, or through a
link, at registration or at a later load), and ``s3://`` buckets and ``hf://`` organisations are
only those the tenant's entry in the tenants file lists. Over a real server and real files."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from server_harness import TENANTS_TOML, Server, assert_openai_error, make_engine, make_roots, running_server

from lorapage.errors import PermissionDeniedError
from lorapage.frontend import Access
from lorapage.sources import AdapterRoots
from lorapage.tenancy.tenants import TenantsConfig
from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

COMP = "/v1/completions"
WEIGHTS = "adapter_model.safetensors"


def _copy(name: str, dest: Path) -> Path:
    shutil.copytree(demo_adapter_dirs()[name], dest)
    return dest


async def _register(srv: Server, adapter_id: str, source: str | Path, tenant: str):
    body = {"id": adapter_id, "source": str(source), "tenant": tenant}
    return await srv.post("/v1/adapters", body, tenant=None, headers=srv.admin())


def _complete(model: str) -> dict:
    return {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}


def test_adapter_root_values_parse_into_shared_and_tenant_roots(tmp_path):
    roots = AdapterRoots.parse([str(tmp_path / "shared"), f"alpha={tmp_path / 'a'}", f"alpha={tmp_path / 'a2'}"])
    assert roots.shared == (tmp_path / "shared",)
    assert roots.tenants == {"alpha": (tmp_path / "a", tmp_path / "a2")}
    assert AdapterRoots.parse(roots.values()) == roots
    assert AdapterRoots.parse([str(tmp_path / "x=y")]).shared == (tmp_path / "x=y",)  # a path holding '='
    with pytest.raises(ValueError, match="TENANT=DIR"):
        AdapterRoots.parse(["bad name=/srv"])


async def test_a_tenant_reads_only_its_own_roots_and_never_another_tenants(tmp_path):
    """alpha and beta have roots of their own inside a shared root that gamma (none of its own)
    reads from. A registration for one tenant that names, or links into, another tenant's
    directory is refused; so is a later load of a directory that came to link there."""
    shared = tmp_path / "all"
    alpha, beta = shared / "alpha", shared / "beta"
    _copy("acme", alpha / "own")
    secret = _copy("initech", beta / "secret")
    _copy("acme", alpha / "linked")
    (alpha / "linked" / WEIGHTS).unlink()
    (alpha / "linked" / WEIGHTS).symlink_to(secret / WEIGHTS)
    _copy("acme", shared / "common" / "linked")
    (shared / "common" / "linked" / WEIGHTS).unlink()
    (shared / "common" / "linked" / WEIGHTS).symlink_to(secret / WEIGHTS)
    _copy("globex", shared / "common" / "plain")
    engine = make_engine(make_roots(shared, f"alpha={alpha}", f"beta={beta}"))
    try:
        async with running_server(engine) as srv:
            refused = [
                ("a1", secret, "alpha", "outside the adapter roots"),  # beta's, named
                ("a2", alpha / "linked", "alpha", "links outside"),  # beta's, through a link
                ("a3", shared / "common" / "plain", "alpha", "outside the adapter roots"),  # alpha has its own
                ("g1", secret, "gamma", "another tenant's adapter root"),  # inside the shared root
                ("g2", shared / "common" / "linked", "gamma", "links outside"),
            ]
            for adapter_id, path, tenant, why in refused:
                status, body, _ = await _register(srv, adapter_id, path, tenant)
                assert status == 403, (adapter_id, body)
                assert_openai_error(body, 403, "source")
                assert why in body["error"]["message"], (adapter_id, body)
            for adapter_id, path, tenant in (("mine", alpha / "own", "alpha"), ("theirs", secret, "beta")):
                status, body, _ = await _register(srv, adapter_id, path, tenant)
                assert status == 201, (adapter_id, body)
            status, body, _ = await _register(srv, "common", shared / "common" / "plain", "gamma")
            assert status == 201, body

            # alpha's directory later links to beta's weights: its next load is refused.
            (alpha / "own" / WEIGHTS).unlink()
            (alpha / "own" / WEIGHTS).symlink_to(secret / WEIGHTS)
            status, body, _ = await srv.post(COMP, _complete("mine"))
            assert status == 502 and body["error"]["code"] == "adapter_source_failed", body
            status, out, _ = await srv.post(COMP, _complete("theirs"), tenant="beta")
            assert status == 200 and out["choices"][0]["text"] == DEMO_MARKERS["initech"], out
    finally:
        await engine.close()


async def test_a_directory_of_hard_links_to_another_tenants_files_is_refused(tmp_path):
    """A hard link passes every path check (it resolves inside alpha's root) yet is beta's file:
    alpha's registration of a directory of them is a 400 naming the file, and beta's own
    adapter stays beta's (a later load of a directory that came to hold one is refused too)."""
    alpha, beta = tmp_path / "alpha", tmp_path / "beta"
    secret = _copy("initech", beta / "secret")
    linked = alpha / "linked"
    linked.mkdir(parents=True)
    for entry in secret.iterdir():
        (linked / entry.name).hardlink_to(entry)
    own = _copy("acme", alpha / "own")
    engine = make_engine(make_roots(f"alpha={alpha}", f"beta={beta}"))
    try:
        async with running_server(engine) as srv:
            status, body, _ = await _register(srv, "stolen", linked, "alpha")
            assert status == 400, body
            assert_openai_error(body, 400, "source")
            assert "is a hard link" in body["error"]["message"] and "copy the file in" in body["error"]["message"]
            assert (await _register(srv, "mine", own, "alpha"))[0] == 201
            (own / WEIGHTS).unlink()
            (own / WEIGHTS).hardlink_to(secret / WEIGHTS)
            status, body, _ = await srv.post(COMP, _complete("mine"))
            assert status == 502 and body["error"]["code"] == "adapter_source_failed", body
            assert "initech" not in json.dumps(body)
    finally:
        await engine.close()


def test_the_embedded_rule_refuses_what_the_server_refuses(tmp_path):
    """The rule is one function: the engine's own registration (no HTTP) applies it too."""
    alpha, beta = tmp_path / "alpha", tmp_path / "beta"
    secret = _copy("initech", beta / "secret")
    roots = make_roots(f"alpha={alpha}", f"beta={beta}")
    alpha.mkdir()
    with pytest.raises(PermissionDeniedError, match="outside the adapter roots"):
        roots.check(secret, "alpha")
    assert roots.check(secret, "beta") == secret
    with pytest.raises(PermissionDeniedError, match="disabled for tenant 'gamma'"):
        roots.check(secret, "gamma")  # no roots of its own and no shared ones


async def test_s3_buckets_and_hf_organisations_are_the_tenants_own(tmp_path):
    """The server's credentials reach every bucket and private repository they can read: a
    tenant may register only from the ones its entry lists (alpha: the bucket ``adapters``; here
    also the organisation ``alpha-org``). A refusal comes before anything is fetched."""
    toml = TENANTS_TOML.replace('s3_buckets = ["adapters"]', 's3_buckets = ["adapters"]\nhf_orgs = ["alpha-org"]')
    access = Access(TenantsConfig.from_toml(toml))
    engine = make_engine()  # no disk cache: a source that passes the tenant's lists fails after, saying so
    try:
        async with running_server(engine, access) as srv:
            cases = [("s3://adapters/team/x", "beta", "s3_buckets"), ("s3://other-bucket/x", "alpha", "s3_buckets")]
            if importlib.util.find_spec("huggingface_hub") is not None:
                cases += [("hf://alpha-org/repo", "beta", "hf_orgs"), ("hf://someone/private", "alpha", "hf_orgs")]
            for source, tenant, field in cases:
                status, body, _ = await _register(srv, "x", source, tenant)
                assert status == 403, (source, tenant, body)
                assert_openai_error(body, 403, "source")
                assert f"tenants.{tenant}.{field}" in body["error"]["message"], body
            allowed = ["s3://adapters/team/x"]
            if importlib.util.find_spec("huggingface_hub") is not None:
                allowed.append("hf://alpha-org/repo")
            for source in allowed:
                status, body, _ = await _register(srv, "x", source, "alpha")
                assert status == 400 and "--adapter-cache-dir" in body["error"]["message"], (source, body)
    finally:
        await engine.close()
