"""``lorapage replay`` end to end: gen, import, run --embedded (report files and plots), compare,
and Ctrl-C during a run writing the partial report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lorapage.replay.cli import main
from lorapage.tiny import TINY_ADAPTERS_DIR

ROOT = Path(__file__).resolve().parents[2]
DEMO_TRACE = ROOT / "bench" / "traces" / "demo.jsonl"


def test_cli_gen_import_run_compare(tmp_path, capsys):
    trace = tmp_path / "gen.jsonl"
    gen = ["gen", "-o", str(trace), "--scale", "0.01", "--requests", "6", "--rate", "400", "--tenants", "2"]
    assert main(gen + ["--prompt-mean", "20", "--output-mean", "6", "--output-max", "8", "--adapters", "300"]) == 0
    assert len(trace.read_text().splitlines()) == 6
    imported = tmp_path / "bg.jsonl"
    csv = DEMO_TRACE.parent / "burstgpt_sample.csv"
    assert main(["import", "burstgpt", str(csv), "-o", str(imported), "--adapters", "3"]) == 0
    assert "skipped: failed 1" in capsys.readouterr().out
    dirs = [str(TINY_ADAPTERS_DIR / n) for n in ("acme", "globex")]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    common = ["--embedded", "--no-progress", "--probe-interval", "0.05", "--max-loras", "2"]
    assert main(["run", str(DEMO_TRACE), *common, "--out", str(run_a), "--scheduler", "fcfs"]) == 0
    assert main(["run", str(trace), *common, "--out", str(run_b), "--embedded-adapters", *dirs, "--speed", "20"]) == 0
    report = json.loads((run_a / "report.json").read_text())
    assert report["statuses"]["by_status"]["200"] == 12 and report["meta"]["target"]["config"]["scheduler"] == "fcfs"
    assert {"ttft_cdf.png", "tenant_share.png"} <= {p.name for p in run_a.iterdir()}
    assert json.loads((run_b / "report.json").read_text())["statuses"]["by_outcome"] == {"ok": 6}
    capsys.readouterr()
    plot = tmp_path / "cmp.png"
    assert main(["compare", str(run_a), str(run_b), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "TTFT p95 s" in out and "status 200" in out and plot.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit, match="need --embedded"):
        main(["run", str(DEMO_TRACE), "--url", "http://127.0.0.1:9", "--max-loras", "2"])


def test_ctrl_c_writes_the_partial_report(tmp_path):
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        '{"arrival_s": 0.0, "tenant": "demo", "model": "acme", "prompt": "Hi", "max_tokens": 8}\n'
        '{"arrival_s": 600.0, "tenant": "demo", "model": "globex", "prompt": "Hi", "max_tokens": 8}\n'
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lorapage.cli", "replay", "run", str(trace), "--embedded", "--out", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once Ctrl-C is handled
        assert "Ctrl-C writes the partial report" in line, line
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["interrupted"] is True
    outcomes = [json.loads(x)["outcome"] for x in (out / "records.jsonl").read_text().splitlines()]
    assert len(outcomes) == 2 and outcomes[1] == "not_sent" and outcomes[0] in ("ok", "interrupted")
    assert "interrupted" in stdout or "report in" in stdout
