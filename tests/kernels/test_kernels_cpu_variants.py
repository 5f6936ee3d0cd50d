"""Which variant of the C kernels a CPU runs (kernels/cpu_isa.py), how one is forced, and that
every variant's code compiles with each C compiler here. Whether each computes right is
tests/kernels/test_lora_cpu.py's (run per variant this CPU supports)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

from lorapage.kernels import cpu_build, cpu_isa

# /proc/cpuinfo flags of the 2-core AMD EPYC VM in issue 25: AVX and FMA, AVX2 hidden by the hypervisor.
AVX_NO_AVX2 = frozenset(
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
    "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm rep_good nopl cpuid extd_apicid tsc_known_freq pni pclmulqdq "
    "ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy "
    "abm sse4a misalignsse 3dnowprefetch topoext".split()
)
NAMES = [v.name for v in cpu_isa.variants()]


def names(variants: tuple[cpu_isa.Variant, ...]) -> list[str]:
    return [v.name for v in variants]


def test_a_cpu_with_avx_and_fma_but_no_avx2_runs_the_avx_variant():
    assert names(cpu_isa.choose(None, AVX_NO_AVX2, "x86_64")) == ["avx", "baseline"]  # best first
    assert cpu_isa.isa_level(AVX_NO_AVX2, "x86_64") == "x86-64-v2+avx+fma"
    assert names(cpu_isa.choose("baseline", AVX_NO_AVX2, "x86_64")) == ["baseline"]


def test_each_isa_level_runs_its_variant_and_those_below():
    v3 = AVX_NO_AVX2 | {"avx2", "bmi1", "bmi2"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert names(cpu_isa.choose("auto", v3, "x86_64")) == ["avx2", "avx", "baseline"]
    assert names(cpu_isa.choose(None, v4, "x86_64")) == ["avx512", "avx2", "avx", "baseline"]
    assert [cpu_isa.isa_level(f, "x86_64") for f in (v3, v4)] == ["x86-64-v3", "x86-64-v4"]
    assert names(cpu_isa.choose(None, frozenset({"sse", "sse2"}), "x86_64")) == ["baseline"]


def test_a_variant_the_cpu_lacks_is_refused_with_what_it_lacks():
    with pytest.raises(
        ValueError, match=r"LORAPAGE_CPU_KERNELS=avx2: this CPU lacks avx2, bmi1, bmi2.*runs baseline, avx"
    ):
        cpu_isa.choose("avx2", AVX_NO_AVX2, "x86_64")
    with pytest.raises(ValueError, match="no such kernel variant on x86_64; one of baseline, avx, avx2, avx512, auto"):
        cpu_isa.choose("native", AVX_NO_AVX2, "x86_64")


def test_without_cpu_flags_only_the_portable_variant_runs():
    """Off Linux there is no /proc/cpuinfo: the baseline x86-64 build, which every x86-64 CPU runs."""
    assert names(cpu_isa.choose(None, None, "x86_64")) == ["baseline"]
    assert cpu_isa.isa_level(None, "x86_64") == "x86-64"
    with pytest.raises(ValueError, match="lacks avx, cx16, fma"):
        cpu_isa.choose("avx", None, "x86_64")


@pytest.mark.parametrize("machine", ["aarch64", "riscv64", "ppc64le"])
def test_other_machines_build_one_portable_variant(machine):
    assert names(cpu_isa.choose(None, frozenset({"fp", "asimd"}), machine)) == ["portable"]
    assert cpu_isa.variants(machine)[0].flags == ()  # no -march: the compiler's default for that machine
    assert cpu_isa.isa_level(None, machine) == machine
    with pytest.raises(ValueError, match="no such kernel variant"):
        cpu_isa.choose("avx2", None, machine)


def test_the_environment_picks_the_variant_and_refuses_one_the_cpu_lacks(monkeypatch):
    """``$LORAPAGE_CPU_KERNELS`` as the engine reads it (``cpu_build._chosen``, uncached here), on
    the issue's CPU: avx512 refused, avx the best, baseline when asked for."""
    runs_avx = not cpu_isa.missing(cpu_isa.X86_64[1], cpu_isa.cpu_flags()) and cpu_isa.variants() == cpu_isa.X86_64
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: AVX_NO_AVX2)
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    with pytest.raises(ValueError, match="this CPU lacks avx2, avx512bw"):
        cpu_build._chosen.__wrapped__()
    if not runs_avx:
        pytest.skip("this CPU cannot run the avx variant the rest of this test loads")
    monkeypatch.delenv(cpu_isa.ENV)
    chosen = cpu_build._chosen.__wrapped__()
    if chosen is None:
        pytest.skip("the C kernels do not build here")
    assert chosen[0].name == "avx"
    monkeypatch.setenv(cpu_isa.ENV, "baseline")
    assert cpu_build._chosen.__wrapped__()[0].name == "baseline"


def test_this_machine_runs_its_best_variant_and_says_so():
    info = cpu_build.machine_info()
    assert set(info) == {"cpu", "isa", "cores", "kernel_variant"}
    assert isinstance(info["cores"], int) and info["cores"] >= 1 and info["cpu"]
    if cpu_build.cpu_kernels() is not None and os.environ.get(cpu_isa.ENV, "auto") in ("", "auto"):
        assert info["kernel_variant"] == cpu_isa.choose(None, cpu_isa.cpu_flags())[0].name
    assert f"C kernels: {info['kernel_variant'] or 'not built'}" in cpu_build.machine_line()


def _compilers() -> list[str]:
    found = {name: shutil.which(name) for name in ("gcc", "clang")}
    if not found["clang"] and (versioned := sorted(glob.glob("/usr/bin/clang-[0-9]*"))):
        found["clang"] = versioned[-1]  # Debian's clang-NN without the clang package's link
    return [path for path in found.values() if path]


@pytest.mark.parametrize("variant", NAMES)
@pytest.mark.parametrize("compiler", ["gcc", "clang"])
def test_every_variant_compiles_with_gcc_and_clang(compiler, variant, tmp_path):
    """The vector extensions and the ``__AVX__`` / ``__AVX2__`` paths compile at every ISA level
    (an intrinsic the level lacks is an error there). Compile only: clang's OpenMP needs its own
    runtime to link, not the libgomp torch ships, so the engine's build uses ``cc`` (gcc on Linux)."""
    path = next((p for p in _compilers() if compiler in p.rsplit("/", 1)[-1]), None)
    if path is None:
        pytest.skip(f"no {compiler} here")
    flags = next(v.flags for v in cpu_isa.variants() if v.name == variant)
    cmd = [
        path,
        "-c",
        "-O0",
        "-std=gnu11",
        "-fPIC",
        "-fopenmp",
        *flags,
        str(cpu_build.SOURCE),
        "-o",
        str(tmp_path / "k.o"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stderr[-3000:]}"
