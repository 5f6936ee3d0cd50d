"""What this CPU is, and which build (variant) of the CPU path's C kernels it runs.

The kernels are compiled per ISA level rather than with ``-march=native``: a variant's flags, not
the machine that built it, say what its code needs, so one cache serves every machine that shares
it, and the tests run each variant this CPU can (their results agree within the float32 bound of
``tests/numeric_bounds.py``). At run time the best variant the CPU supports is chosen from its
flags (Linux ``/proc/cpuinfo``; where there is none, only the first, portable variant), unless
``$LORAPAGE_CPU_KERNELS`` names one. Pure: everything here takes the CPU's flags as an argument
or reads them once.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

ENV = "LORAPAGE_CPU_KERNELS"  # a variant's name (or "auto"): for tests and benches


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name, the compiler flags that set its ISA, and the CPU flags
    (as ``/proc/cpuinfo`` spells them) a CPU must have to run it."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str] = frozenset()


# The x86-64 psABI levels, as Linux names their features (LZCNT is "abm" on Intel and AMD alike).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

X86_64 = (
    Variant("baseline", ("-march=x86-64",)),  # SSE2: any x86-64 CPU; the C's portable loops
    # AVX and FMA without AVX2 (Sandy Bridge-era and AMD Piledriver parts, VMs that hide AVX2):
    # the float32 rank-16 expand's AVX path; bfloat16's needs AVX2.
    Variant("avx", ("-march=x86-64-v2", "-mavx", "-mfma"), _V2 | {"avx", "fma"}),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
    Variant("avx512", ("-march=x86-64-v4",), _V4),
)
PORTABLE = (Variant("portable", ()),)  # aarch64 and the rest: the compiler's default target


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built for ``machine`` (default: this one), the portable one first, then by ISA level."""
    return X86_64 if (machine or platform.machine()).lower() in ("x86_64", "amd64") else PORTABLE


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags (``/proc/cpuinfo``'s ``flags`` on x86, ``Features`` on arm); None where unknown."""
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


@functools.cache
def cpu_model() -> str:
    """This CPU's model name, as ``lscpu`` shows it where it can be read."""
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def _cpuinfo() -> list[str]:
    """The first processor's lines of ``/proc/cpuinfo`` (none off Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return []


def missing(variant: Variant, flags: frozenset[str] | None) -> frozenset[str]:
    """The flags ``variant`` needs that a CPU with ``flags`` lacks (all of them where the flags are unknown)."""
    return variant.needs - (flags or frozenset())


def runnable(flags: frozenset[str] | None, machine: str | None = None) -> tuple[Variant, ...]:
    """The variants a CPU with ``flags`` runs, in :func:`variants` order."""
    return tuple(v for v in variants(machine) if not missing(v, flags))


def choose(requested: str | None, flags: frozenset[str] | None, machine: str | None = None) -> tuple[Variant, ...]:
    """The variants to try building, best first: the one ``requested`` (``$LORAPAGE_CPU_KERNELS``),
    else every one this CPU runs (a compiler too old for the best still builds the next). Refuses a
    variant that does not exist here or that the CPU lacks: its code could not run."""
    every = variants(machine)
    if not requested or requested == "auto":
        return runnable(flags, machine)[::-1]
    names = ", ".join(v.name for v in every)
    chosen = next((v for v in every if v.name == requested), None)
    if chosen is None:
        raise ValueError(
            f"{ENV}={requested}: no such kernel variant on {machine or platform.machine()}; one of {names}, auto"
        )
    if lacks := missing(chosen, flags):
        can = ", ".join(v.name for v in runnable(flags, machine))
        raise ValueError(
            f"{ENV}={requested}: this CPU lacks {', '.join(sorted(lacks))}, which that variant's code needs; "
            f"it runs {can} (or unset {ENV} to pick the best)"
        )
    return (chosen,)


# Instructions that multiply int8 by int8 into int32 sums: what torch's int8 GEMM (oneDNN, under
# ``torch._int_mm``) needs to beat float32 (x86 VNNI and AMX; arm's SDOT and I8MM). Without them it
# takes a reference path: on an AVX2 AMD EPYC, 25x slower than a float32 GEMM at 32 x 1,024 x 4,096
# (an x86 engine runs FBGEMM's int8 GEMM there instead: kernels/linear_w8a8_fbgemm.py).
INT8_DOT = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"})


def int8_dot_product(flags: frozenset[str] | None) -> bool | None:
    """Whether a CPU with ``flags`` has int8 dot-product instructions (None where the flags are unknown)."""
    return None if flags is None else bool(INT8_DOT & flags)


def isa_level(flags: frozenset[str] | None, machine: str | None = None) -> str:
    """The CPU's ISA level: the x86-64 psABI level (``x86-64-v3``), with ``+avx+fma`` where a v2
    CPU has them; elsewhere the machine's name (``aarch64``)."""
    machine = machine or platform.machine()
    if variants(machine) is not X86_64:
        return machine
    if flags is None:
        return "x86-64"
    for level, needs in (("x86-64-v4", _V4), ("x86-64-v3", _V3), ("x86-64-v2", _V2)):
        if needs <= flags:
            return level + ("+avx+fma" if level == "x86-64-v2" and {"avx", "fma"} <= flags else "")
    return "x86-64"
