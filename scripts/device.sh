#!/usr/bin/env bash
# On the GPU machine (the `device` tool): assemble the staged embedded target, install the wheels the
# machine lacks, point eaglet at them, then run "$@". Staging: ../shared/device/README.md.
set -euo pipefail
GGUF=/tmp/eaglet/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ]; then
  cp .device/model.part.ab /tmp/eaglet/
  cat /tmp/eaglet/model.part.* > "$GGUF"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 EAGLET_CACHE=/tmp/eaglet/cache EAGLET_EMBEDDED_GGUF=$GGUF
python3 -m eaglet.cli target info --json > /dev/null
"$@"
