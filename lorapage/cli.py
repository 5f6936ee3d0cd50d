"""The ``lorapage`` command: one subcommand per job, each with its own ``--help``."""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

from lorapage.omp_env import default_spin

# name -> (module with a main(argv), what it does in one line). Modules are imported only when
# their command runs: `lorapage --help` must not load torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("lorapage.serve.cli", "the OpenAI-compatible HTTP server (no flags: the built-in tiny model)"),
    "demo": ("lorapage.demo", "the embedded engine on the tiny model: every demo adapter answers one prompt"),
    "replay": ("lorapage.replay.cli", "load replay: generate, import, run and compare traces; the fleet simulator"),
    "fleet": ("lorapage.fleet.cli", "engine replicas on Ray Serve behind one OpenAI endpoint"),
    "adapter": ("lorapage.adapters.cli", "adapter tools: the sha256 digest an https registration needs"),
    "base": ("lorapage.bases.cli", "base upgrades: the drift check of every adapter, old base against new"),
    "plan": ("lorapage.capacity.cli", "sizing: pool, host RAM, resident adapters and replicas for a workload"),
}


def version() -> str:
    """The installed lorapage's version."""
    try:
        return metadata.version("lorapage")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: lorapage [-h] [--version] COMMAND [options]",
        "",
        "One base LLM and thousands of LoRA adapters in one process.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()),
        "",
        "`lorapage COMMAND --help` lists a command's options and their defaults.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    default_spin()  # before any command loads torch (and with it libgomp, which reads it once)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"lorapage {version()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        if argv:
            print(f"\nlorapage: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
