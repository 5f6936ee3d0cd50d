"""Tenants file parsing, validation errors and API-key lookup."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

import lorapage.tenants as tenants_mod
from lorapage.tenants import DEFAULT_TENANT, TenantsConfig, TenantsConfigError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


EXAMPLE = f"""
[admin]
key_sha256 = ["{digest("admin-key")}"]

[tenants.acme]
key_sha256 = ["{digest("acme-1")}", "{digest("acme-2").upper()}"]
adapters = ["acme-support"]
weight = 2
rpm = 600
tpm = 200000
tpm_burst = 50000
max_concurrency = 32

[tenants.globex]
key_sha256 = ["{digest("globex-1")}"]
"""


def test_parses_the_documented_shape():
    cfg = TenantsConfig.from_toml(EXAMPLE)
    acme = cfg.get("acme")
    assert acme.weight == 2.0 and acme.rpm == 600 and acme.tpm == 200000 and acme.max_concurrency == 32
    assert acme.rpm_bucket == 600  # burst defaults to the per-minute limit
    assert acme.tpm_bucket == 50000
    assert acme.may_use("acme-support") and acme.may_use(None) and not acme.may_use("globex-bot")
    globex = cfg.get("globex")
    assert globex.adapters is None and globex.may_use("anything")  # omitted: every adapter
    assert (globex.rpm, globex.tpm, globex.max_concurrency, globex.rpm_bucket) == (None, None, None, None)
    assert cfg.weights() == {"acme": 2.0, "globex": 1.0}


def test_api_keys_resolve_by_digest():
    cfg = TenantsConfig.from_toml(EXAMPLE)
    assert cfg.authenticate("acme-1") == "acme"
    assert cfg.authenticate("acme-2") == "acme"  # stored upper-case, compared lower-case
    assert cfg.authenticate("globex-1") == "globex"
    assert cfg.authenticate("nope") is None
    assert cfg.authenticate(digest("acme-1")) is None  # the digest itself is not a key
    assert cfg.is_admin("admin-key") and not cfg.is_admin("acme-1")


def test_every_digest_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = tenants_mod.hmac.compare_digest

    def spy(a, b):
        calls.append(a)
        return real(a, b)

    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", spy)
    cfg = TenantsConfig.from_toml(EXAMPLE)
    assert cfg.authenticate("acme-1") == "acme"
    assert len(calls) == 3  # no early exit on the first match


def test_default_tenant_for_the_embedded_engine():
    cfg = TenantsConfig.single()
    t = cfg.get(DEFAULT_TENANT)
    assert t.may_use("any-adapter") and t.rpm is None and t.weight == 1.0
    assert cfg.authenticate("anything") is None


def test_config_is_immutable():
    cfg = TenantsConfig.from_toml(EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.get("acme").rpm = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.tenants["evil"] = cfg.get("acme")  # type: ignore[index]


def test_load_from_file(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(EXAMPLE)
    assert sorted(TenantsConfig.load(path).tenants) == ["acme", "globex"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[tenants.a]\nrmp = 5\n", r"tenants\.a: unknown field\(s\) \['rmp'\]"),
        ("[tenants.a]\nweight = 0\n", r"tenants\.a\.weight: expected a number > 0"),
        ("[tenants.a]\nweight = true\n", r"tenants\.a\.weight"),
        ("[tenants.a]\nrpm = 0\n", r"tenants\.a\.rpm: expected an integer >= 1"),
        ("[tenants.a]\ntpm = 1.5\n", r"tenants\.a\.tpm: expected an integer"),
        ("[tenants.a]\nmax_concurrency = true\n", r"tenants\.a\.max_concurrency"),
        ("[tenants.a]\nrpm_burst = 10\n", r"tenants\.a\.rpm_burst: set rpm too"),
        ("[tenants.a]\nadapters = 'x'\n", r"tenants\.a\.adapters: expected a list"),
        ("[tenants.a]\nkey_sha256 = ['my-secret-key']\n", r"tenants\.a\.key_sha256: .*not a sha256 hex digest"),
        ("[tenants.a]\nkey_sha256 = 'abc'\n", r"tenants\.a\.key_sha256: expected a list"),
        ("[admin]\nkeys = []\n", r"admin: unknown field"),
        ("[tenant.a]\n", r"unknown section"),
        ("tenants = 3\n", r"tenants: expected a table"),
        ("[tenants.a\n", r"not valid TOML"),
    ],
)
def test_errors_name_the_bad_field(body, expected):
    with pytest.raises(TenantsConfigError, match=expected):
        TenantsConfig.from_toml(body)


def test_a_key_belongs_to_one_tenant():
    body = f"[tenants.a]\nkey_sha256 = ['{digest('k')}']\n[tenants.b]\nkey_sha256 = ['{digest('k')}']\n"
    with pytest.raises(TenantsConfigError, match=r"tenants\.b\.key_sha256: .*also a key of tenants\.a"):
        TenantsConfig.from_toml(body)
    body = f"[admin]\nkey_sha256 = ['{digest('k')}']\n[tenants.a]\nkey_sha256 = ['{digest('k')}']\n"
    with pytest.raises(TenantsConfigError, match=r"also a key of \[admin\]"):
        TenantsConfig.from_toml(body)
