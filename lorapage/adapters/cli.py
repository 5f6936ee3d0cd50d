"""``lorapage adapter digest DIR``: the content digest an https registration needs as ``sha256``."""

from __future__ import annotations

import argparse
import sys

from lorapage.adapters.digest import ADAPTER_FILES, content_digest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lorapage adapter", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    digest = sub.add_parser("digest", help=f"print the sha256 content digest over {' and '.join(ADAPTER_FILES)}")
    digest.add_argument("dirs", nargs="+", metavar="DIR")
    args = p.parse_args(argv)
    status = 0
    for path in args.dirs:
        try:
            print(f"{content_digest(path)}  {path}")
        except OSError as exc:
            print(f"lorapage adapter digest: {path}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
    return status
