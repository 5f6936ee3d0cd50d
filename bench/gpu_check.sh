#!/usr/bin/env bash
# The kernels' device check, in one run (under 8 minutes on one H200):
#   1. every kernel test compiled for the GPU: the interpreter-sized comparisons, the `gpu` ones at
#      Llama-2-7B sizes, and CUDA-graph replay after adapters are swapped in the same pages;
#   2. bench/bench_kernels.py --sweep (LoRA update vs base GEMMs, 32 distinct vs 1 adapter, bytes/s;
#      paged prefill attention at Llama-2-7B sizes, Triton vs the PyTorch reference, and its error;
#      the `gpu` test in tests/kernels/test_kernels_attention.py checks it against the reference at
#      Llama-2-7B and Llama-3-8B sizes);
#   3. fp8 weight-only: bench/check_fp8.py (the fp8 engine's greedy tokens vs the bf16 one on the tiny
#      model, one Llama-2-7B projection's GEMM bf16 vs fp8);
#   3b. a short table of all of it, printed last;
#   4. on two or more GPUs, tensor parallelism over NCCL: bench/bench_tp.py (eager), then
#      bench/check_tp_graphs.py (decode CUDA graphs with the collectives inside, TP=2 graphs ==
#      TP=2 --enforce-eager == TP=1 graphs); "skipped: one GPU" otherwise.
# Logs land in $OUT (or bench/out). Works from a plain checkout: when lorapage is not installed it
# is installed in place (editable, no downloads), or failing that put on the path with a shim.
#
#   bash bench/gpu_check.sh                   # on the GPU machine
#   GPU_CHECK_TINY=1 bash bench/gpu_check.sh  # anywhere: a few CPU tests + bench --tiny, checks the script
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/bench/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi

if ! "$py" -c "import lorapage.kernels" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e "$root" >"$out/install.log" 2>&1 || true
fi
if ! "$py" -c "import lorapage.kernels" 2>/dev/null; then
  # lorapage.kernels lives in kernels/ (pyproject's package-dir); map it by hand.
  shim="$(mktemp -d)"
  cat >"$shim/sitecustomize.py" <<EOF
import importlib.util, sys
class _Kernels:
    def find_spec(self, name, path=None, target=None):
        if name == "lorapage.kernels":
            return importlib.util.spec_from_file_location(
                name, "$root/kernels/__init__.py", submodule_search_locations=["$root/kernels"])
        return None
sys.meta_path.append(_Kernels())
EOF
  export PYTHONPATH="$shim:$root${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ -n "${GPU_CHECK_TINY:-}" ]; then
  tests=("tests/kernels/test_kernels_backend.py::test_unknown_backend_is_rejected" "tests/kernels/test_kernels_attention.py::test_write_kv")
  bench_args=(--tiny)
else
  nvidia-smi -L || true
  tests=(tests/kernels/test_kernels_*.py tests/model/test_sampler.py::test_seeded_sampling_on_cuda_logits)
  bench_args=(--sweep)
fi
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

# One hung test must not eat the run: a per-test limit where pytest-timeout is installed.
per_test=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=120); fi
start=$(date +%s)
timeout 240 "$py" -m pytest -q -rfEs -p no:cacheprovider --durations=15 --junitxml="$out/kernel_tests.xml" \
  "${per_test[@]}" "${tests[@]}" 2>&1 | tee "$out/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}
tests_s=$(( $(date +%s) - start ))

start=$(date +%s)
timeout 180 "$py" bench/bench_kernels.py "${bench_args[@]}" 2>&1 | tee "$out/bench_kernels.log"
bench_rc=${PIPESTATUS[0]}
bench_s=$(( $(date +%s) - start ))

# fp8 weight-only (kernels/linear_fp8.py): the fp8 engine's greedy tokens against the bf16 one on the
# tiny model with its demo adapters, and a Llama-2-7B projection's GEMM timed both ways.
start=$(date +%s)
(cd bench && timeout 150 "$py" check_fp8.py ${GPU_CHECK_TINY:+--tiny}) 2>&1 | tee "$out/fp8.log"
fp8_rc=${PIPESTATUS[0]}
fp8_s=$(( $(date +%s) - start ))

# Tensor parallelism over NCCL (docs/parallel.md), where the machine has two GPUs (NCCL refuses
# two ranks on one device): TP=1 vs TP=2 eager on cuda:0 and cuda:1, tokens compared; then decode
# CUDA graphs with the collectives captured inside: TP=2 with graphs == TP=2 --enforce-eager ==
# TP=1 with graphs, greedy tokens, and the TP=2 decode steps replayed (bench/check_tp_graphs.py).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
tp_graphs_rc=0
if [ -z "${GPU_CHECK_TINY:-}" ] && [ "$gpus" -ge 2 ]; then
  (cd bench && timeout 240 "$py" bench_tp.py --device cuda --rounds 1 --tokens 16) 2>&1 | tee "$out/bench_tp.log"
  (cd bench && timeout 300 "$py" check_tp_graphs.py --device cuda --tokens 16) 2>&1 | tee "$out/tp_graphs.log"
  tp_graphs_rc=${PIPESTATUS[0]}
  tp_note="$([ "$tp_graphs_rc" -eq 0 ] && echo ok || echo "FAILED (rc $tp_graphs_rc)")"
else
  tp_note="skipped: $gpus GPU(s), NCCL needs a device per rank"
fi

"$py" - "$out" "$tests_rc" "$tests_s" "$bench_rc" "$bench_s" "$tp_note" "$fp8_rc" "$fp8_s" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
out, tp_note = sys.argv[1], sys.argv[6]
tests_rc, tests_s, bench_rc, bench_s, fp8_rc, fp8_s = map(int, sys.argv[2:6] + sys.argv[7:9])
counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
try:
    suite = ET.parse(f"{out}/kernel_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in counts}
except (OSError, ET.ParseError, AttributeError):
    pass
bench = {}
try:
    lines = [l for l in open(f"{out}/bench_kernels.log").read().splitlines() if l.strip()]
    bench = json.loads(lines[-1])
except (OSError, IndexError, ValueError):
    pass
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
rows = [("kernel tests", f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped",
         "all pass", f"rc {tests_rc}, {tests_s} s")]
if bench:
    rows += [
        ("LoRA 32 distinct / 1 adapter (all)", f"{bench['ratio_distinct_vs_one_all']:.2f}", f"<= {bench['target_ratio']}", ""),
        ("LoRA / base GEMM, attention-only", f"{bench['fraction_of_base_attention']:.1%}", f"<= {bench['target_fraction_attention']:.0%}",
         f"{bench['lora_attention_distinct_us']:.0f} / {bench['base_gemm_us']:.0f} us"),
        ("LoRA / base GEMM, all modules", f"{bench['fraction_of_base_all']:.1%}", f"<= {bench['target_fraction_all']:.0%}",
         f"{bench['lora_all_distinct_us']:.0f} / {bench['base_gemm_us']:.0f} us"),
        ("bytes/s vs copy bandwidth", f"{bench['fraction_of_copy_bandwidth']:.1%}", "",
         f"{bench['achieved_bytes_per_s'] / 1e12:.2f} of {bench['copy_bytes_per_s'] / 1e12:.2f} TB/s"),
        ("prefill attention, PyTorch / Triton", f"{bench['prefill_attention_speedup']:.2f}x",
         f"err<{bench['target_prefill_rel_err']:.0e}",
         f"{bench['prefill_attention_ref_us']:.0f} / {bench['prefill_attention_triton_us']:.0f} us, "
         f"{bench['prefill_attention_tflops']:.0f} TFLOP/s, err {bench['prefill_attention_rel_err']:.1e}"),
    ]
fp8 = {}
try:
    fp8 = json.loads([l for l in open(f"{out}/fp8.log").read().splitlines() if l.strip()][-1])
except (OSError, IndexError, ValueError):
    pass
if fp8:
    rows.append(("fp8 / bf16 weights (check_fp8.py)", f"{fp8['requests_agree']} / {fp8['requests']} requests agree",
                 ">= half", f"GEMM {fp8['gemm_shape']}: {fp8['gemm_fp8_us']:.0f} / {fp8['gemm_bf16_us']:.0f} us, "
                 f"rc {fp8_rc}, {fp8_s} s"))
else:
    rows.append(("fp8 / bf16 weights (check_fp8.py)", "FAILED", "", f"rc {fp8_rc}, {fp8_s} s"))
rows.append(("TP=2 CUDA graphs (check_tp_graphs.py)", tp_note, "", "bench_tp.py beside it"))
rows.append(("bench_kernels.py", "ok" if bench_rc == 0 and bench else "FAILED", "", f"rc {bench_rc}, {bench_s} s"))
print()
print(f"gpu_check on {bench.get('device', '?')}")
for name, value, target, note in rows:
    print(f"  {name:<36} {value:<32} {target:<9} {note}")
EOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$fp8_rc" -eq 0 ] && [ "$tp_graphs_rc" -eq 0 ]
