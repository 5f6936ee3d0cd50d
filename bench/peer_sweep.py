"""The llama.cpp peer bench's bookkeeping, free of any engine: the settings grid it sweeps, the best
setting per mode, requests split across processes, the configurations' names, the ratios against
llama.cpp's best and the table (``bench_llamacpp.py`` runs the engines).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from harness import median
from llamacpp_peer import Setting

LLAMA_MODES = ("base", "grouped", "switch")  # batched base; one adapter at a time; adapter switched per step
MIXED_MODES = LLAMA_MODES[1:]
MODE_WORDS = {
    "base": "base, 32 rows per decode call",
    "grouped": "8 adapters, one adapter at a time, its requests batched",
    "switch": "8 adapters, 8 decode calls per step, adapter switched before each",
}
# precision -> (llama.cpp's base GGUF type, its adapters' type, lorapage's quantization); what each
# engine's users run at that weight precision
PRECISIONS = {"f32": ("f32", "f32", None), "q8_0": ("q8_0", "f16", "int8")}
OURS = {"f32": "float32", "q8_0": "int8"}  # lorapage's base at each precision
# lorapage's quantized bases that can run against llama.cpp's Q8_0 (--quantizations): weight-only
# int8, and w8a8 (int8 activations per token too: Q8_0's arithmetic class)
Q8_OURS = ("int8", "w8a8")


def ours_bases(precision: str, quantizations: Sequence[str] = (OURS["q8_0"],)) -> list[str]:
    """lorapage's bases measured at ``precision``: float32 at f32; each of ``quantizations`` at q8_0."""
    return [OURS[precision]] if precision == "f32" else list(quantizations)


def quantization_of(base: str) -> str | None:
    """EngineConfig.quantization of lorapage's base ``base`` (None: float32)."""
    return None if base == OURS["f32"] else base


def grid(flash_attn: Iterable[str], kv_types: Iterable[str], ubatches: Iterable[int]) -> list[Setting]:
    """Every combination of the swept values."""
    return [Setting(f, k, u) for f, k, u in itertools.product(flash_attn, kv_types, ubatches)]


def best_settings(rates: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, str]:
    """Per mode, the setting with the highest median rate (``rates[mode][setting]``: a rate per round)."""
    return {mode: max(per, key=lambda s: median(per[s])) for mode, per in rates.items()}


def split(adapters: Sequence[str | None], parts: int) -> list[list[int]]:
    """The rows of each of ``parts`` processes: whole adapter groups dealt in turn (a process keeps
    its adapters' batches whole), or, with one group, the rows dealt in turn."""
    groups: dict[str | None, list[int]] = {}
    for i, a in enumerate(adapters):
        groups.setdefault(a, []).append(i)
    out: list[list[int]] = [[] for _ in range(parts)]
    if len(groups) == 1:
        for i in range(len(adapters)):
            out[i % parts].append(i)
    else:
        for g, rows in enumerate(groups.values()):
            out[g % parts].extend(rows)
    return [sorted(rows) for rows in out]


def llama_name(precision: str, mode: str, processes: int = 1) -> str:
    procs = f", {processes} processes" if processes > 1 else ""
    return f"llama.cpp {precision}{procs}: {MODE_WORDS[mode]}"


def ours_name(precision: str, mixed: bool, base: str | None = None, processes: int = 1) -> str:
    """lorapage's configuration: its base (default: the precision's, :data:`OURS`), mode, and its
    processes when one per core (the requests dealt between them, as llama.cpp's are)."""
    what = "mixed, default scheduler (vtc)" if mixed else "base only"
    procs = f", {processes} processes" if processes > 1 else ""
    return f"lorapage {base or OURS[precision]}{procs}: {what}"


def ratios(
    med: Mapping[str, float],
    precisions: Sequence[str],
    processes: int,
    quantizations: Sequence[str] = (OURS["q8_0"],),
    per_round: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, dict[str, float | str]]:
    """lorapage against llama.cpp's best at each weight precision (its base at ``precision``; float32
    and each of ``quantizations`` for lorapage), from the medians ``med`` of one thread count:
    llama.cpp's best mixed is its better multi-adapter mode, in one process or (``processes`` > 1) one
    per core; lorapage's is its better of one process and one per core, where both ran. Each entry:
    the ratio, which llama.cpp configuration it is against and which of lorapage's (``ours``); with
    ``per_round`` (each configuration's rates, round by round), also ``round_ratio``: the median of
    the rounds' own ratios (a round's configurations ran back to back, under much the same load)."""
    out: dict[str, dict[str, float | str]] = {}
    for prec in precisions:
        procs = (1, processes) if processes > 1 else (1,)
        mixed_peers = [llama_name(prec, m, p) for m in MIXED_MODES for p in procs]
        base_peers = [llama_name(prec, "base", p) for p in procs]
        best_mixed = max(mixed_peers, key=lambda n: med[n])
        best_base = max(base_peers, key=lambda n: med[n])
        # lorapage at the same precision (targets), and float32 against any (where it ran)
        ours = [(b, True) for b in ours_bases(prec, quantizations)]
        if prec != "f32" and ours_name("f32", True) in med:
            ours.insert(0, (OURS["f32"], False))
        for mine, same in ours:
            for mixed, peer, key, target in (
                (True, best_mixed, f"lorapage_{mine}_mixed_over_llamacpp_{prec}_best_mixed", 2.0),
                (False, best_base, f"lorapage_{mine}_base_over_llamacpp_{prec}_base", 1.0),
            ):
                names = [ours_name(prec, mixed, mine, p) for p in procs]
                name = max((n for n in names if n in med), key=lambda n: med[n])
                out[key] = {
                    "ratio": med[name] / med[peer],
                    "against": peer,
                    "ours": name,
                    "target": target if same else "-",
                }
                if per_round is not None:
                    out[key]["round_ratio"] = median([a / b for a, b in zip(per_round[name], per_round[peer])])
    return out


def met(entries: Mapping[str, Mapping[str, float | str]]) -> bool:
    """Every entry with a numeric target at or above it."""
    return all(e["ratio"] >= e["target"] for e in entries.values() if isinstance(e["target"], float))


def cell(rates: Sequence[float] | None, agree: int | None, of: int, setting: str | None = None) -> str:
    """A table cell: the median rate, the requests agreeing with the reference, and the setting."""
    if not rates:
        return "-"
    text = f"{median(rates):,.0f}" + (f" ({agree}/{of})" if agree is not None else "")
    return text + (f" `{setting}`" if setting else "")
