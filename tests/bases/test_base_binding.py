"""Bound adapters: registration binds each adapter to the base it was trained on.

The digest comes from the registration's ``expected_base_digest``, else the adapter's
``base_model_name_or_path`` through ``--base-names`` or the running base's own names; none is a
400 saying how to bind it (unless ``--allow-unbound``), another base a 409 naming both digests and
the migration route. Refusals are checked over real HTTP, at start (``lorapage serve``) and
embedded."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest
from server_harness import assert_openai_error, make_engine, make_roots, running_server

from lorapage import Engine, EngineConfig
from lorapage.adapters.binding import BaseBinding, BaseNames, load_base_names
from lorapage.errors import AdapterBaseMismatchError, AdapterBaseUnknownError, InvalidRequestError
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

RUNNING = "1" * 64
OLD = "0" * 64  # a base that is not running: what an adapter trained before an upgrade names
COMP = "/v1/completions"


def named(dest: Path, base_name: str | None, source: str = "acme") -> Path:
    """A copy of a demo adapter whose ``base_model_name_or_path`` is ``base_name`` (None: absent)."""
    shutil.copytree(demo_adapter_dirs()[source], dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    cfg.pop("base_model_name_or_path")
    if base_name is not None:
        cfg["base_model_name_or_path"] = base_name
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def table_file(tmp_path: Path, table: dict[str, str]) -> str:
    path = tmp_path / "bases.toml"
    path.write_text("".join(f'"{name}" = "{digest}"\n' for name, digest in table.items()))
    return str(path)


def assert_route(message: str, trained_on: str, running: str) -> None:
    """Both digests, the migration route, and no invitation to register again."""
    assert f"trained on base sha256:{trained_on}" in message and f"runs base sha256:{running}" in message
    assert f"POST /v1/bases/{running}/validate" in message and "lorapage base check" in message
    assert "register it again" not in message and "again on this base" not in message


# -- the rule, pure ------------------------------------------------------------------------------


def test_the_running_base_answers_to_its_path_its_trailing_parts_and_its_declared_names(tmp_path):
    snapshot = tmp_path / "hub" / "models--acme-labs--Llama-9B" / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"_name_or_path": "acme-labs/Llama-9B-Instruct"}))
    names = BaseNames.of_base(snapshot)
    for name in (
        str(snapshot),
        f"{snapshot}/",
        "c0ffee",
        "snapshots/c0ffee",
        "./c0ffee",
        "acme-labs/Llama-9B",  # the hub cache's org/name
        "acme-labs/Llama-9B-Instruct",  # config.json's _name_or_path
    ):
        assert names.digest_of(name, RUNNING) == RUNNING, name
    for name in ("", "   ", "ffee", "other/c0ffee", "/c0ffee", "../c0ffee", "Llama-9B", str(tmp_path / "c0ffee")):
        assert names.digest_of(name, RUNNING) is None, name
    # The demo adapters name the tiny base by its path in the repository: they bind with no table.
    tiny = BaseNames.of_base(TINY_BASE_DIR)
    trained_on = json.loads((demo_adapter_dirs()["acme"] / "adapter_config.json").read_text())
    assert tiny.digest_of(trained_on["base_model_name_or_path"], RUNNING) == RUNNING


def test_the_table_is_asked_first_and_expected_base_digest_over_everything(tmp_path):
    names = BaseNames.of_base(TINY_BASE_DIR, {"base": OLD, "tiny-v2": RUNNING})
    binding = BaseBinding(names)
    assert binding.bind(RUNNING, expected=None, trained_on="tiny-v2") == RUNNING
    assert binding.bind(RUNNING, expected=None, trained_on="assets/tiny/base") == RUNNING
    with pytest.raises(AdapterBaseMismatchError) as exc:  # the operator said "base" means another checkpoint
        binding.bind(RUNNING, expected=None, trained_on="base")
    assert_route(exc.value.message, OLD, RUNNING)
    assert "'base'" in exc.value.message and "--base-names" in exc.value.message
    # The registration's word wins over the metadata, both ways.
    assert binding.bind(RUNNING, expected=f"sha256:{RUNNING.upper()}", trained_on="base") == RUNNING
    with pytest.raises(AdapterBaseMismatchError) as exc:
        binding.bind(RUNNING, expected=OLD, trained_on="tiny-v2")
    assert exc.value.param == "expected_base_digest"
    assert_route(exc.value.message, OLD, RUNNING)
    with pytest.raises(InvalidRequestError, match="64 hex digits"):
        binding.bind(RUNNING, expected="sha256:abc", trained_on=None)


def test_an_unknown_base_is_refused_with_the_fix_unless_unbound_adapters_are_allowed():
    names = BaseNames.of_base(TINY_BASE_DIR)
    for trained_on, why in ((None, "no base_model_name_or_path"), ("meta-llama/Llama-3.1-8B", "not in the base-names")):
        with pytest.raises(AdapterBaseUnknownError) as exc:
            BaseBinding(names).bind(RUNNING, expected=None, trained_on=trained_on)
        message = exc.value.message
        assert (exc.value.status, exc.value.code, exc.value.param) == (
            400,
            "adapter_base_unknown",
            "expected_base_digest",
        )
        assert why in message and f"this server runs sha256:{RUNNING}" in message
        assert "--base-names" in message and "--allow-unbound" in message and "expected_base_digest" in message
        assert BaseBinding(names, allow_unbound=True).bind(RUNNING, expected=None, trained_on=trained_on) == RUNNING
    # allow_unbound binds only the unknown: a base the table names is still refused when it is not running.
    with pytest.raises(AdapterBaseMismatchError):
        BaseBinding(BaseNames.of_base(TINY_BASE_DIR, {"old": OLD}), True).bind(RUNNING, expected=None, trained_on="old")


def test_the_base_names_file_is_checked_and_its_errors_name_the_entry(tmp_path):
    good = table_file(tmp_path, {"meta-llama/Llama-3.1-8B": f"sha256:{OLD}", "tiny": RUNNING.upper()})
    assert load_base_names(good) == {"meta-llama/Llama-3.1-8B": OLD, "tiny": RUNNING}
    bad = tmp_path / "bad.toml"
    for text, why in (
        ('"x" = "sha256:12"\n', "'x': sha256 must be 64 hex digits"),
        ('"x" = 3\n', "'x': expected a digest string"),
        ('"x" = \n', "not valid TOML"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_base_names(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        load_base_names(tmp_path / "missing.toml")


# -- embedded ------------------------------------------------------------------------------------


async def test_an_engine_binds_by_table_refuses_the_unknown_and_allow_unbound_keeps_the_old_behaviour(tmp_path):
    tiny = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4))
    digest = tiny.digest
    await tiny.close()
    table = table_file(tmp_path, {"acme-base-2024": digest, "acme-base-2023": OLD})
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, base_names=table))
    assert engine.add_adapter("demo", demo_adapter_dirs()["acme"]).name == "demo@1"  # no flags needed
    info = await engine.register_adapter("mapped", named(tmp_path / "mapped", "acme-base-2024"))
    assert engine.admin.catalog.versions("mapped")[0].base_digest == digest and info.created
    with pytest.raises(AdapterBaseMismatchError) as exc:
        engine.add_adapter("old", named(tmp_path / "old", "acme-base-2023"))
    assert_route(exc.value.message, OLD, digest)
    unbound = named(tmp_path / "unbound", None)
    with pytest.raises(AdapterBaseUnknownError, match="--allow-unbound"):
        await engine.register_adapter("unbound", unbound)
    assert (
        engine.admin.catalog.versions("old") == [] and engine.admin.catalog.versions("unbound") == []
    )  # nothing committed
    # The operator's word binds what the files do not say.
    info = await engine.register_adapter("unbound", unbound, expected_base_digest=f"sha256:{digest}")
    assert info.name == "unbound@1"
    await engine.close()

    lenient = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4, allow_unbound=True))
    assert lenient.add_adapter("unbound", unbound).name == "unbound@1"
    assert (
        lenient.admin.catalog.versions("unbound")[0].base_digest == digest
    )  # stamped with the running base, as before
    await lenient.close()


# -- over HTTP -----------------------------------------------------------------------------------


async def test_http_registration_refuses_unknown_and_other_bases_and_binds_by_request_or_table(tmp_path):
    root = tmp_path / "root"
    named(root / "unbound", None)
    named(root / "hub-named", "meta-llama/Llama-3.1-8B", source="globex")
    named(root / "old", "acme-base-2023", source="initech")
    named(root / "mapped", "acme-base-2024", source="globex")
    probe = Engine(EngineConfig(model=str(TINY_BASE_DIR), block_size=4))
    digest = probe.digest
    await probe.close()
    table = table_file(tmp_path, {"acme-base-2024": f"sha256:{digest}", "acme-base-2023": f"sha256:{OLD}"})
    engine = make_engine(make_roots(root), block_size=4, base_names=table)
    async with running_server(engine) as srv:

        async def register(route: str, name: str, **extra):
            if route == "/v1/adapters":
                body = {"id": name, "source": str(root / name), "tenant": "alpha", **extra}
            else:  # vLLM's route, with lorapage's extensions
                body = {"lora_name": name, "lora_path": str(root / name), "tenant": "alpha", **extra}
            return await srv.post(route, body, tenant=None, headers=srv.admin())

        for route in ("/v1/adapters", "/v1/load_lora_adapter"):
            for name in ("unbound", "hub-named"):
                status, body, _ = await register(route, name)
                assert status == 400, body
                assert_openai_error(body, 400, "expected_base_digest")
                message = body["error"]["message"]
                assert body["error"]["code"] == "adapter_base_unknown"
                assert "--base-names" in message and "--allow-unbound" in message and f"sha256:{digest}" in message
            status, body, _ = await register(route, "old")
            assert status == 409, body
            assert_openai_error(body, 409)
            assert body["error"]["code"] == "adapter_base_mismatch"
            assert_route(body["error"]["message"], OLD, digest)
            status, body, _ = await register(route, "unbound", expected_base_digest=f"sha256:{OLD}")
            assert status == 409 and body["error"]["param"] == "expected_base_digest", body
            assert_route(body["error"]["message"], OLD, digest)
        listed = (await srv.request("GET", "/v1/adapters", srv.admin()))[1]["data"]
        assert not {"unbound", "hub-named", "old"} & {a["id"] for a in listed}  # nothing refused was kept

        status, body, _ = await register("/v1/adapters", "mapped")  # the table names the running base
        assert status == 201 and body["base_digest"] == digest, body
        status, body, _ = await register("/v1/adapters", "unbound", expected_base_digest=digest)
        assert status == 201, body
        status, body, _ = await srv.post(COMP, {"model": "mapped", "prompt": "Hi", "max_tokens": 4})
        assert status == 200, body
    await engine.close()


# -- lorapage serve ------------------------------------------------------------------------------


async def _serve_fails(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorapage.cli",
        "serve",
        "--port",
        "0",
        "--state-dir",
        ":memory:",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 2, err
    return err.decode()


async def test_serve_refuses_an_unbound_lora_module_and_a_bad_base_names_file(tmp_path):
    bad = tmp_path / "bases.toml"
    bad.write_text('"tiny" = "sha256:nope"\n')
    err, err2 = await asyncio.gather(  # independent commands, both at once
        _serve_fails("--lora-modules", f"stray={named(tmp_path / 'stray', 'some/other-base')}"),
        _serve_fails("--base-names", str(bad)),
    )
    assert "adapter 'stray'" in err and "'some/other-base'" in err and "--allow-unbound" in err
    assert f"--base-names {bad}: 'tiny': sha256 must be 64 hex digits" in err2


def test_the_flags_reach_the_config(tmp_path):
    from lorapage.engine.flags import engine_config
    from lorapage.serve.cli import build_parser

    table = table_file(tmp_path, {"tiny": RUNNING})
    config = engine_config(build_parser().parse_args(["--base-names", table, "--allow-unbound"]), "lorapage serve")
    assert (config.base_names, config.allow_unbound) == (table, True)
    assert engine_config(build_parser().parse_args([]), "lorapage serve").allow_unbound is False


def test_lorapage_base_digest_prints_what_the_table_and_expected_base_digest_take(tmp_path, capsys):
    from lorapage.bases.cli import main
    from lorapage.model.loader import model_digest

    assert main(["digest", str(TINY_BASE_DIR)]) == 0
    shown, path = capsys.readouterr().out.strip().split("  ")
    assert path == str(TINY_BASE_DIR) and shown.startswith("sha256:")
    assert load_base_names(table_file(tmp_path, {"tiny": shown})) == {"tiny": model_digest(TINY_BASE_DIR)}
    assert main(["digest", str(tmp_path)]) == 1  # no weights there
    assert "no *.safetensors" in capsys.readouterr().err
