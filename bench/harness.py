"""What every benchmark shares: the machine line, rounds in alternating order, medians, a readable
table and the JSON last line.

A machine's speed drifts over a run, often by more than the change measured, so a bench that
compares variants runs them round by round, which goes first alternating (:func:`interleaved`),
and reports medians over the rounds. Its figures end as one JSON object on the last line of
stdout (:func:`print_json`), the machine it ran on included, for the results log to parse.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from lorapage.kernels.cpu_build import machine_info, machine_line

__all__ = ["interleaved", "machine_info", "machine_line", "median", "print_json", "table"]

T = TypeVar("T")


def interleaved(rounds: int, variants: Sequence[T]) -> Iterator[tuple[int, T]]:
    """``(round, variant)`` for each round and variant, the variants in their order on even rounds
    and reversed on odd ones: no variant always runs first, on a cold cache, or last, on a warm one."""
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            yield r, variant


def median(values: Iterable[float]) -> float:
    """The median over rounds (what every bench reports: robust to one slow round)."""
    return statistics.median(values)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str) -> str:
    """A markdown table (what bench/RESULTS.md pastes): ``header``, then ``rows`` of cells already
    formatted; ``align`` has one letter per column, ``l`` left or ``r`` right."""
    assert len(align) == len(header) and set(align) <= {"l", "r"}, align
    lines = [header, ["---" if a == "l" else "---:" for a in align], *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def print_json(summary: dict[str, Any], **dumps: Any) -> None:
    """The bench's last line: ``summary`` as one JSON object, with the machine it ran on
    (:func:`machine_info`'s keys, added where the summary does not hold them already)."""
    missing = {k: v for k, v in machine_info().items() if k not in summary}
    print(json.dumps({**summary, **missing}, **dumps), flush=True)
