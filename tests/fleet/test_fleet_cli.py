"""``lorapage fleet`` as a process: up on a local Ray, a SIGHUP reloads the tenants file, SIGTERM stops it.

One engine replica of the tiny model on a free 127.0.0.1 port; real HTTP to Ray Serve's proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from server_harness import TENANTS_TOML  # noqa: E402

from lorapage.fleet.ingress import TENANTS_FILE  # noqa: E402
from lorapage.tenancy.tenants import hash_key  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
DELTA = f'\n[tenants.delta]\nkey_sha256 = ["{hash_key("key-delta")}"]\nadapters = ["acme"]\n'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _line(proc: asyncio.subprocess.Process, pattern: str, timeout_s: float = 180) -> re.Match[str]:
    """The first stdout line matching ``pattern`` (the process's other lines are skipped)."""
    assert proc.stdout is not None
    async with asyncio.timeout(timeout_s):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"lorapage fleet exited early with {await proc.wait()}")
            if m := re.search(pattern, line):
                return m


async def _completion(url: str, key: str) -> int:
    body = {"model": "acme", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            await resp.read()
            return resp.status


async def test_two_replicas_fit_a_two_cpu_ray_sighup_reloads_the_tenants_file_and_sigterm_stops(tmp_path: Path) -> None:
    """The README's `lorapage fleet --replicas 2` on a 2-CPU machine, no resource flags: sized to
    fit, and it answers; then the tenants file's reloads and a clean stop (one Ray start for all)."""
    tenants, state = tmp_path / "tenants.toml", tmp_path / "state"
    tenants.write_text(TENANTS_TOML)
    args = ["--replicas", "2", "--num-cpus", "2", "--port", str(_free_port())]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorapage.cli", "fleet", *args, "--tenants", str(tenants), "--state-dir", str(state),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        up = await _line(proc, r"fleet of 2 replicas .*adapters: (.*); listening on (http://\S+)")
        assert set(up.group(1).split(", ")) == {"acme", "globex", "initech"}  # the demo adapters, registered
        url = up.group(2)
        assert await _completion(url, "key-alpha") == 200
        assert await _completion(url, "key-delta") == 401
        tenants.write_text(TENANTS_TOML + DELTA)
        proc.send_signal(signal.SIGHUP)
        await _line(proc, r"tenants file reloaded: 4 tenants")
        assert await _completion(url, "key-delta") == 200
        assert json.loads((state / TENANTS_FILE).read_text())["text"].endswith(DELTA)
        tenants.write_text("[tenants.broken]\nkey_sha256 = 3\n")
        proc.send_signal(signal.SIGHUP)
        await _line(proc, r"tenants file not reloaded, keeping the old one")
        assert await _completion(url, "key-delta") == 200
        proc.send_signal(signal.SIGTERM)
        await _line(proc, r"lorapage: stopped")
        assert await asyncio.wait_for(proc.wait(), 120) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_replica_cpus_fit_the_machine_or_the_error_names_the_flags() -> None:
    from lorapage.fleet.config import INGRESS_CPUS, replica_cpus_for

    assert replica_cpus_for(2.0, 2, INGRESS_CPUS, None) == 0.75  # 2 x 0.75 + 0.5 = 2
    assert replica_cpus_for(16.0, 2, INGRESS_CPUS, None) == 1.0  # room to spare: one each
    assert replica_cpus_for(2.0, 3, INGRESS_CPUS, None) == 0.5
    for cpus in (1.0, 2.0, 3.0, 4.0, 7.0):
        for replicas in range(1, 6):
            share = replica_cpus_for(cpus, replicas, INGRESS_CPUS, None)
            assert replicas * share + INGRESS_CPUS <= cpus
    assert replica_cpus_for(4.0, 2, INGRESS_CPUS, 1.5) == 1.5
    with pytest.raises(ValueError, match=r"--replica-cpus 1 x 2 replicas \+ 0.5 for the ingress = 2.5 CPUs.*has 2"):
        replica_cpus_for(2.0, 2, INGRESS_CPUS, 1.0)
    with pytest.raises(ValueError, match="--replicas.*--num-cpus"):
        replica_cpus_for(1.0, 8, INGRESS_CPUS, None)


async def _run_fleet(*args: str, timeout_s: float = 240) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorapage.cli", "fleet", "--port", str(_free_port()), "--state-dir", ":memory:", *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_replica_cpus_that_cannot_fit_are_refused_before_ray_starts() -> None:
    code, out, err = await _run_fleet("--replicas", "2", "--num-cpus", "2", "--replica-cpus", "1", timeout_s=60)
    assert code == 2 and "--replica-cpus" in err and "--num-cpus" in err and "2.5 CPUs" in err
    assert "key" not in out and "Traceback" not in err


async def test_access_log_and_slo_window_reach_the_ingress_or_are_refused_before_ray_starts(
    tmp_path: Path, monkeypatch
) -> None:
    from lorapage.fleet.cli import build_parser, fleet_config

    monkeypatch.chdir(tmp_path)
    config = fleet_config(build_parser().parse_args(["--access-log", "access.jsonl", "--slo-window", "60"]), 1.0, "")
    # Absolute: the ingress runs in Ray's working directory.
    assert config.access_log == str(tmp_path / "access.jsonl") and config.slo_window_s == 60.0
    assert fleet_config(build_parser().parse_args(["--access-log", "-"]), 1.0, "").access_log == "-"
    missing = tmp_path / "missing" / "access.jsonl"
    (code, out, err), (code2, out2, err2) = await asyncio.gather(  # independent: both at once
        _run_fleet("--access-log", str(missing), timeout_s=60), _run_fleet("--slo-window", "0", timeout_s=60)
    )
    assert code == 2 and f"--access-log {missing}: No such file" in err and "Traceback" not in err
    assert code2 == 2 and "--slo-window must be a number of seconds > 0" in err2 and "key" not in out2


async def test_api_key_is_the_single_tenant_and_not_beside_a_tenants_file(tmp_path: Path, capsys) -> None:
    from lorapage.fleet.cli import _tenants_toml
    from lorapage.tenancy.tenants import TenantsConfig

    config = TenantsConfig.from_toml(_tenants_toml(None, ["acme"], ["sk-fleet"]))
    assert config.authenticate("sk-fleet") == "default" and config.is_admin("sk-fleet")
    assert "demo tenant key" not in capsys.readouterr().out
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    code, out, err = await _run_fleet("--api-key", "sk-fleet", "--tenants", str(tenants), timeout_s=60)
    assert code == 2 and "--api-key is for single-tenant use" in err and "Traceback" not in err


async def test_a_deployment_ray_cannot_place_ends_the_command_with_rays_reason() -> None:
    # A GPU this machine lacks: Ray never schedules the replica. The command must not hang.
    code, out, err = await _run_fleet(
        "--replicas", "1", "--num-cpus", "2", "--replica-gpus", "1", "--start-timeout", "5"
    )  # fmt: skip
    assert code == 2, err[-2000:]
    # Ray may log its own shutdown after ours: find the command's one line among them.
    ours = [line for line in err.splitlines() if line.startswith("lorapage fleet:")]
    assert len(ours) == 1, err[-2000:]
    assert "--start-timeout" in ours[0] and "EngineReplica" in ours[0] and "GPU" in ours[0], ours[0]


async def test_dedicated_tier_flags_reach_the_config_or_are_refused_before_ray_starts() -> None:
    from lorapage.fleet.cli import build_parser, fleet_config
    from lorapage.fleet.promotion import DedicatedConfig

    assert fleet_config(build_parser().parse_args([]), 1.0, "").dedicated == DedicatedConfig()  # off, seed 001's 640
    # A fleet's envelope, unless given, is the narrow one: its dedicated tier takes the wider adapters.
    assert fleet_config(build_parser().parse_args([]), 1.0, "").engine.envelope_rules == "all:16"
    wide = fleet_config(build_parser().parse_args(["--shared-envelope", "all:64"]), 1.0, "")
    assert wide.engine.envelope_rules == "all:64"
    flags = ["--auto-promote", "--promote-tokens-per-s", "900", "--demote-tokens-per-s", "100", "--promote-after",
             "30", "--demote-after", "120", "--max-dedicated", "2", "--dedicated-replicas", "2"]  # fmt: skip
    dedicated = fleet_config(build_parser().parse_args(flags), 1.0, "").dedicated
    assert dedicated.auto and dedicated.replicas == 2 and dedicated.rules.max_deployments == 2
    assert (dedicated.rules.promote_tokens_per_s, dedicated.rules.demote_tokens_per_s) == (900.0, 100.0)
    assert (dedicated.rules.promote_after_s, dedicated.rules.demote_after_s) == (30.0, 120.0)
    code, out, err = await _run_fleet("--auto-promote", "--demote-tokens-per-s", "700", timeout_s=60)
    assert code == 2 and "hysteresis" in err and "700" in err and "Traceback" not in err and "key" not in out


async def test_bases_of_one_directory_name_are_refused_before_ray_starts() -> None:
    """Each base is a deployment and a served model named by its directory: two of one name would collide."""
    from lorapage.tiny import TINY_BASE_DIR

    code, out, err = await _run_fleet("--base", str(TINY_BASE_DIR), timeout_s=60)
    assert code == 2 and "distinct names" in err and "['base', 'base']" in err and "Traceback" not in err


async def test_a_base_of_another_context_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """The ingress tokenizes a prompt once, for whichever base: every --base shares the primary's
    tokenizer and context length (as lorapage serve --base checks)."""
    from lorapage.tiny import TINY_BASE_DIR

    other = tmp_path / "shorter"
    shutil.copytree(TINY_BASE_DIR, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    code, out, err = await _run_fleet("--base", str(other), timeout_s=60)
    assert code == 2 and "base 'shorter' serves 256 tokens of context" in err and "Traceback" not in err
