"""``lorapage serve`` as a subprocess: demo defaults, printed key, graceful exit on SIGTERM."""

from __future__ import annotations

import json
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from lorapage.testing.serve_process import ServeDidNotStart, ServeProcess, run_serve, start_serve
from lorapage.tiny import demo_adapter_dirs

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _start(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[ServeProcess, dict[str, str]]:
    """The server and what it printed before listening: the demo and admin keys, the single-tenant line."""
    served = start_serve(*args, under=tmp, env=env)
    seen = {"url": served.url}
    text = served.output()
    if m := re.search(r"demo tenant key: (\S+)", text):
        seen["key"] = m.group(1)
    if m := re.search(r"admin key: +(\S+)", text):
        seen["admin"] = m.group(1)
    if m := re.search(r"lorapage: single tenant .*", text):
        seen["single"] = m.group(0).strip()
    return served, seen


async def test_serve_demo_defaults_then_sigterm_mid_stream(tmp_path):
    served, seen = _start(tmp_path, "--shutdown-timeout", "0")
    with served:
        assert seen["url"].startswith("http://127.0.0.1:") and seen["key"]
        headers = {"Authorization": f"Bearer {seen['key']}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(seen["url"] + "/v1/models", headers=headers) as resp:
                ids = {m["id"] for m in (await resp.json())["data"]}
            assert set(demo_adapter_dirs()) <= ids
            async with session.get(seen["url"] + "/metrics") as resp:
                assert resp.status == 401  # it names every tenant: a key by default
            async with session.get(
                seen["url"] + "/metrics", headers={"Authorization": f"Bearer {seen['admin']}"}
            ) as resp:
                assert resp.status == 200
            body = {"model": "acme", "prompt": "hi", "max_tokens": 400, "stream": True}
            async with session.post(seen["url"] + "/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.content.readline()
                served.proc.send_signal(signal.SIGTERM)
                rest = (await resp.read()).decode()
            events = [line for line in rest.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"  # finished (or cancelled with an error event), never cut
            for event in events[:-1]:
                json.loads(event[len("data: ") :])
        assert served.proc.wait(30) == 0


async def test_serve_metrics_public_and_adapter_root(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(demo_adapter_dirs()["globex"], root / "globex-copy")
    served, seen = _start(tmp_path, "--metrics-public", "--adapter-root", str(root))
    with served:
        admin = {"Authorization": f"Bearer {seen['admin']}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(seen["url"] + "/metrics") as resp:
                assert resp.status == 200 and "lorapage_event_loop_lag_seconds" in await resp.text()

            async def register(adapter_id: str, path: Path) -> int:
                body = {"id": adapter_id, "path": str(path), "tenant": "demo"}
                async with session.post(seen["url"] + "/v1/adapters", json=body, headers=admin) as resp:
                    return resp.status

            assert await register("copy", root / "globex-copy") == 201
            assert await register("outside", demo_adapter_dirs()["globex"]) == 403
        assert served.stop(30) == 0


async def test_serve_api_key_is_one_tenant_whose_key_opens_every_route(tmp_path):
    """``--api-key`` (repeatable) as vLLM's: fixed keys, no demo key printed, and each key is the
    tenant's and the admin's (vLLM's key guards its LoRA routes too); other keys are refused."""
    root = tmp_path / "root"
    shutil.copytree(demo_adapter_dirs()["globex"], root / "globex-copy")
    served, seen = _start(tmp_path, "--api-key", "sk-one", "--api-key", "sk-two", "--adapter-root", str(root))
    with served:
        assert "key" not in seen and "admin" not in seen and "'default'" in seen["single"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def call(method: str, path: str, key: str, body: dict | None = None) -> tuple[int, str]:
                headers = {"Authorization": f"Bearer {key}"}
                async with session.request(method, seen["url"] + path, json=body, headers=headers) as resp:
                    return resp.status, await resp.text()

            status, text = await call("GET", "/v1/models", "sk-one")
            assert status == 200 and set(demo_adapter_dirs()) <= {m["id"] for m in json.loads(text)["data"]}
            chat = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert (await call("POST", "/v1/chat/completions", "sk-two", chat))[0] == 200
            assert (await call("GET", "/metrics", "sk-two"))[0] == 200
            load = {"lora_name": "copy", "lora_path": str(root / "globex-copy")}
            assert await call("POST", "/v1/load_lora_adapter", "sk-one", load) == (
                200,
                "Success: LoRA adapter 'copy' added successfully.",
            )
            assert (await call("POST", "/v1/chat/completions", "sk-one", {**chat, "model": "copy"}))[0] == 200
            assert (await call("GET", "/v1/adapters/copy", "sk-two"))[0] == 200
            for path in ("/v1/models", "/v1/adapters"):
                assert (await call("GET", path, "sk-three"))[0] == 401
        assert served.stop(30) == 0


async def test_serve_api_key_from_the_environment_and_not_beside_a_tenants_file(tmp_path):
    served, seen = _start(tmp_path, env={"LORAPAGE_API_KEY": "sk-env"})
    with served:
        assert "key" not in seen and "single" in seen
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(seen["url"] + "/v1/adapters", headers={"Authorization": "Bearer sk-env"}) as resp:
                assert resp.status == 200
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenants.a]\n")
    refused = (["--api-key", "k", "--tenants", str(tenants)], ["--api-key", "two words"])
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent commands, both at once
        runs = list(pool.map(lambda args: run_serve(*args), refused))
    for bad in runs:
        err = bad.stderr
        assert bad.returncode == 2 and "--api-key" in err and len(err.strip().splitlines()) == 1, err


async def test_serve_refuses_a_bad_adapter_directory(tmp_path):
    done = run_serve("--lora-modules", f"broken={tmp_path}")
    assert done.returncode == 2 and "broken" in done.stderr and "adapter_config.json" in done.stderr


async def test_engine_flags_reach_the_config_by_their_vllm_names():
    from lorapage.engine.flags import engine_config
    from lorapage.serve.cli import build_parser

    args = build_parser().parse_args(
        [
            "--gpu-memory-utilization",
            "0.8",
            "--enforce-eager",
            "--kernel-backend",
            "torch",
            "--num-pages",
            "512",
            "--block-size",
            "8",
            "--max-num-batched-tokens",
            "4096",
            "--adapter-wait-s",
            "0.5",
            "--max-loras",
            "4",
            "--lora-dtype",
            "bfloat16",
        ]
    )
    cfg = engine_config(args, "lorapage serve")
    assert cfg.lora_dtype == "bfloat16"
    assert (
        cfg.gpu_memory_utilization,
        cfg.enforce_eager,
        cfg.kernel_backend,
        cfg.num_pages,
        cfg.block_size,
        cfg.max_num_batched_tokens,
        cfg.adapter_wait_s,
        cfg.max_loras,
    ) == (0.8, True, "torch", 512, 8, 4096, 0.5, 4)
    defaults = engine_config(build_parser().parse_args([]), "lorapage serve")
    assert defaults.enforce_eager is False and defaults.lora_dtype == "auto"  # unset flags keep the defaults


async def test_serve_names_a_bad_flag_value():
    done = run_serve("--gpu-memory-utilization", "1.5")
    assert done.returncode == 2 and "gpu_memory_utilization must be in (0, 1]" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


async def test_serve_names_a_missing_adapter_root(tmp_path):
    done = run_serve("--adapter-root", str(tmp_path / "absent"))
    assert done.returncode == 2 and "--adapter-root" in done.stderr and "no such directory" in done.stderr


async def test_a_second_server_on_one_state_dir_exits_with_one_line(tmp_path):
    """A rolling restart that starts the new server before the old one stops: the new one
    refuses the held --state-dir (exit 2, one line naming it), the old one serves on."""
    state = str(tmp_path / "state")
    with start_serve("--state-dir", state, under=tmp_path) as first:
        second = run_serve("--state-dir", state)
        err = second.stderr
        assert second.returncode == 2, err
        assert "is in use by another lorapage process" in err and state in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(first.url + "/health") as resp:
                assert resp.status == 200


async def test_a_server_that_does_not_start_is_named_with_its_log(tmp_path):
    """The harness's own failure: the exit status and the log's tail, not a bare timeout."""
    with pytest.raises(ServeDidNotStart) as info:
        start_serve("--gpu-memory-utilization", "1.5", under=tmp_path)
    assert "exited with 2" in str(info.value) and "gpu_memory_utilization must be in (0, 1]" in str(info.value)
