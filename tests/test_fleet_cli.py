"""``lorapage fleet`` as a process: up on a local Ray, a SIGHUP reloads the tenants file, SIGTERM stops it.

One engine replica of the tiny model on a free 127.0.0.1 port; real HTTP to Ray Serve's proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]: pip install 'lorapage[fleet]'")

from server_harness import TENANTS_TOML  # noqa: E402

from lorapage.fleet.ingress import TENANTS_FILE  # noqa: E402
from lorapage.server.tenants import hash_key  # noqa: E402

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


async def test_sighup_reloads_the_tenants_file_and_sigterm_stops(tmp_path: Path) -> None:
    tenants, state = tmp_path / "tenants.toml", tmp_path / "state"
    tenants.write_text(TENANTS_TOML)
    args = ["--replicas", "1", "--replica-cpus", "0.5", "--num-cpus", "2", "--port", str(_free_port())]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorapage.cli", "fleet", *args, "--tenants", str(tenants), "--state-dir", str(state),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        up = await _line(proc, r"adapters: (.*); listening on (http://\S+)")
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
