#!/usr/bin/env bash
# Stage vLLM for the device machine (it has torch 2.11 and no network): the vLLM wheel split into parts of < 58 MB
# (one part per `run` call, calls back to back) and the runtime wheels it needs beyond the image, pinned in
# scripts/device/vllm-runtime.txt (name-version per line, resolved by hand: the full requirement set does not
# resolve from the registry; see that file). Writes .device/vllm/{parts,runtime-a,runtime-b}/.
#   bash scripts/device/vllm_stage.sh [VLLM_VERSION]          (default 0.24.0: pins torch==2.11.0, the image's)
# On the device: bash scripts/device/vllm_install.sh (join + pip install --no-deps --target /tmp/vllm-site).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-0.24.0}
out=.device/vllm
mkdir -p "$out/parts" "$out/runtime-a" "$out/runtime-b" "$out/download"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
if ! ls "$out"/parts/vllm.whl.part.* >/dev/null 2>&1; then
  python3 -m pip download -q "${plat[@]}" -d "$out/download" "vllm==$version"
  wheel=$(ls "$out"/download/vllm-"$version"-*.whl)
  basename "$wheel" > "$out/parts/WHEEL_NAME"
  split -b 58000000 "$wheel" "$out/parts/vllm.whl.part."
  sha256sum "$wheel" | cut -d' ' -f1 > "$out/parts/SHA256"
fi
while read -r pinned; do
  [ -z "$pinned" ] && continue
  name=${pinned%-*}; pin=${pinned##*-}
  ls "$out"/runtime-*/"${name}"-"${pin}"-*.whl >/dev/null 2>&1 && continue
  python3 -m pip download -q "${plat[@]}" -d "$out/download" "${name}==${pin}"
done < scripts/device/vllm-runtime.txt
# the runtime wheels in two carries of < 60 MB each (largest first into whichever holds less)
python3 - "$out" <<'PY'
import pathlib, shutil, sys
out = pathlib.Path(sys.argv[1])
wheels = sorted((p for p in (out / "download").glob("*.whl") if not p.name.startswith("vllm-")), key=lambda p: -p.stat().st_size)
sizes = {"runtime-a": 0, "runtime-b": 0}
for wheel in wheels:
    lighter = min(sizes, key=sizes.get)
    shutil.copy(wheel, out / lighter / wheel.name)
    sizes[lighter] += wheel.stat().st_size
print({k: f"{v / 1e6:.1f} MB" for k, v in sizes.items()})
PY
ls -la "$out/parts"
