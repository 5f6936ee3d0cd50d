"""The embedded engine of ``replay run --embedded``, built from ``lorapage serve``'s own flags.

The flags are :func:`lorapage.engine.flags.add_engine_arguments`, so the two commands accept the same engine options
(``--model``, ``--lora-modules``, ``--max-loras``, ``--scheduler``, ...) with the same defaults:
no ``--model`` means the built-in tiny model and its demo adapters.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence

from lorapage.engine import Engine, flags
from lorapage.errors import LorapageError
from lorapage.traces.trace import TraceRequest

PROG = "lorapage replay run"


def trace_adapters(trace: Iterable[TraceRequest], base_name: str) -> list[str]:
    """The adapters a trace names (``base:adapter`` or ``adapter``; the base itself is not one)."""
    names = set()
    for req in trace:
        prefix, sep, name = req.model.rpartition(":")
        if req.model != base_name and (not sep or prefix == base_name):
            names.add(name)
    return sorted(names)


def build_engine(
    argv: Sequence[str], trace: Sequence[TraceRequest], adapter_dirs: Sequence[str], weights: Mapping[str, float]
) -> Engine:
    """An engine configured by serve's flags in ``argv``, with its ``--lora-modules`` registered
    and, when ``adapter_dirs`` are given, every other adapter of the trace registered on them in
    turn (so one directory can stand for many distinct adapters)."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    flags.add_engine_arguments(parser)
    args, leftover = parser.parse_known_args(list(argv))
    if leftover:
        raise SystemExit(f"{PROG}: unrecognized engine arguments: {' '.join(leftover)}")
    config = flags.engine_config(args, PROG)
    engine = Engine(config, tenant_weights=dict(weights) or None)
    name = ""
    try:
        for name, path in flags.lora_modules(args, PROG).items():
            engine.add_adapter(name, path)
        known = {info.name for info in engine.admin.served()}
        missing = [a for a in trace_adapters(trace, engine.base_name) if a not in known]
        for k, name in enumerate(missing if adapter_dirs else []):
            engine.add_adapter(name, adapter_dirs[k % len(adapter_dirs)])
    except LorapageError as exc:
        raise SystemExit(f"{PROG}: adapter {name!r}: {exc.message}") from None
    return engine
