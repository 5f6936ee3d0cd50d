# Sourced by scripts/serve, scripts/test and scripts/replay: defines `lorapage_setup [EXTRA]`,
# which makes .venv if missing, installs lorapage (with EXTRA, e.g. dev) into it once, and puts
# its bin/ first on PATH. A function, not code run at source time: a sourced file sees the
# caller's arguments as its own, and `scripts/serve --port 8011` must not install `.[--port]`.
# CPU machines get the CPU torch build first, so the plain `torch` range in pyproject.toml
# installs nothing more (a bare `torch` would pull a multi-GB CUDA build).
# LORAPAGE_VENV names another environment directory (default: .venv beside the scripts).
lorapage_setup() {
  local extra="${1:-}"
  local root venv py stamp
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${LORAPAGE_VENV:-$root/.venv}"
  py="$venv/bin/python"
  stamp="$venv/.lorapage-installed${extra:+-$extra}"
  if [ -n "$extra" ] && ! [[ "$extra" =~ ^[a-z][a-z0-9_-]*$ ]]; then
    echo "lorapage_setup: not an extra: '$extra'" >&2
    return 2
  fi
  if [ ! -x "$py" ]; then
    python3 -m venv "$venv"
  fi
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
}
