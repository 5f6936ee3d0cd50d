"""Stop strings in streamed text: where one ends the output, and how much text to hold back."""

from __future__ import annotations


def find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in ``text`` at or after ``start``."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s)))
        if i != -1 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
