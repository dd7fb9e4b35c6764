#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine (only Python >= 3.10 and pip needed), then runs:
#   bash scripts/dev.sh demo [eaglet demo options]   the main job on the embedded target
#   bash scripts/dev.sh test [pytest options]        ruff (format, import order, lint), then the test suite
#   bash scripts/dev.sh eaglet ARGS...               any eaglet command inside the project venv
# Set-up: a venv in .venv (EAGLET_VENV overrides); torch's CPU build where no NVIDIA GPU is visible
# (torch==2.13.0), a normal torch elsewhere; then eaglet itself in editable mode. Re-runs skip what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${EAGLET_VENV:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "eaglet setup: NVIDIA GPU found, installing torch" >&2
    pip_install torch
  else
    echo "eaglet setup: no GPU, installing the CPU build of torch 2.13.0" >&2
    pip_install torch==2.13.0 || pip_install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi

stamp="$venv/.eaglet-setup"
want=$(cat pyproject.toml "$0" | "$py" -c "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "eaglet setup: installing eaglet, its test dependencies and speculators (the consumer tests run)" >&2
  pip_install -e ".[test]"
  pip_install --no-deps "speculators==0.9.0"  # pyproject.toml's test extra says why --no-deps
  echo "$want" > "$stamp"
fi

command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
  demo) exec "$venv/bin/eaglet" demo "$@" ;;
  test)
    "$venv/bin/ruff" format --check --quiet src tests benchmarks scripts
    "$venv/bin/ruff" check --quiet src tests benchmarks scripts
    exec "$py" -m pytest -q "$@" ;;
  eaglet) exec "$venv/bin/eaglet" "$@" ;;
  *) echo "usage: bash scripts/dev.sh demo|test|eaglet [args...]" >&2; exit 2 ;;
esac
