"""Retired words stay retired: one name per idea in ``lorapage/`` and ``kernels/``.

Each row of :data:`RETIRED` is (pattern, where, why): a regular expression that must not match
any line of the files ``where`` names (globs from the checkout's root; a leading ``!`` leaves
files out), and the reason, which is the message a failure shows. To retire a word, add a row.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".c", ".h"}


class Retired(NamedTuple):
    pattern: str
    where: tuple[str, ...]
    why: str


RETIRED: tuple[Retired, ...] = (
    Retired(
        r"(?i)(?<![a-z])lanes?(?![a-z])",
        ("kernels/*",),
        "the C kernels' tokens run in lockstep as stripes; a lane is the scheduler's distinct-adapter "
        "place in the batch (lorapage/scheduler/lanes.py)",
    ),
    Retired(
        r"\bclass FleetConfig\b",
        ("lorapage/**/*.py", "!lorapage/fleet/config.py"),
        "one FleetConfig, the deployed fleet's (lorapage/fleet/config.py); the simulator's is SimFleetConfig",
    ),
)


def files_of(where: tuple[str, ...]) -> list[Path]:
    chosen: set[Path] = set()
    for glob in where:
        if not glob.startswith("!"):
            chosen |= {p for p in ROOT.glob(glob) if p.is_file() and p.suffix in TEXT_SUFFIXES}
    for glob in where:
        if glob.startswith("!"):
            chosen -= set(ROOT.glob(glob[1:]))
    return sorted(chosen)


@pytest.mark.parametrize("rule", RETIRED, ids=[r.pattern for r in RETIRED])
def test_retired_words_do_not_come_back(rule: Retired):
    files = files_of(rule.where)
    assert files, f"{rule.where} names no file: move the row with the code it guards"
    pattern = re.compile(rule.pattern)
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"{rule.why}:\n" + "\n".join(found)


def test_a_retired_word_is_found():
    """The table's first row finds what it retires (it would, were it reintroduced)."""
    assert re.search(RETIRED[0].pattern, "static Plan plan_lanes(int lanes, ...)  /* LANES */")
    assert not re.search(RETIRED[0].pattern, "the plane's planned stripes")
