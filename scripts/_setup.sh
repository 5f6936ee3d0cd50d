# Sourced by scripts/serve and scripts/test: make .venv if missing and install lorapage into it.
# CPU machines get the CPU torch build first, so the plain `torch` range in pyproject.toml
# installs nothing more (a bare `torch` would pull a multi-GB CUDA build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extra="${1:-}"
stamp="$venv/.lorapage-installed${extra:+-$extra}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$py" -m pip install -q --upgrade pip
  if ! "$py" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "$py" -m pip install -q torch
    else
      "$py" -m pip install -q "torch==2.13.0"
    fi
  fi
  "$py" -m pip install -q -e "$root${extra:+[$extra]}"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
