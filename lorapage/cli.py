"""The ``lorapage`` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "demo": "lorapage.demo",
        "serve": "lorapage.server.serve",
        "replay": "lorapage.replay.cli",
        "adapter": "lorapage.adapters.cli",
        "fleet": "lorapage.fleet.cli",
    }
    if not argv or argv[0] not in commands:
        print(f"usage: lorapage {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
