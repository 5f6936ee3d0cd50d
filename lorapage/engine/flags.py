"""The engine's command-line flags, beside the config they fill: every :class:`EngineConfig` field
as a flag (declared once, :mod:`lorapage.flags`), the model and ``--lora-modules``, the state
directory's, and the checks that end a command naming the flag at fault. What any command that
builds an engine takes: ``lorapage serve``, ``fleet``, ``replay run --embedded``, ``base check``."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from lorapage.adapters.binding import load_base_names
from lorapage.adapters.names import check_adapter_id
from lorapage.config import EngineConfig
from lorapage.errors import LorapageError
from lorapage.flags import add_config_flags, config_overrides, fail
from lorapage.options import GROUPS
from lorapage.sources import AdapterRoots
from lorapage.tiny import demo_adapter_dirs

# Flags of their own below: a server keeps its registry on disk by default, an engine in memory.
_STATE_FLAG = "state_dir"
# EngineConfig fields that are where a server keeps its state (the "state" group; flags: add_state_arguments).
STATE_FIELDS = tuple(
    f.name for f in fields(EngineConfig) if f.metadata.get("group") == "state" and f.name != _STATE_FLAG
)
ENGINE_FLAG_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name != _STATE_FLAG)


def add_engine_arguments(p: argparse.ArgumentParser) -> list[str]:
    """The model, its adapters and every EngineConfig flag except the state ones: what any command
    that builds an engine takes (``lorapage serve``, ``fleet``, ``replay run --embedded``).
    Returns the config fields it made flags for."""
    names = add_config_flags(p, EngineConfig, skip=(*STATE_FIELDS, _STATE_FLAG))
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="PEFT adapter directories to register at start (default with no --model: the demo adapters)",
    )
    return names


def default_state_dir() -> str:
    """``$LORAPAGE_STATE_DIR``, else ``$XDG_STATE_HOME/lorapage``, else ``~/.local/state/lorapage``."""
    if env := os.environ.get("LORAPAGE_STATE_DIR"):
        return env
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(xdg) / "lorapage")


def add_state_arguments(p: argparse.ArgumentParser) -> list[str]:
    """Where a server keeps what must survive it: the adapter registry and downloaded adapters."""
    group = p.add_argument_group(GROUPS["state"])
    group.add_argument(
        "--state-dir",
        default=None,
        help="the adapter registry (ids, versions, aliases, owners) lives here across restarts; "
        "':memory:' keeps it for this run only (default: $LORAPAGE_STATE_DIR, $XDG_STATE_HOME/lorapage "
        "or ~/.local/state/lorapage)",
    )
    return add_config_flags(p, EngineConfig, only=STATE_FIELDS)


def state_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields :func:`add_state_arguments`' flags set."""
    state = args.state_dir or default_state_dir()
    return {"state_dir": None if state == ":memory:" else state, **config_overrides(args, STATE_FIELDS)}


def engine_config(args: argparse.Namespace, prog: str) -> EngineConfig:
    """The EngineConfig that :func:`add_engine_arguments`' (and, where the parser has them,
    :func:`add_state_arguments`') flags ask for; a bad value ends the command naming it."""
    overrides = config_overrides(args, ENGINE_FLAG_FIELDS)
    if hasattr(args, _STATE_FLAG):
        overrides.update(state_overrides(args))
    try:
        config = EngineConfig(**overrides)
    except ValueError as exc:  # a bad flag value: say which, not a traceback
        fail(prog, str(exc))
    check_model_dir(config.model, prog)
    if config.base_names is not None:
        try:
            load_base_names(config.base_names)
        except ValueError as exc:
            fail(prog, f"--base-names {config.base_names}: {exc}")
    return config


def check_model_dir(model: str, prog: str, flag: str = "--model") -> None:
    """End ``prog`` with one line (naming ``flag``) when ``model`` is no readable Hugging Face model directory."""
    config = Path(model) / "config.json"
    try:
        with config.open("rb"):
            pass
    except OSError as exc:
        reason = "no such directory" if not Path(model).is_dir() else f"cannot read config.json ({exc.strerror})"
        fail(prog, f"{flag} {model}: {reason}; expected a Hugging Face model directory (config.json, *.safetensors)")


def lora_modules(args: argparse.Namespace, prog: str) -> dict[str, str]:
    """``--lora-modules`` as name -> directory (the demo adapters when neither it nor --model is given)."""
    if not args.lora_modules and args.model is None:
        return {name: str(path) for name, path in demo_adapter_dirs().items()}
    modules = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            fail(prog, f"--lora-modules takes NAME=DIR; got {item!r}")
        try:
            check_adapter_id(name, base_name="")
        except LorapageError as exc:
            fail(prog, f"--lora-modules {item}: {exc.message}")
        modules[name] = path
    return modules


def adapter_roots(args: argparse.Namespace, modules: dict[str, str], prog: str) -> AdapterRoots:
    """``--adapter-root`` values (``DIR`` or ``TENANT=DIR``, each checked to exist), with the
    ``--lora-modules`` directories as the operator's own."""
    try:
        roots = AdapterRoots.parse(args.adapter_root, operator=modules.values())
    except ValueError as exc:
        fail(prog, str(exc))
    for root in roots.all_roots():
        if not root.is_dir():
            fail(prog, f"--adapter-root {root}: no such directory")
    return roots
