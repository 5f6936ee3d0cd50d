"""The llama.cpp peer bench's engine-free parts: it imports without llama-cpp-python, a worker
process answers line by line, the sweep keeps each mode's best setting, requests are dealt between
processes by adapter, and the ratios compare at the same weight precision against llama.cpp's best.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(autouse=True)
def bench_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench's modules import one another by plain name


def test_the_bench_imports_and_parses_without_llama_cpp():
    code = (
        "import sys; sys.argv = ['bench_llamacpp.py', '--help'];"
        "import bench_llamacpp;"
        "assert 'llama_cpp' not in sys.modules; bench_llamacpp.parse()"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--llamacpp-python" in done.stdout


def test_a_worker_answers_each_request_and_reports_errors(tmp_path: Path):
    from peer_proc import Worker, WorkerFailed

    code = (
        "from peer_proc import serve\n"
        "def handle(req):\n"
        "    print('chatter on stdout')\n"
        "    if req['op'] == 'fail': raise ValueError('asked to')\n"
        "    return {'twice': 2 * req['x']}\n"
        "serve(handle)\n"
    )
    w = Worker([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r})\n{code}"], tmp_path / "w.log")
    try:
        assert w.ask(op="double", x=21) == {"twice": 42}
        with pytest.raises(WorkerFailed, match="asked to"):
            w.ask(op="fail")
        assert w.ask(op="double", x=1) == {"twice": 2}
    finally:
        w.close()
    assert "chatter on stdout" in (tmp_path / "w.log").read_text()


def test_settings_round_trip_and_the_best_per_mode_is_kept():
    from llamacpp_peer import Setting
    from peer_sweep import best_settings, grid

    settings = grid(["auto", "off"], ["f16", "f32"], [32, 512])
    assert len(settings) == 8 and all(Setting.parse(str(s)) == s for s in settings)
    rates = {
        "base": {"fa=auto,kv=f16,ub=512": [10.0, 30.0, 11.0], "fa=off,kv=f32,ub=32": [20.0, 19.0, 21.0]},
        "switch": {"fa=auto,kv=f16,ub=512": [5.0], "fa=off,kv=f32,ub=32": [4.0]},
    }
    assert best_settings(rates) == {"base": "fa=off,kv=f32,ub=32", "switch": "fa=auto,kv=f16,ub=512"}


def test_requests_are_dealt_by_adapter_and_base_rows_in_turn():
    from peer_sweep import split

    mixed = [f"a{i % 8}" for i in range(32)]
    parts = split(mixed, 2)
    assert sorted(parts[0] + parts[1]) == list(range(32))
    assert {mixed[i] for i in parts[0]}.isdisjoint({mixed[i] for i in parts[1]})
    assert split([None] * 5, 2) == [[0, 2, 4], [1, 3]]


def test_ratios_take_llama_cpps_best_configuration_at_the_same_precision():
    from peer_sweep import llama_name, met, ours_name, ratios

    med = {
        llama_name("f32", "base"): 100.0,
        llama_name("f32", "grouped"): 40.0,
        llama_name("f32", "switch"): 50.0,
        llama_name("f32", "base", 2): 120.0,
        llama_name("f32", "grouped", 2): 30.0,
        llama_name("f32", "switch", 2): 60.0,
        ours_name("f32", True): 150.0,
        ours_name("f32", False): 125.0,
    }
    out = ratios(med, ["f32"], processes=2)
    mixed = out["lorapage_float32_mixed_over_llamacpp_f32_best_mixed"]
    base = out["lorapage_float32_base_over_llamacpp_f32_base"]
    assert (mixed["ratio"], mixed["against"]) == (2.5, llama_name("f32", "switch", 2))
    assert (base["ratio"], base["against"]) == (125.0 / 120.0, llama_name("f32", "base", 2))
    assert met(out)
    assert not met(ratios(med, ["f32"], processes=1) | {"x": {"ratio": 1.9, "target": 2.0, "against": ""}})
    # lorapage one process per core as well: its better configuration counts, and the entry names it
    med[ours_name("f32", True, processes=2)], med[ours_name("f32", False, processes=2)] = 170.0, 110.0
    out = ratios(med, ["f32"], processes=2)
    mixed = out["lorapage_float32_mixed_over_llamacpp_f32_best_mixed"]
    base = out["lorapage_float32_base_over_llamacpp_f32_base"]
    per_core = "lorapage float32, 2 processes: mixed, default scheduler (vtc)"
    assert (mixed["ratio"], mixed["ours"]) == (170.0 / 60.0, per_core)
    assert (base["ratio"], base["ours"]) == (125.0 / 120.0, ours_name("f32", False))


def test_each_quantized_base_is_measured_against_q8_0():
    """lorapage's int8 and w8a8 bases each get targets against llama.cpp's Q8_0; float32 a ratio only."""
    from peer_sweep import llama_name, ours_bases, ours_name, quantization_of, ratios

    assert ours_bases("f32", ("int8", "w8a8")) == ["float32"] and ours_bases("q8_0", ("w8a8",)) == ["w8a8"]
    assert quantization_of("float32") is None and quantization_of("w8a8") == "w8a8"
    med = {llama_name("q8_0", m): r for m, r in (("base", 300.0), ("grouped", 120.0), ("switch", 100.0))}
    for base, mixed, alone in (("float32", 160.0, 170.0), ("int8", 140.0, 150.0), ("w8a8", 260.0, 330.0)):
        med[ours_name("q8_0", True, base)], med[ours_name("q8_0", False, base)] = mixed, alone
    out = ratios(med, ["q8_0"], processes=1, quantizations=("int8", "w8a8"))
    w8a8 = out["lorapage_w8a8_mixed_over_llamacpp_q8_0_best_mixed"]
    assert (w8a8["ratio"], w8a8["target"], w8a8["against"]) == (260.0 / 120.0, 2.0, llama_name("q8_0", "grouped"))
    assert out["lorapage_w8a8_base_over_llamacpp_q8_0_base"]["ratio"] == 1.1
    assert out["lorapage_int8_base_over_llamacpp_q8_0_base"]["target"] == 1.0
    assert out["lorapage_float32_base_over_llamacpp_q8_0_base"]["target"] == "-"
    rounds = {name: [rate, rate * 2, rate * 3] for name, rate in med.items()}
    rounds[ours_name("q8_0", False, "w8a8")] = [330.0, 300.0, 1500.0]  # ratios 1.1, 0.5, 1.67
    per = ratios(med, ["q8_0"], 1, ("w8a8",), rounds)["lorapage_w8a8_base_over_llamacpp_q8_0_base"]
    assert per["round_ratio"] == 1.1
