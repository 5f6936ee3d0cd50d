"""The ``lorapage`` command explains itself: commands and version, every flag's help and default
in plain text, and one clear line (exit 2, no traceback) for a busy port, a model directory it
cannot read or a bad value, with no keys printed by a server that is not going to listen."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lorapage import EngineConfig
from lorapage.cli import COMMANDS
from lorapage.testing.serve_process import run_serve

_CONFIG_FLAGS = {f.name for f in dataclasses.fields(EngineConfig)}


def lorapage(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorapage.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def concurrently(*runs: Callable[[], subprocess.CompletedProcess[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Each of ``runs`` (independent commands, each a process that mostly imports), one per CPU at
    a time: their results in order."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda run: run(), runs))


def one_clear_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert all(w in done.stderr for w in words), done.stderr
    assert "key" not in done.stdout  # no keys for a server that never listened


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_with_a_line(flag):
    done = lorapage(flag)
    assert done.returncode == 0
    for name, (_, summary) in COMMANDS.items():
        assert f"  {name}" in done.stdout and summary in done.stdout


def test_version_and_unknown_command():
    done = lorapage("--version")
    assert done.returncode == 0 and done.stdout.startswith("lorapage ") and done.stdout.split()[1][0].isdigit()
    done = lorapage("srve")
    assert done.returncode == 2 and "unknown command 'srve'" in done.stderr and "serve" in done.stderr


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from lorapage.fleet.cli import build_parser as fleet
    from lorapage.replay.cli import build_parser as replay
    from lorapage.serve.cli import build_parser as serve

    found = {"serve": serve(), "fleet": fleet()}
    sub = next(a for a in replay()._actions if isinstance(a, argparse._SubParsersAction))
    found.update({f"replay {name}": p for name, p in sub.choices.items()})
    return found


@pytest.mark.parametrize("command", sorted(_parsers()))
def test_every_flag_has_plain_help_and_shows_its_default(command):
    p = _parsers()[command]
    text = p.format_help()
    assert "``" not in text and ":func:" not in text
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        help_text = p._get_formatter()._expand_help(action)
        takes_value = action.option_strings and action.nargs != 0
        if takes_value and action.default is not None and action.default != [] or action.dest in _CONFIG_FLAGS:
            assert "default" in help_text, f"{command} {action.option_strings}: {help_text}"


def test_serve_on_a_busy_port_says_so_before_loading_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_serve("--port", str(port), "--state-dir", ":memory:")
    one_clear_line(done, f"127.0.0.1:{port}", "in use")


def test_serve_names_a_model_directory_it_cannot_use(tmp_path: Path):
    absent, empty, partial = tmp_path / "absent", tmp_path / "empty", tmp_path / "partial"
    empty.mkdir()
    partial.mkdir()
    (partial / "config.json").write_text('{"hidden_size": 8}')
    # A state directory each: they run at once, and the engine takes its state directory's lock.
    done = concurrently(
        *(
            lambda d=d: run_serve("--model", str(d), env={"LORAPAGE_STATE_DIR": str(tmp_path / f"state-{d.name}")})
            for d in (absent, empty, partial)
        )
    )
    one_clear_line(done[0], "--model", "no such directory")
    one_clear_line(done[1], "--model", "config.json")
    one_clear_line(done[2], "config.json lacks", "vocab_size")


def test_bad_values_are_one_line(tmp_path: Path):
    done = concurrently(
        lambda: run_serve("--access-log", str(tmp_path / "absent" / "log")),
        lambda: run_serve("--max-loras", "0"),
        lambda: run_serve("--slo-window", "0"),
        lambda: lorapage("demo", "--max-tokens", "0"),
    )
    one_clear_line(done[0], "--access-log")
    one_clear_line(done[1], "max_loras must be >= 1")
    one_clear_line(done[2], "--slo-window must be")
    one_clear_line(done[3], "--max-tokens", "max_tokens")


def test_serve_help_lists_the_two_lora_counts_the_tail_lanes_and_the_host_byte_bound():
    done = lorapage("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # help lines wrap
    for flag in (
        "--max-loras",
        "--max-resident-loras",
        "--max-cpu-lora-bytes",
        "--reserved-tail-lanes",
        "--lane-age-deadline-s",
    ):
        assert flag in text, flag
    assert "distinct adapters one step's batch may hold" in text
    assert "(default: max_loras // 8)" in text and "(default: no byte bound (max_cpu_loras only))" in text


def test_lane_and_slot_flags_reach_the_engine_s_policy_and_residency_rules():
    """serve's flags -> EngineConfig -> the engine's VtcConfig (lanes) and ResidencyLimits (slots,
    host bytes), and the lookup tables get a row per slot."""
    from lorapage import Engine
    from lorapage.engine.flags import engine_config
    from lorapage.scheduler import MeteredPolicy, VtcScheduler
    from lorapage.serve.cli import build_parser

    flags = ["--state-dir", ":memory:", "--max-loras", "4", "--max-resident-loras", "6", "--reserved-tail-lanes", "1"]
    flags += ["--lane-age-deadline-s", "0.25", "--max-cpu-lora-bytes", "1000000"]
    engine = Engine(engine_config(build_parser().parse_args(flags), "lorapage serve"))
    policy = engine.debug.policy
    assert isinstance(policy, MeteredPolicy) and isinstance(policy.policy, VtcScheduler)
    vtc = policy.policy.config
    assert (vtc.max_loras, vtc.reserved_tail_lanes, vtc.tail_lanes, vtc.age_deadline_s) == (4, 1, 1, 0.25)
    limits = engine.debug.residency.limits
    assert (limits.max_resident_loras, limits.max_cpu_lora_bytes) == (6, 1_000_000)
    assert engine.debug.residency.slots.num_free == 6 and engine.debug.tables.page_table.shape[0] == 7
    # Derived: the pool's worth of largest adapters, at least max_loras.
    args = build_parser().parse_args(["--state-dir", ":memory:", "--max-loras", "4"])
    derived = Engine(engine_config(args, "lorapage serve"))
    assert derived.debug.max_resident_loras >= 4 and derived.debug.residency.limits.max_cpu_lora_bytes is None
    for e in (engine, derived):
        asyncio.run(e.close())


def test_bad_lane_and_slot_values_are_one_line():
    done = concurrently(
        lambda: run_serve("--max-loras", "8", "--max-resident-loras", "4"),
        lambda: run_serve("--max-loras", "8", "--reserved-tail-lanes", "8"),
    )
    one_clear_line(done[0], "max_resident_loras (4) must be >= max_loras (8)")
    one_clear_line(done[1], "reserved_tail_lanes must be in [0, max_loras=8)")


def test_the_command_sets_openmp_spin_before_torch_loads(monkeypatch):
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the command sets it first (an
    operator's own value wins), so 2 intra-op threads keep their worker awake across a step."""
    from lorapage.cli import main
    from lorapage.omp_env import SPINCOUNT, SPINCOUNT_ENV

    monkeypatch.delenv(SPINCOUNT_ENV, raising=False)
    assert main(["--version"]) == 0
    assert os.environ[SPINCOUNT_ENV] == SPINCOUNT
    monkeypatch.setenv(SPINCOUNT_ENV, "123")
    assert main(["--version"]) == 0
    assert os.environ[SPINCOUNT_ENV] == "123"
