"""``--tensor-parallel-size`` (vLLM's ``tensor_parallel_size``) on every command that builds,
deploys, replays or sizes an engine: ``serve``, ``fleet``, ``replay run`` (``--embedded``: the
engine's flag; ``--simulate``: each simulated replica on that many devices) and ``plan``."""

from __future__ import annotations

import argparse
from argparse import Namespace

import pytest

from lorapage.engine import flags
from lorapage.sim.cli import fleet_config

FLAG = ["--tensor-parallel-size", "2"]


@pytest.mark.parametrize("command", ["lorapage.serve.cli", "lorapage.fleet.cli"])
def test_serve_and_fleet(command):
    import importlib

    cli = importlib.import_module(command)
    args = cli.build_parser().parse_args(FLAG)
    assert flags.engine_config(args, cli.PROG).tensor_parallel_size == 2
    assert "--tensor-parallel-size" in cli.build_parser().format_help()


def test_replay_run_embedded_and_simulated():
    # --embedded: serve's engine flags, parsed as lorapage.replay.engine_flags.build_engine parses them.
    parser = argparse.ArgumentParser(add_help=False)
    flags.add_engine_arguments(parser)
    args, leftover = parser.parse_known_args(FLAG)
    assert not leftover and flags.engine_config(args, "replay").tensor_parallel_size == 2
    # --simulate: the simulated replica on two devices.
    sim = fleet_config(Namespace(replicas=2, seed=0, warmup=0.0, max_disk_loras=10), FLAG)
    assert sim.costs.name.endswith("-tp2")


def test_plan():
    from lorapage.capacity.cli import build_parser

    assert build_parser().parse_args(["--model", "m", *FLAG]).tensor_parallel_size == 2
