#!/usr/bin/env bash
# On the device: join the staged vLLM wheel (copied part by part into /tmp/vllm-parts by earlier calls), check its
# sha256, install it and the runtime wheels with --no-deps into /tmp/vllm-site, then a smoke import.
#   cp .device/vllm/parts/vllm.whl.part.aa /tmp/vllm-parts/   (one call per part, back to back; see docs/serving.md "GPU checks")
#   bash scripts/device/vllm_install.sh                         (carry .device/vllm/runtime-a, later runtime-b)
set -euo pipefail
site=/tmp/vllm-site
parts=/tmp/vllm-parts
mkdir -p "$site" "$parts"
if [ ! -f "$site/.installed" ]; then
  for dir in .device/vllm/runtime-a .device/vllm/runtime-b; do  # whichever travelled with this call
    [ -d "$dir" ] && cp "$dir"/*.whl "$parts/" 2>/dev/null || true
  done
  [ -f .device/vllm/parts/WHEEL_NAME ] && cp .device/vllm/parts/WHEEL_NAME .device/vllm/parts/SHA256 "$parts/"
  if ls "$parts"/vllm.whl.part.* >/dev/null 2>&1 && [ "$(ls "$parts"/vllm.whl.part.* | wc -l)" -ge 5 ] \
      && ls "$parts"/numba-*.whl >/dev/null 2>&1 && ls "$parts"/pyzmq-*.whl >/dev/null 2>&1; then
    wheel="$parts/$(cat "$parts/WHEEL_NAME")"
    cat "$parts"/vllm.whl.part.* > "$wheel"
    echo "$(cat "$parts/SHA256")  $wheel" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" "$parts"/*.whl
    touch "$site/.installed"
  else
    echo "staged so far: $(ls "$parts" | wc -l) files"; exit 0
  fi
fi
PYTHONPATH=$site python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
